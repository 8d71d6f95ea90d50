"""What scripts/bench --against compares: figures read from each run's results.json, per side
the mean and the spread (min-max) of its runs, their ratio, and a verdict (see verdict())."""

from __future__ import annotations

import statistics
from typing import Callable

from pool_bench.report import table

NOISE_FLOOR = 0.05

Figure = tuple[str, str, float | None]  # (name, "lower" or "higher" is better, value)


def _div(a, b) -> float | None:
    return a / b if a is not None and b else None


def capacity(out: dict) -> list[Figure]:
    figures = []
    for row in out.get("capacity") or []:
        c, done, cpu = row["concurrency"], row["requests"][2], row["cpu_s"]["pool"]
        figures += [
            (f"supervisor CPU µs/req, c={c}", "lower", _div(cpu.get("supervisor", 0) * 1e6, done)),
            (f"worker CPU µs/req, c={c}", "lower", _div(cpu.get("worker", 0) * 1e6, done)),
            (f"pool/bare req/s, c={c}", "higher", _div(row["pool_rps"], row["bare_rps"])),
            (f"pool/(bare+zmq) req/s, c={c}", "higher", _div(row["pool_rps"], row["bare_zmq_rps"]))]
        if row.get("bare_zmq_async_rps"):  # the asyncio worker's floor (a ref's older bench lacks it)
            figures.append((f"pool/(bare+zmq+async) req/s, c={c}", "higher",
                            _div(row["pool_rps"], row["bare_zmq_async_rps"])))
    return figures


def relay(out: dict) -> list[Figure]:
    figures = []
    for row in out.get("relay") or []:
        case = f"{row['n']} × {row['rate']:g}"
        figures += [
            (f"pool CPU µs/token, {case}", "lower", row["pool_cpu_us_per_tok"]),
            (f"pool/bare CPU per token, {case}", "lower", _div(row["pool_cpu_us_per_tok"], row["bare_cpu_us_per_tok"])),
            (f"supervisor/bare CPU per token, {case}", "lower",
             _div(row.get("supervisor_cpu_us_per_tok"), row["bare_cpu_us_per_tok"])),
            (f"pool gap p99 ms, {case}", "lower", row["pool_gap_p99_ms"])]
        if row.get("bare_zmq_cpu_us_per_tok"):  # the floor of a relay with a worker (a ref's older bench lacks it)
            figures.append((f"pool/(bare+zmq) CPU per token, {case}", "lower",
                            _div(row["pool_cpu_us_per_tok"], row["bare_zmq_cpu_us_per_tok"])))
    return figures


def ttft(out: dict) -> list[Figure]:
    row = out.get("ttft") or {}
    ms = {q: None if row.get(f"added_{q}") is None else row[f"added_{q}"] * 1000 for q in ("p50", "p95")}
    # over the floor of a design with a worker process (proxy_floor.py; a ref's older bench lacks it)
    over = {q: None if ms[q] is None or row.get(f"proxy_zmq_added_{q}") is None
            else ms[q] - row[f"proxy_zmq_added_{q}"] * 1000 for q in ("p50", "p95")}
    return [("added TTFT p50 ms", "lower", ms["p50"]), ("added TTFT p95 ms", "lower", ms["p95"]),
            ("added TTFT p50 ms over proxy+zmq's", "lower", over["p50"]),
            ("added TTFT p95 ms over proxy+zmq's", "lower", over["p95"])]


SECTIONS: dict[str, tuple[str, Callable[[dict], list[Figure]]]] = {
    "2": ("Scheduler capacity (synthetic backend)", capacity),
    "5": ("Relay of many streams", relay),
    "6": ("Added time to first token (tiny GGUF)", ttft),
}


# Student's t, two-sided 95%, by degrees of freedom (beyond the table: 1.96)
T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
       2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04]


def verdict(ref: list[float], this: list[float], better: str) -> dict:
    """The two sides' means apart by more than the noise (a 95% bound from the runs' spread:
    Student's t times the standard error of the difference, at least NOISE_FLOOR of A's mean)
    is a regression or better, by the figure's direction; else the same. Simulated on normal
    runs, equal sides get a verdict 5% of the time; a side 1.5x the other (spread 15%) is
    caught 91% of the time with 4 runs a side, 37% with 2."""
    if not ref or not this:  # a figure one side has not (a ref older than it): its mean alone
        return {"verdict": "-", "ref_mean": statistics.fmean(ref) if ref else None,
                "this_mean": statistics.fmean(this) if this else None}
    a, b = statistics.fmean(ref), statistics.fmean(this)
    row = {"ref_mean": a, "this_mean": b, "ratio": b / a if a > 0 and b > 0 else None}
    if len(ref) < 2 or len(this) < 2:
        return {**row, "noise": None, "verdict": "? (no spread: one run a side)"}
    error = (statistics.variance(ref) / len(ref) + statistics.variance(this) / len(this)) ** 0.5
    df = len(ref) + len(this) - 2
    noise = max((T95[df - 1] if df <= len(T95) else 1.96) * error, NOISE_FLOOR * abs(a))
    if abs(b - a) <= noise:
        said = "same"
    else:
        said = "better" if (b < a) == (better == "lower") else "regression"
    return {**row, "noise": noise, "verdict": said}


def figures(ref_runs: list[dict], this_runs: list[dict], sections: list[str]) -> tuple[list[dict], list[str]]:
    """One row per figure of the sections, in the report's order: each side's values (one a
    run where it had the figure), means, ratio this/ref, noise and verdict; and the runs
    whose results could not be read (a ref whose bench wrote other shapes)."""
    rows, unread = [], []
    for key in sections:
        read = SECTIONS[key][1]
        values: dict[str, dict] = {}
        for side, runs in (("ref", ref_runs), ("this", this_runs)):
            for i, out in enumerate(runs):
                try:
                    found = read(out.get("sections", {}))
                except (KeyError, TypeError, ValueError) as exc:
                    unread.append(f"section {key}, {side}'s run {i + 1}: results not understood "
                                  f"({type(exc).__name__}: {exc})")
                    continue
                for name, better, value in found:
                    row = values.setdefault(name, {"section": key, "figure": name, "better": better,
                                                   "ref": [], "this": []})
                    if value is not None:
                        row[side].append(value)
        rows += [{**row, **verdict(row["ref"], row["this"], row["better"])} for row in values.values()]
    return rows, unread


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _spread(values: list[float], mean: float | None) -> str:
    if not values:
        return "-"
    return _num(mean) if len(values) == 1 else f"{_num(mean)} ({_num(min(values))}–{_num(max(values))})"


def markdown(rows: list[dict]) -> str:
    parts = []
    for key, (title, _) in SECTIONS.items():
        mine = [r for r in rows if r["section"] == key]
        if not mine:
            continue
        lines = [[f"{r['figure']} ({r['better']} is better)", _spread(r["ref"], r.get("ref_mean")),
                  _spread(r["this"], r.get("this_mean")), "-" if r.get("ratio") is None else f"{r['ratio']:.2f}",
                  _noise(r), f"**{r['verdict']}**" if r["verdict"] == "regression" else r["verdict"]]
                 for r in mine]
        header = ["figure", "A (ref): mean (min–max)", "B (this): mean (min–max)", "B/A", "noise", "verdict"]
        parts.append(f"### {key}. {title}\n\n" + table(header, lines))
    parts.append(f"Each figure is one value a run (a run = one whole bench of the section). Noise: a 95% bound "
                 "on the difference of the means from the runs' spread (Student's t times its standard error), "
                 f"at least {NOISE_FLOOR:.0%} of A's mean; means further apart than that are a regression or "
                 "better, else the same (equal sides: a verdict 5% of the time). One run a side gives no verdict; "
                 "4 catch a 1.5x change nine times in ten, 2 one time in three.")
    return "\n\n".join(parts)


def _noise(r: dict) -> str:
    if r.get("noise") is None:
        return "-"
    a = r["ref_mean"]
    return f"±{r['noise'] / abs(a):.0%}" if a else f"±{_num(r['noise'])}"
