"""--price (with --against REF): what each step of a request costs the supervisor, in µs of CPU,
on both sides. Section 2's load (non-streaming chat, synthetic backend, 16 tokens) at c = 16,
whole runs alternating A B B A, each with py-spy sampling the supervisor (raw stacks,
--nonblocking, so a thread is sampled only while it runs: samples / rate is CPU time). A step's
price is the CPU under its function (inclusive), per request; the functions are found by name,
so a step whose code moved between files is still found, and a renamed one is listed under both
names. What no step names (the event loop's own work, uvicorn between the steps) is the rest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import tomli_w

from pool_bench import against, profile
from pool_bench.children import CpuMeter, Proc, wait_http
from pool_bench.load import load, plain_call
from pool_bench.report import say, table
from procutil.net import free_port
from testkit import ROOT
from testkit.waits import wait_for

RATE = 250  # samples a second
CONCURRENCY = 16

# (step, functions by qualified name: their inclusive CPU is summed; "-name": subtracted). The
# functions of one step never call each other, so nothing is counted twice within a step.
STEPS = [
    ("read and bound the HTTP request (edge, uvicorn's parser)", ["BoundedConnection.data_received"]),
    ("guard: request id, tenant key, refusals", ["HttpEdge.__call__", "-HttpEdge._serve"]),
    ("body: decode and validate", ["request_body"]),
    ("admission, whole", ["Admission.admit"]),
    ("admission: of it, the job (bounds, Submit frame)", ["ModelRouterEngine.make_job"]),
    ("admission: of it, the prediction", ["predict"]),
    ("admission: of it, queue, hand-over, ZeroMQ send", ["ModelRouterEngine.enqueue"]),
    ("worker frames in: receive, decode, route", ["LoopSocket._service"]),
    ("waiting for the job (its events)", ["InferenceSurface.collect"]),
    ("the answer's JSON", ["chat_completion"]),
    ("writing the response", ["Response.__call__"]),
    ("socket writes (coalesced)", ["CoalescedWrites._flush"]),
    ("metrics", ["Metrics.job_done", "-ModelRouterEngine.learn", "-Metrics.request"]),
    ("the request's figures and log row", ["Metrics.request"]),
    ("the request log's writer thread", ["BatchWriter._run"]),
    ("learning (latency predictor)", ["ModelRouterEngine.learn"]),
]


def qualname(frame: str) -> str:
    """'Class.method (path/file.py:12)' -> 'Class.method'."""
    return frame.split(" (", 1)[0]


def read_raw(path: Path) -> tuple[Counter, int]:
    """Inclusive samples per qualified function name (once per stack), and all samples."""
    inclusive, total = Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        for name in {qualname(f) for f in stack.split(";")}:
            inclusive[name] += int(count)
    return inclusive, total


def one_run(name: str, root: Path, python: str, tmp: Path, requests: int) -> dict:
    """One side's pool, warmed up, then `requests` at c = 16 with py-spy recording it."""
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(tomli_w.dumps({
        "server": {"host": "127.0.0.1", "port": port, "state_dir": str(tmp / f"{name}-state")},
        "models": [{"name": "synth", "backend": "synthetic", "target_inflight": 64, "max_queue": 1024,
                    "options": {"capacity": 64, "tokens_per_second": 0, "output_tokens": 16}}]}))
    url = f"http://127.0.0.1:{port}"
    pool = Proc(f"pool-{name}", [python, "-m", "supervisor.cli", "serve", "--config", str(config),
                                 "--log-level", "warning"], tmp / f"{name}.log", env=against.side_env(root), cwd=root)
    raw = tmp / f"{name}.raw"
    spy = None
    try:
        wait_http(pool, url + "/ready", 180)
        load(plain_call(url, "synth", 16), 500, CONCURRENCY, 60, raw_url=url)  # warm
        spy = Proc("py-spy", [profile.py_spy(), "record", "--nonblocking", "--format", "raw", "--rate", str(RATE),
                              "-o", str(raw), "--pid", str(pool.pid)], tmp / f"{name}-py-spy.log")
        wait_for(lambda: profile.ATTACHED in spy.log_tail() or not spy.alive(), 30, interval=0.1,
                 what="py-spy attached")
        meter = CpuMeter([pool.pid])
        before = meter.total()
        done = load(plain_call(url, "synth", 16), requests, CONCURRENCY, 300, raw_url=url).done
        cpu = meter.total() - before
        spy.popen.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        spy.popen.wait(60)
    finally:
        if spy is not None:
            spy.stop()
        pool.stop()
    inclusive, total = read_raw(raw)
    return {"done": done, "cpu_s": cpu, "samples": total, "inclusive": dict(inclusive)}


def price(runs: list[dict]) -> tuple[dict[str, float], float, float]:
    """Per function name, µs of CPU per request over the runs; the measured and the sampled total."""
    done = sum(r["done"] for r in runs) or 1
    inclusive: Counter = Counter()
    for r in runs:
        inclusive.update(r["inclusive"])
    per_sample = 1e6 / RATE / done
    return ({k: v * per_sample for k, v in inclusive.items()}, sum(r["cpu_s"] for r in runs) * 1e6 / done,
            sum(r["samples"] for r in runs) * per_sample)


def step_price(prices: dict[str, float], names: list[str]) -> float:
    return sum(-prices.get(n[1:], 0.0) if n.startswith("-") else prices.get(n, 0.0) for n in names)


def run(args) -> int:
    if profile.py_spy() is None:
        raise SystemExit("scripts/bench --price needs py-spy (pip install -e '.[bench]')")
    sha = against.resolve(args.against)
    ref_root = against.checkout(sha)
    ref_python, _ = against.environment(ref_root)
    against.code_of(ref_python, ref_root)
    sides = {"A": (ref_root, ref_python), "B": (ROOT, sys.executable)}
    requests = 3000 if args.quick else 25000
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"price-{sha[:9]}-runs-", dir=out)).resolve()  # raw stacks, by the table
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i, side in enumerate("A" if who == "ref" else "B" for who in against.order(args.rounds)):
        say(f"--price: run {i + 1}, {side} ({'the ref' if side == 'A' else 'this checkout'})")
        runs[side].append(one_run(f"{side}{i}", *sides[side], tmp, requests))
    (a, a_cpu, a_sampled), (b, b_cpu, b_sampled) = price(runs["A"]), price(runs["B"])
    rows = [[step, f"{step_price(a, names):.1f}", f"{step_price(b, names):.1f}",
             f"{step_price(b, names) - step_price(a, names):+.1f}"] for step, names in STEPS]
    rows.append(["all, measured (psutil)", f"{a_cpu:.0f}", f"{b_cpu:.0f}", f"{b_cpu - a_cpu:+.0f}"])
    rows.append(["all, sampled (py-spy)", f"{a_sampled:.0f}", f"{b_sampled:.0f}", f"{b_sampled - a_sampled:+.0f}"])
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    text = (f"## scripts/bench --price against {sha[:9]}: µs of supervisor CPU per request, c = {CONCURRENCY}\n\n"
            f"A = {sha[:9]}, B = this checkout ({head}); {args.rounds} run(s) a side of {requests} requests, "
            f"A B B A; py-spy at {RATE} Hz, without pausing the process.\n\n"
            + table(["step (inclusive)", "A", "B", "B - A"], rows))
    print(text)
    (out / f"price-{sha[:9]}.md").write_text(text + "\n")
    (out / f"price-{sha[:9]}.json").write_text(json.dumps({"A": runs["A"], "B": runs["B"]}))
    say(f"--price: {out / f'price-{sha[:9]}.md'}; the raw stacks are in {tmp}")
    return 0
