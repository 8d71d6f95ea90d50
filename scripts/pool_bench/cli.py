"""The bench's entry point (scripts/bench): options, the sections in turn, the report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

from pool_bench import against, compare, price
from pool_bench.bench import Bench
from pool_bench.children import Proc
from pool_bench.plot import plot
from pool_bench.report import say
from pool_bench.sections import ON_REQUEST, SECTIONS


def main(doc: str) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run for a smoke test (well under 2 minutes)")
    ap.add_argument("--skip-litellm", action="store_true", help="skip section 3 (no LiteLLM install)")
    ap.add_argument("--skip-demo-model", action="store_true", help="section 1 with the tiny GGUF only")
    ap.add_argument("--sections", default=",".join(k for k in SECTIONS if k not in ON_REQUEST),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but "
                         f"{','.join(sorted(ON_REQUEST))})")
    ap.add_argument("--out", default="bench-results", help="folder for bench.png, results.md, results.json")
    ap.add_argument("--against", metavar="REF",
                    help="run the sections (2, 5, 6; default all three) ABBA against this git ref, each side "
                         "from its own checkout: both sides, their ratio and a verdict per figure "
                         "(against-SHA.md and .json in --out)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="with --against: runs a side, in the order A B B A A B ... (default 2)")
    ap.add_argument("--price", action="store_true",
                    help="with --against: instead of the sections, price each step of a request (µs of the "
                         "supervisor's CPU, py-spy) under section 2's load at c = 16, both sides (price-SHA.md)")
    args = ap.parse_args()

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    if args.price and not args.against:
        ap.error("--price prices this checkout against a ref: name it with --against REF")
    if args.against:
        return run_against(ap, args)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="llm-pool-bench-"))
    bench = Bench(args, tmp)
    interrupted = False
    try:
        for key, step in SECTIONS.items():
            if key not in sections:
                continue
            try:
                step(bench)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                bench.failed = True
                say(f"section {key} failed:\n{traceback.format_exc()}")
                bench.emit(f"{key}. (failed)", f"Section {key} failed: {type(exc).__name__}: {exc}"[:3000])
            finally:
                Proc.stop_all()
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: stopping everything")
    finally:
        Proc.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    head = (f"## llm-pool benchmark{' (--quick)' if args.quick else ''}\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, took {elapsed:.0f} s"
            f"{', INTERRUPTED' if interrupted else ''}.\n")
    if bench.out["notes"]:
        head += "\n" + "\n".join(f"- {n}" for n in bench.out["notes"]) + "\n"
    report = head + "\n" + "\n".join(bench.md)
    png = out_dir / "bench.png"
    try:
        why = plot(bench.out, png)
    except Exception as exc:
        why = f"plot failed: {exc}"
    report += f"\n{why}\n" if why else f"\nPlot: {png}\n"
    print(report, flush=True)
    (out_dir / "results.md").write_text(report)
    bench.out["elapsed_s"] = elapsed
    (out_dir / "results.json").write_text(json.dumps(bench.out, indent=1, default=str))
    if interrupted:
        return 130
    return 1 if bench.failed else 0


def run_against(ap: argparse.ArgumentParser, args) -> int:
    """--against REF: pool_bench/against.py runs whole benches, this checkout's and the ref's."""
    if args.sections == ap.get_default("sections"):
        args.sections = ",".join(compare.SECTIONS)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        return price.run(args) if args.price else against.run(args)
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
        return 130
    finally:
        Proc.stop_all()
