"""11. Deadlines and fallbacks (docs/deadlines.md).

- Overload: a synthetic model with 2 slots (~0.4 s a request: 16 tokens at 40 tok/s) offered
  twice what it serves (open loop, a request every 0.1 s), half from a tenant whose requests
  need their first token within DEADLINE_MS, half from one with no deadline; a second model
  alike is the fallback. Today's behaviour (FIFO until queue_timeout_s, no deadline sent)
  against the deadline sent as x-slo-ttft-ms with fallbacks = ["spare"]. Goodput: the
  deadline tenant's requests whose first token came within the deadline, per second of the
  run; misses: its requests served late or failed after waiting (a 503 at once is no miss:
  the client heard at once); what the other tenant got.
- Admission's CPU with the prediction: in process, admission (tenant, scope, limits, the
  job, its queue) with the model's real prediction and a deadline, against the same with
  the prediction stubbed out (the variants take turns, best of 7); and the µs it adds
  against the supervisor's whole CPU per request, measured over HTTP.
- Prediction error: SmolLM2-135M on llama-server (2 slots) under a stepped load (1, 2, 4, 8
  closed-loop streaming callers): measured TTFT against the x-ttft-predicted-ms each answer
  carried, p50 and p90 of each and of the absolute error, per step."""

from __future__ import annotations

import asyncio
import time

import httpx

from pool_bench.bench import Bench
from pool_bench.children import PoolProc
from pool_bench.fairness import run_now, smollm2_model
from pool_bench.load import pct
from pool_bench.report import loadavg, say, table

DEADLINE_MS = 1000
KEYS = {"slo": "sk-bench-slo", "bulk": "sk-bench-bulk"}
SLOW = {"backend": "synthetic", "target_inflight": 2, "max_queue": 1024, "queue_timeout_s": 10.0,
        "options": {"capacity": 2, "tokens_per_second": 40, "output_tokens": 16}}


async def one_stream(http: httpx.AsyncClient, model: str, key: str, headers: dict, max_tokens: int = 16) -> dict:
    """One streamed chat request: its status, TTFT (s; None without a token) and headers."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there"}]}
    start = time.monotonic()
    ttft = None
    async with http.stream("POST", "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}", **headers}) as r:
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.monotonic() - start
        failed = r.status_code != 200 or ttft is None
        return {"status": r.status_code, "ttft": ttft, "failed": failed, "elapsed": time.monotonic() - start,
                "served_by": r.headers.get("x-llm-pool-served-by"),
                "predicted_ttft": int(r.headers["x-ttft-predicted-ms"]) / 1000
                if "x-ttft-predicted-ms" in r.headers else None}


async def open_loop(url: str, model: str, seconds: float, with_deadline: bool) -> list[tuple[str, dict]]:
    """A request every 0.1 s for `seconds`, alternating the tenants; every answer, by tenant."""
    results: list[tuple[str, dict]] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        async def send(tenant: str) -> None:
            headers = {"x-slo-ttft-ms": str(DEADLINE_MS)} if with_deadline and tenant == "slo" else {}
            try:
                results.append((tenant, await one_stream(http, model, KEYS[tenant], headers)))
            except httpx.HTTPError as exc:
                results.append((tenant, {"status": 0, "ttft": None, "failed": True, "error": repr(exc)}))
        tasks, start, n = [], time.monotonic(), 0
        while time.monotonic() - start < seconds:
            tasks.append(asyncio.create_task(send("slo" if n % 2 == 0 else "bulk")))
            n += 1
            await asyncio.sleep(max(0.0, start + n * 0.1 - time.monotonic()))
        await asyncio.gather(*tasks)
    return results


def overload(bench: Bench, rows: list, out: dict) -> None:
    seconds = 8.0 if bench.quick else 20.0
    models = [{**SLOW, "name": "main-fifo"}, {**SLOW, "name": "main", "fallbacks": ["spare"]},
              {**SLOW, "name": "spare"}]
    say("section 11: a pool with a 2-slot synthetic model offered twice its capacity")
    pool = PoolProc(bench.tmp, "pool-deadlines", models,
                    tenants=[{"name": name, "keys": [key]} for name, key in KEYS.items()])
    try:
        pool.ready()
        for label, model, with_deadline in (("today: FIFO until queue_timeout_s", "main-fifo", False),
                                            ("x-slo-ttft-ms + fallbacks", "main", True)):
            results = asyncio.run(open_loop(pool.url, model, seconds, with_deadline))
            slo = [r for tenant, r in results if tenant == "slo"]
            bulk = [r for tenant, r in results if tenant == "bulk"]
            met = [r for r in slo if r["ttft"] is not None and r["ttft"] * 1000 <= DEADLINE_MS]
            refused = [r for r in slo if r["status"] == 503 and r.get("elapsed", 99) < 0.5]
            missed = len(slo) - len(met) - len(refused)
            spilled = sum(r.get("served_by") == "spare" for r in slo)
            goodput = len(met) / seconds
            out[model] = {"goodput_per_s": goodput, "slo_requests": len(slo), "met": len(met),
                          "refused_at_once": len(refused), "missed": missed, "spilled": spilled,
                          "bulk_served": sum(not r["failed"] for r in bulk), "bulk": len(bulk)}
            bulk_ttft = [r["ttft"] for r in bulk if r["ttft"] is not None]
            rows.append([label, f"{goodput:.2f} req/s met {DEADLINE_MS} ms",
                         f"deadline tenant: {len(met)}/{len(slo)} met, {missed} missed "
                         f"({missed / max(len(slo), 1):.0%}), {len(refused)} refused at once, {spilled} by the "
                         f"fallback; other tenant: {out[model]['bulk_served']}/{len(bulk)} served, TTFT p50 "
                         f"{(pct(bulk_ttft, 50) or 0) * 1000:.0f} ms"])
        ratio = out["main"]["goodput_per_s"] / max(out["main-fifo"]["goodput_per_s"], 1e-9)
        out["goodput_ratio"] = ratio
        rows.append(["goodput ratio", f"{ratio:.2f}x", "deadline + fallbacks against today"])
    finally:
        pool.stop()


def admission_cpu(iterations: int, lanes: int) -> dict[str, float]:
    """µs per request: admission, its job made and queued, with the prediction and a deadline
    against the prediction stubbed out (the same model: 2 replicas, `lanes` tenants' requests queued)."""
    from types import SimpleNamespace

    from protocol import Done
    from supervisor.admission.admit import Admission
    from supervisor.config import parse_config
    from supervisor.scheduling.deadlines import Prediction, predict
    from supervisor.scheduling.fair_queue import FairQueue
    from supervisor.scheduling.jobs import Job
    from supervisor.scheduling.latency_predictor import ModelPredictor
    from supervisor.states import ModelState, ReplicaState
    from supervisor.admission.tenants import Tenants

    cfg = parse_config({"tenants": [{"name": f"t{i}", "keys": [f"sk-tenant-{i:03d}"], "rpm": 10**9,
                                     "tpm": 10**12} for i in range(20)]})
    tenants = Tenants(cfg)
    queue = FairQueue(tenants.share, tenants.output_weight)
    for i in range(lanes):  # a backlog: one request of each of `lanes` tenants
        queue.push(Job("synth", {"messages": []}, 600, tenant=f"t{i}"))
    predictor = ModelPredictor()
    for _ in range(20):
        predictor.observe("synth/0", {"queued_ms": 10.0, "ttft_ms": 60.0, "duration_ms": 400.0, "tokens_in": 20,
                                      "tokens_out": 16}, 200)
    replicas = [SimpleNamespace(state=ReplicaState.READY, capacity=2, free_slots=0, name=f"synth/{i}", info={})
                for i in range(2)]
    entry = SimpleNamespace(cfg=SimpleNamespace(name="synth", aliases=(), slo_ttft_ms=None, slo_tpot_ms=None,
                                                target_inflight=2, replicas=2),
                            executor=SimpleNamespace(queue=queue, replicas=replicas), predictor=predictor,
                            waiting=[], state=ModelState.LOADED, load_started=None, load_seconds=1.0)
    fixed = Prediction(0, 0.0, 0.0, None)

    class Engine:
        def __init__(self, predicting: bool) -> None:
            self.predicting = predicting

        def entry(self, name):
            return entry

        def make_job(self, entry, request, endpoint, tenant="default", headers=None) -> Job:
            return Job("synth", request, 600, None, endpoint, tenant=tenant)

        async def prompt_tokens(self, entry, request, endpoint):
            return None

        def predict(self, entry, tenant, frame_bytes):
            return predict(entry, tenant, frame_bytes) if self.predicting else fixed

        def enqueue(self, entry, job, prompt_tokens=None) -> None:
            queue.push(job)

    request = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    done = Done(job="", finish_reason="stop", usage={"input_tokens": 2, "output_tokens": 16})
    variants = (("prediction stubbed, no deadline", False, {}),
                ("prediction + x-slo-ttft-ms", True, {"x-slo-ttft-ms": "600000"}))
    tenant = tenants.by_name["t7"]
    results: dict[str, float] = {}
    for _ in range(7):  # the variants take turns, best of 7 each: a noisy machine slows both alike
        for label, predicting, headers in variants:
            admission = Admission(Engine(predicting), tenants)
            t0 = time.perf_counter()
            for _ in range(iterations):
                job = run_now(admission.admit(tenant, "synth", request, "chat", headers))
                queue.remove(job)
                job.finish(done)
            elapsed = (time.perf_counter() - t0) / iterations * 1e6
            results[label] = min(results.get(label, elapsed), elapsed)
    return results


def request_cpu_us(bench: Bench) -> float | None:
    """The supervisor's CPU per request over HTTP (µs): a non-streaming chat request on a
    synthetic model, 4 callers at once, what a whole request costs the supervisor (the
    measure the prediction's added µs are read against)."""
    from pool_bench.bench import synthetic_model
    from pool_bench.children import CpuMeter
    from pool_bench.load import load, plain_call

    pool = PoolProc(bench.tmp, "pool-deadlines-cpu", [synthetic_model("synth", 4, 16)])
    try:
        pool.ready()
        load(plain_call(pool.url, "synth", 16), 100, 4, 20, raw_url=pool.url)  # warm-up
        meter = CpuMeter([pool.pid])
        before = meter.total()
        done = load(plain_call(pool.url, "synth", 16), 300 if bench.quick else 2000, 4, 60, raw_url=pool.url).done
        return (meter.total() - before) / done * 1e6 if done else None
    finally:
        pool.stop()


def prediction_error(bench: Bench, rows: list, out: dict) -> None:
    model = smollm2_model(bench, "section 11", slots=2, ctx_per_slot=2048)
    if model is None:
        return
    step_s = 6.0 if bench.quick else 15.0
    say("section 11: SmolLM2 on llama-server (2 slots) under a stepped load")
    pool = PoolProc(bench.tmp, "pool-deadlines-llama", [model])
    try:
        pool.ready()
        out["prediction_error"] = {}

        async def step(callers: int) -> list[dict]:
            got: list[dict] = []
            deadline = time.monotonic() + step_s
            async with httpx.AsyncClient(base_url=pool.url, timeout=120) as http:
                async def caller() -> None:
                    while time.monotonic() < deadline:
                        got.append(await one_stream(http, "smollm2", "unused", {}, max_tokens=16))
                await asyncio.gather(*(caller() for _ in range(callers)))
            return got

        asyncio.run(step(1))  # warm-up: the predictor learns the speeds
        for callers in (1, 2, 4, 8):
            got = [r for r in asyncio.run(step(callers)) if r["ttft"] is not None and r["predicted_ttft"] is not None]
            measured, predicted = [r["ttft"] for r in got], [r["predicted_ttft"] for r in got]
            errors = [abs(r["ttft"] - r["predicted_ttft"]) for r in got]
            figures = {"requests": len(got), "measured_p50": pct(measured, 50), "measured_p90": pct(measured, 90),
                       "predicted_p50": pct(predicted, 50), "predicted_p90": pct(predicted, 90),
                       "abs_error_p50": pct(errors, 50), "abs_error_p90": pct(errors, 90)}
            out["prediction_error"][callers] = figures

            def f(v):
                return "-" if v is None else f"{v * 1000:.0f}"
            rows.append([f"SmolLM2, {callers} streaming callers", f"TTFT p50 {f(figures['measured_p50'])} / p90 "
                         f"{f(figures['measured_p90'])} ms; predicted p50 {f(figures['predicted_p50'])} / p90 "
                         f"{f(figures['predicted_p90'])} ms", f"|error| p50 {f(figures['abs_error_p50'])} / p90 "
                         f"{f(figures['abs_error_p90'])} ms ({len(got)} requests)"])
    finally:
        pool.stop()


def run(bench: Bench) -> None:
    load_before = loadavg()
    out: dict = {}
    rows: list = []
    overload(bench, rows, out)
    out["admission_us"] = {}
    whole = out["request_cpu_us"] = request_cpu_us(bench)
    for lanes in (2, 20):
        costs = out["admission_us"][lanes] = admission_cpu(2000 if bench.quick else 20000, lanes)
        base = costs["prediction stubbed, no deadline"]
        for label, us in costs.items():
            rows.append([f"admission CPU, {lanes} tenants queued: {label}", f"{us:.1f} µs per request",
                         f"{(us / base - 1) * 100:+.0f}% of admission"])
        added = costs["prediction + x-slo-ttft-ms"] - base
        if whole:
            rows.append([f"the prediction's share of a request, {lanes} tenants queued",
                         f"+{added:.1f} µs of {whole:.0f} µs", f"{added / whole * 100:+.1f}% of the supervisor's "
                                                                f"CPU per request"])
    prediction_error(bench, rows, out)
    bench.out["sections"]["deadlines"] = out
    text = table(["what", "figure", "note"], rows)
    text += (f"\n\nOverload: synthetic models with 2 slots, 16 tokens at 40 tok/s per request (~0.4 s: 5 "
             f"requests/s), offered 10 requests/s for the run, alternating a tenant whose requests need their "
             f"first token within {DEADLINE_MS} ms and one with no deadline; queue_timeout_s 10. Goodput: the "
             f"deadline tenant's requests served within it, per second of the run. Admission CPU: in process, "
             f"the variants in turn, best of 7, a backlog of 2 or 20 tenants' requests on a 2-replica model "
             f"(the place in the fair queue is one pass over its tenants' lanes). A request's supervisor CPU: "
             f"non-streaming chat over HTTP on a synthetic model (16 tokens, 4 callers), user + system CPU of "
             f"the supervisor process per request served. Prediction error: what each "
             f"answer's x-ttft-predicted-ms said against its measured TTFT (client side, streamed, 16 tokens), "
             f"after a warm-up step. 1-min load average: {load_before} before, {loadavg()} after.")
    bench.emit("11. Deadlines and fallbacks: goodput under overload, admission's CPU, prediction error", text)
