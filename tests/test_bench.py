"""Smoke test of scripts/bench: the quick run finishes, cleans up and prints its
tables, every figure a number in a sane range and consistent with the others.
No speed is asserted: that depends on the machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.pool import ROOT

MARK = "LLM_POOL_BENCH_TEST_MARK"  # inherited by every process the benchmark starts


def _left_behind(mark: str) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                left.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or [])[:200]}")
        except psutil.Error:
            pass
    return left


def tables(report: str) -> dict[str, list[dict[str, str]]]:
    """The report's markdown tables by section number ("1" for "### 1. ..."): one
    dict per row, keyed by the column header."""
    found: dict[str, list[dict[str, str]]] = {}
    section, header = None, None
    lines = report.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("### "):
            section, header = line[4:].split(".")[0], None
        elif not line.startswith("|"):
            header = None
        elif header is None:
            assert i + 1 < len(lines) and lines[i + 1].startswith("|---"), line
            header = cells(line)
            found.setdefault(section, [])
        elif not line.startswith("|---"):
            row = cells(line)
            assert len(row) == len(header), line
            found[section].append(dict(zip(header, row)))
    return found


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(cell: str, low: float, high: float) -> float:
    """A printed figure ("1,741", "23.4"): a number within [low, high]."""
    value = float(cell.replace(",", ""))
    assert low <= value <= high, f"{cell} is outside [{low}, {high}]"
    return value


def pair(cell: str, sep: str, low: float, high: float) -> tuple[float, float]:
    a, b = cell.split(sep)
    return number(a, low, high), number(b, low, high)


def ratio_of(printed: str, a: float, b: float) -> None:
    # the ratio is computed before rounding, the figures are printed rounded
    assert abs(float(printed) - a / b) <= 0.05 * a / b + 0.01, (printed, a, b)


MS = 120_000  # no request of a quick run takes two minutes
CPU = 1e7  # µs per request or ms per 1k tokens: loose upper bounds, at 0 when idle


def check_figures(found: dict[str, list[dict[str, str]]]) -> None:
    assert set(found) == {"1", "2", "4", "5", "6"}, found.keys()  # 3 (LiteLLM) is skipped

    streaming = found["1"]
    assert [(r["model"], r["conc"]) for r in streaming] == [("tiny", "1"), ("tiny", "2"), ("tiny", "4")]
    for r in streaming:
        pair(r["requests direct/pool"], "/", 1, 1000)  # bounded in time too: the two may differ
        direct = number(r["direct tok/s"], 1, 1e6)
        pool = number(r["pool tok/s"], 1, 1e6)
        ratio_of(r["pool/direct"], pool, direct)
        for column in ("direct TTFT p50 / p95 ms", "pool TTFT p50 / p95 ms"):
            p50, p95 = pair(r[column], " / ", 0, MS)
            assert p50 <= p95, (column, r[column])
        number(r["TTFT p50 added ms"], -MS, MS)  # negative when the pool happened to be quicker
        for column in ("llama-server CPU ms/1k tok direct", "llama-server CPU ms/1k tok in pool",
                       "pool CPU ms/1k tok (supervisor + worker)"):
            number(r[column], 0, CPU)

    capacity = [r for r in found["2"] if "bare FastAPI req/s" in r]
    floor = [r for r in found["2"] if "bare+zmq+async req/s" in r]  # section 2's second table
    assert len(capacity) + len(floor) == len(found["2"])
    assert [r["conc"] for r in capacity] == [r["conc"] for r in floor] == ["1", "4", "16", "64"]
    for r, f in zip(capacity, floor):
        pair(r["requests bare/pool"], "/", 1, 1e6)
        bare = number(r["bare FastAPI req/s"], 1, 1e6)
        bare_zmq = number(r["bare+zmq req/s"], 1, 1e6)
        pool = number(r["pool req/s"], 1, 1e6)
        ratio_of(r["pool/bare"], pool, bare)
        ratio_of(r["bare+zmq/bare"], bare_zmq, bare)
        ratio_of(r["pool/(bare+zmq)"], pool, bare_zmq)
        for column in ("bare p50 / p99 ms", "pool p50 / p99 ms"):
            p50, p99 = pair(r[column], " / ", 0, MS)
            assert p50 <= p99, (column, r[column])
        number(r["bare CPU µs/req"], 0, CPU)
        pair(r["bare+zmq CPU µs/req (app + echo)"], " + ", 0, CPU)
        pair(r["pool CPU µs/req (supervisor + worker)"], " + ", 0, CPU)
        ratio_of(f["pool/(bare+zmq+async)"], pool, number(f["bare+zmq+async req/s"], 1, 1e6))
        pair(f["bare+zmq+async CPU µs/req (app + echo)"], " + ", 0, CPU)
        assert f["pool CPU µs/req (supervisor + worker)"] == r["pool CPU µs/req (supervisor + worker)"]

    relay = [r for r in found["5"] if "pool/bare CPU" in r]
    relay_floor = [r for r in found["5"] if "pool/bare CPU" not in r]  # section 5's second table
    assert [r["N streams × tok/s"] for r in relay] == [r["N streams × tok/s"] for r in relay_floor] == [
        "16 × 50", "64 × 200"]
    for r, f in zip(relay, relay_floor):
        bare, pool = pair(r["CPU per token bare / pool"].removesuffix(" µs"), " / ", 0.1, CPU)
        floor = number(f["bare+zmq CPU per token (app + worker)"].removesuffix(" µs"), 0.1, CPU)
        ratio_of(f["bare+zmq/bare CPU"], floor, bare)
        ratio_of(f["pool/(bare+zmq) CPU"], pool, floor)
        number(f["gap p99 bare+zmq"].removesuffix(" ms"), 0, MS)
    for r in relay:
        n, rate = (float(x) for x in r["N streams × tok/s"].split(" × "))
        for delivered in pair(r["delivered bare / pool (tok/s)"], " / ", 1, 1e6):
            assert delivered <= 1.1 * n * rate, (r, "more tokens/s than were sent")
        bare, pool = pair(r["CPU per token bare / pool"].removesuffix(" µs"), " / ", 0.1, CPU)
        ratio_of(r["pool/bare CPU"], pool, bare)
        bare, pool = pair(r["gap p99 bare / pool"].removesuffix(" ms"), " / ", 0, MS)
        if bare and pool:
            ratio_of(r["pool/bare gap"], pool, bare)

    (ttft,) = [r for r in found["6"] if "requests direct/pool" in r]
    pair(ttft["requests direct/pool"], "/", 10, 10)  # 2 rounds of 5, none failed
    direct = pair(ttft["direct TTFT p50 / p95 ms"], " / ", 0, MS)
    pool = pair(ttft["pool TTFT p50 / p95 ms"], " / ", 0, MS)
    assert direct[0] <= direct[1] and pool[0] <= pool[1], ttft
    added = pair(ttft["added p50 / p95 ms"], " / ", -MS, MS)
    assert abs(added[0] - (pool[0] - direct[0])) <= 0.1 + 0.02 * abs(pool[0]), ttft  # printed rounded
    # section 6's second table: the proxy floors, and the pool again, each against the same direct
    floors = {r["in front of the same llama-server"]: r for r in found["6"] if "requests direct/pool" not in r}
    assert list(floors) == ["proxy", "proxy+zmq", "pool"], floors
    assert floors["pool"]["added p50 / p95 ms"] == ttft["added p50 / p95 ms"]
    for r in floors.values():
        assert number(r["requests"], 10, 10) == 10
        p50, p95 = pair(r["TTFT p50 / p95 ms"], " / ", 0, MS)
        assert p50 <= p95, r
        floor_added = pair(r["added p50 / p95 ms"], " / ", -MS, MS)
        assert abs(floor_added[0] - (p50 - direct[0])) <= 0.1 + 0.02 * abs(p50), r

    memory = {r["process"]: r for r in found["4"]}
    assert set(memory) == {"llama_server pool (tiny)", "synthetic pool (c<=64)"}, memory.keys()
    for r in memory.values():
        idle = number(r["supervisor RSS idle MiB"], 10, 4096)
        assert number(r["supervisor RSS peak under load MiB"], idle, 4096) >= idle
        assert number(r["workers"], 1, 1) == 1
        number(r["worker RSS MiB (without backend child)"], 5, 4096)
    number(memory["llama_server pool (tiny)"]["backend child RSS MiB"], 1, 4096)  # llama-server itself
    assert memory["synthetic pool (c<=64)"]["backend child RSS MiB"] == "none"


def check_profile(report: str, path: Path) -> None:
    """Section 2's profile of the supervisor: written and said, or the report says why not
    (py-spy not installed, or not allowed to read the supervisor)."""
    if "No profile: " in report:
        assert not path.exists(), report
        return
    said = r"Profile of the supervisor under this load \(c = 16, \d+ requests, \d+ µs of CPU"
    assert re.search(said, report), report
    doc = json.loads(path.read_text())  # speedscope: frames shared by one sampled profile a thread
    assert any(p["samples"] for p in doc["profiles"]), doc
    frames = doc["shared"]["frames"]
    assert any(f["name"] == "serve" and f["file"].endswith(("supervisor/cli/main.py", "supervisor/cli/serve.py"))
               for p in doc["profiles"] for s in p["samples"] for f in (frames[i] for i in s)), "not the supervisor"


@pytest.mark.llama
@pytest.mark.timeout(600)
def test_bench_quick(llama_server_bin, tmp_path):
    mark = uuid.uuid4().hex
    env = {**os.environ, "LLAMA_SERVER_BIN": llama_server_bin, "PYTHONUNBUFFERED": "1", MARK: mark}
    try:
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench"), "--quick", "--skip-litellm",
                              "--out", str(tmp_path / "results")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
        assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
        assert (tmp_path / "results" / "results.md").read_text() == out.stdout.rstrip("\n") + "\n"
        check_figures(tables(out.stdout))
        check_profile(out.stdout, tmp_path / "results" / "profile-section2-c16.speedscope.json")
    finally:
        left = _left_behind(mark)
        for line in left:  # never leave anything behind, even when failing
            try:
                psutil.Process(int(line.split(":")[0])).kill()
            except psutil.Error:
                pass
    assert not left, f"processes left after the benchmark: {left}"


def run_bench(args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """scripts/bench with `args`; nothing it started may outlive it."""
    mark = uuid.uuid4().hex
    try:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench"), *args], cwd=cwd,
                              env={**os.environ, **env, "PYTHONUNBUFFERED": "1", MARK: mark},
                              capture_output=True, text=True, timeout=timeout)
    finally:
        left = _left_behind(mark)
        for line in left:
            try:
                psutil.Process(int(line.split(":")[0])).kill()
            except psutil.Error:
                pass
        assert not left, f"processes left after the benchmark: {left}"


@pytest.mark.timeout(300)
def test_bench_against_head(tmp_path):
    """--against HEAD, section 2 at --quick, one run a side: the ref's own checkout is made
    from git and its code is what its side runs, both sides run in turn, the table and the JSON
    carry both sides' figures. The plumbing, not the speed (one run a side gives no verdict)."""
    checkouts, results = tmp_path / "checkouts", tmp_path / "results"
    out = run_bench(["--against", "HEAD", "--sections", "2", "--quick", "--rounds", "1", "--out", "results"],
                    tmp_path, {"LLM_POOL_BENCH_CHECKOUTS": str(checkouts)}, 240)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    checkout = checkouts / sha
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert all((checkout / name).exists() for name in tracked)

    report = json.loads((results / f"against-{sha[:9]}.json").read_text())
    assert report["ref_sha"] == report["this_sha"] == sha
    assert [r["side"] for r in report["runs"]] == ["ref", "this"] and all(r["ok"] for r in report["runs"])
    assert Path(report["code"]["ref"]).is_relative_to(checkout)  # the ref's side ran the ref's code
    assert Path(report["code"]["this"]).is_relative_to(ROOT)
    for run in report["runs"]:  # each run is a whole bench of its own, its results kept
        assert json.loads((Path(run["out"]) / "results.json").read_text())["sections"]["capacity"]
    names = [f"{what}, c={c}" for c in (1, 4, 16, 64) for what in (
        "supervisor CPU µs/req", "worker CPU µs/req", "pool/bare req/s", "pool/(bare+zmq) req/s",
        "pool/(bare+zmq+async) req/s")]
    assert [r["figure"] for r in report["figures"]] == names
    for r in report["figures"]:
        assert len(r["ref"]) == len(r["this"]) == 1 and r["verdict"].startswith("?"), r
        assert r["ref_mean"] == r["ref"][0] >= 0 and r["this_mean"] == r["this"][0] >= 0, r

    rows = tables(out.stdout)["2"]
    assert [r["figure"].split(" (")[0] for r in rows] == names
    by_name = {r["figure"]: r for r in report["figures"]}
    for row in rows:
        figure = by_name[row["figure"].split(" (")[0]]
        a, b = (float(row[k].replace(",", "")) for k in ("A (ref): mean (min–max)", "B (this): mean (min–max)"))
        assert abs(a - figure["ref"][0]) <= 0.01 * a + 0.01 and abs(b - figure["this"][0]) <= 0.01 * b + 0.01, row
        if a and b:
            ratio_of(row["B/A"], b, a)
    assert (results / f"against-{sha[:9]}.md").read_text() == out.stdout


@pytest.mark.timeout(300)
def test_bench_price_against_head(tmp_path):
    """--price --against HEAD, one run a side: every step of a request is priced on both sides
    (the same code: each step's functions are found on both), and the table is the file."""
    checkouts, results = tmp_path / "checkouts", tmp_path / "results"
    out = run_bench(["--against", "HEAD", "--price", "--quick", "--rounds", "1", "--out", "results"],
                    tmp_path, {"LLM_POOL_BENCH_CHECKOUTS": str(checkouts)}, 240)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert (results / f"price-{sha[:9]}.md").read_text() == out.stdout
    rows = {row[0]: row[1:] for row in (
        [c.strip() for c in line.strip("|").split("|")] for line in out.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| step"))}
    sys.path.insert(0, str(ROOT / "scripts"))
    from pool_bench.price import STEPS
    assert list(rows) == [step for step, _ in STEPS] + ["all, measured (psutil)", "all, sampled (py-spy)"]
    for step in ("admission, whole", "admission: of it, queue, hand-over, ZeroMQ send", "all, measured (psutil)"):
        a, b, _ = (float(v) for v in rows[step])
        assert a > 0 and b > 0, (step, rows[step])  # found, and sampled, on both sides
    runs = json.loads((results / f"price-{sha[:9]}.json").read_text())
    assert len(runs["A"]) == len(runs["B"]) == 1 and all(r["done"] == 3000 for r in runs["A"] + runs["B"]), runs


def test_price_reads_raw_stacks(tmp_path):
    """A step's price: inclusive samples of its functions, once per stack, per request."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from pool_bench.price import RATE, price, read_raw, step_price
    raw = tmp_path / "x.raw"
    raw.write_text("run (a.py:1);Admission.admit (admit.py:3);predict (d.py:9) 5\n"
                   "run (a.py:1);Admission.admit (admit.py:3) 3\n"
                   "run (a.py:1);f (a.py:2);f (a.py:4) 2\n")
    inclusive, total = read_raw(raw)
    assert total == 10 and inclusive["Admission.admit"] == 8 and inclusive["f"] == 2 and inclusive["run"] == 10
    prices, measured, sampled = price([{"done": 2, "cpu_s": 1.0, "samples": total, "inclusive": inclusive}])
    per = 1e6 / RATE / 2
    assert prices["predict"] == 5 * per and sampled == 10 * per and measured == 5e5
    assert step_price(prices, ["Admission.admit", "-predict"]) == 3 * per


def test_against_verdicts():
    """--against's verdict per figure: the means apart by more than a 95% bound from the runs'
    spread (Student's t times the standard error, at least 5% of A's mean) is a regression or
    better by the figure's direction, else the same; one run a side gives no verdict."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from pool_bench.compare import verdict

    def said(ref, this, better="lower"):
        return verdict(ref, this, better)["verdict"]

    assert said([100, 110, 105, 95], [130, 140, 135, 125]) == "regression"  # 30 apart, noise 2.45 x 4.6
    assert said([100, 110, 105, 95], [104, 116, 98, 110]) == "same"  # 4.5 apart
    assert said([100, 110, 105, 95], [80, 85, 82, 78]) == "better"
    assert said([100, 140], [130, 170]) == "same"  # 30 apart, but two runs a side spread that wide: t = 4.30
    assert said([100, 100.5], [104, 104.5]) == "same"  # no spread: the 5% floor
    assert said([100, 100.5], [106, 106.5]) == "regression"
    assert said([0.80, 0.82], [0.60, 0.62], "higher") == "regression"
    assert said([0.80, 0.82], [0.95, 0.97], "higher") == "better"
    assert said([100], [200]).startswith("?") and said([100, 101], [200]).startswith("?")
    assert said([], [1, 2]) == "-"
    added = verdict([-0.2, 0.1], [2.0, 2.2], "lower")  # added TTFT may be below zero: no ratio, still a verdict
    assert added["verdict"] == "regression" and added["ratio"] is None
    assert verdict([300, 340], [330, 350], "lower")["ratio"] == 340 / 320


def test_ttft_figures_read_the_pool_over_its_floor():
    """Section 6's figures for --against: the pool's added TTFT, and the part of it over the
    proxy+zmq floor of the same run; a ref whose bench had no floor gives that figure no value."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from pool_bench import compare
    ms = 1e-3
    with_floor = {"ttft": {"added_p50": 2.4 * ms, "added_p95": 4.6 * ms,
                           "proxy_zmq_added_p50": 1.7 * ms, "proxy_zmq_added_p95": 2.7 * ms}}
    got = {name: (better, value) for name, better, value in compare.ttft(with_floor)}
    assert list(got) == ["added TTFT p50 ms", "added TTFT p95 ms", "added TTFT p50 ms over proxy+zmq's",
                         "added TTFT p95 ms over proxy+zmq's"]
    assert all(better == "lower" for better, _ in got.values())
    assert [round(value, 6) for _, value in got.values()] == [2.4, 4.6, 0.7, 1.9]
    older = {"ttft": {"added_p50": 2.4 * ms, "added_p95": 4.6 * ms}}
    assert [value for _, _, value in compare.ttft(older)][2:] == [None, None]


def test_relay_figures_read_the_pool_over_its_floor():
    """Section 5's figures for --against: with the bare+zmq floor in the results, the pool's CPU
    per token over it; a ref whose bench had no floor gives no such figure."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from pool_bench import compare
    row = {"n": 16, "rate": 50.0, "pool_cpu_us_per_tok": 260.0, "bare_cpu_us_per_tok": 65.0,
           "supervisor_cpu_us_per_tok": 150.0, "pool_gap_p99_ms": 21.0}
    older = {name: value for name, _, value in compare.relay({"relay": [row]})}
    assert older == {"pool CPU µs/token, 16 × 50": 260.0, "pool/bare CPU per token, 16 × 50": 4.0,
                     "supervisor/bare CPU per token, 16 × 50": 150.0 / 65.0, "pool gap p99 ms, 16 × 50": 21.0}
    newer = {name: value for name, _, value in compare.relay({"relay": [{**row, "bare_zmq_cpu_us_per_tok": 208.0}]})}
    assert newer == {**older, "pool/(bare+zmq) CPU per token, 16 × 50": 1.25}
