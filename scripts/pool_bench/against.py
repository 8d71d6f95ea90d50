"""scripts/bench --against REF: the chosen sections, this checkout against a git ref, ABBA.

The ref runs from its own checkout (git archive of the commit, under the user's cache dir,
one per commit and kept for the next run) with its own environment: this bench's venv when
the ref's dependencies (the project's and the dev extra's) are the same as this checkout's,
else a venv of its own beside the checkout (pip install -e '.[dev]', pip's cache). Each run
is the whole bench of one side in a subprocess from that side's checkout, in the order
A B B A A B ..., on the same machine; compare.py reads both sides' results.json."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from pool_bench import compare, profile
from pool_bench.children import Proc
from pool_bench.report import loadavg, say
from testkit import ROOT
from testkit.waits import wait_for

# the refs' checkouts, one folder a commit (LLM_POOL_BENCH_CHECKOUTS elsewhere: the tests' temporary folder)
CACHE = Path(os.environ.get("LLM_POOL_BENCH_CHECKOUTS")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-pool" / "bench-worktrees")
READY = ".llm-pool-bench-ready"  # written last: a checkout or venv without it is half made and made again
SETUP_TIMEOUT_S = 1800  # a venv from an empty pip cache builds a few wheels


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def resolve(ref: str) -> str:
    try:
        return git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"scripts/bench --against {ref}: not a commit here: {exc.stderr.strip()}") from None


def dependencies(pyproject: Path) -> tuple[list[str], list[str]]:
    """What `pip install -e '.[dev]'` installs: the project's dependencies and the dev extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return project.get("dependencies", []), project.get("optional-dependencies", {}).get("dev", [])


@contextlib.contextmanager
def held(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on a file, waited for as long as another bench may take to make a venv."""
    with open(lock_path, "w") as lock:
        def taken() -> bool:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        wait_for(taken, SETUP_TIMEOUT_S, interval=0.5, what=f"the lock {lock_path} (another bench --against)")
        yield


def checkout(sha: str) -> Path:
    """The commit's files under the cache (made once; a lock keeps two benches from making it at
    once). git archive rather than git worktree: nothing is registered in this repository, so
    deleting the cache folder is all the cleaning up there is."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / sha
    with held(CACHE / f"{sha}.lock"):
        if not (path / READY).exists():
            shutil.rmtree(path, ignore_errors=True)
            say(f"--against: checking out {sha[:12]} into {path}")
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha],
                                     capture_output=True, check=True, timeout=300).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(path, **({"filter": "tar"} if hasattr(tarfile, "data_filter") else {}))
            (path / READY).write_text(sha + "\n")
    return path


def environment(path: Path) -> tuple[str, str]:
    """(python, what it is) to run the ref's bench with: this venv when the dependencies match,
    else the ref's own venv, made once."""
    if dependencies(path / "pyproject.toml") == dependencies(ROOT / "pyproject.toml"):
        return sys.executable, f"this bench's venv ({sys.prefix}): the same dependencies"
    venv = path / ".venv"
    python = venv / "bin" / "python"
    with held(path.parent / f"{path.name}.lock"):
        if not (venv / READY).exists():
            shutil.rmtree(venv, ignore_errors=True)
            say(f"--against: the ref's dependencies differ: making its venv {venv} (minutes)")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=SETUP_TIMEOUT_S)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", ".[dev]"], cwd=path, check=True,
                           timeout=SETUP_TIMEOUT_S)
            (venv / READY).write_text("")
    return str(python), f"its own venv ({venv})"


def side_argv(args, root: Path, python: str, out: Path) -> list[str]:
    argv = [python, str(root / "scripts" / "bench"), "--sections", args.sections, "--out", str(out)]
    for flag in ("quick", "skip_litellm", "skip_demo_model"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    return argv


def side_env(root: Path) -> dict[str, str]:
    """A side's environment: its checkout's packages first on the path of every process it
    starts (a shared venv's editable install points at this checkout), and no profiles."""
    return {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "LLM_POOL_BENCH_NO_REEXEC": "1", profile.OFF: "1", "PYTHONUNBUFFERED": "1"}


def code_of(python: str, root: Path) -> str:
    """Where a side's interpreter takes the pool's packages from; refuses to go on unless it is
    the side's checkout (else both sides would time the same code)."""
    probe = "import supervisor, runtime_worker, protocol; print(supervisor.__file__)"
    found = subprocess.run([python, "-c", probe], cwd=root, env={**os.environ, **side_env(root)},
                           capture_output=True, text=True, timeout=120)
    where = found.stdout.strip()
    if found.returncode != 0 or not Path(where).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"scripts/bench --against: {python} takes the pool's code from {where or found.stderr!r}, "
                         f"not from {root}")
    return where


def run_side(name: str, argv: list[str], root: Path, out: Path, timeout: float) -> dict | None:
    """One side's bench, from its checkout; its results.json, or None when it failed (the
    reason said)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = Proc(f"bench {name}", argv, out / "bench.log", env=side_env(root), cwd=root)
    try:
        rc = proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        proc.stop()
    results = out / "results.json"
    if rc != 0 or not results.exists():
        say(f"--against: {name} {'timed out' if rc is None else f'exited {rc}'}; its log:\n{proc.log_tail()}")
        return None
    return json.loads(results.read_text())


def order(rounds: int) -> list[str]:
    """A B B A A B ...: each side goes first as often as the other (over an even count)."""
    return [s for i in range(rounds) for s in (("ref", "this") if i % 2 == 0 else ("this", "ref"))]


def run(args) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(compare.SECTIONS))
    if unknown:
        raise SystemExit(f"scripts/bench --against compares sections {', '.join(compare.SECTIONS)}; "
                         f"not {', '.join(unknown)}")
    args.sections = ",".join(sections)
    sha = resolve(args.against)
    root = checkout(sha)
    python, env_said = environment(root)
    sides = {"ref": (root, python), "this": (ROOT, sys.executable)}
    code = {side: code_of(py, side_root) for side, (side_root, py) in sides.items()}
    # absolute: each side runs from its own checkout
    runs_dir = Path(args.out).resolve() / f"against-{sha[:9]}-{time.strftime('%Y%m%d-%H%M%S')}"
    timeout = 600 if args.quick else 3600
    got: dict[str, list[dict]] = {"ref": [], "this": []}
    runs, load_before, started = [], loadavg(), time.monotonic()
    for i, side in enumerate(order(args.rounds)):
        side_root, side_python = sides[side]
        out = runs_dir / f"{i + 1:02d}-{side}"
        say(f"--against: run {i + 1} of {2 * args.rounds}: {side} ({sha[:9] if side == 'ref' else 'this checkout'})")
        result = run_side(side, side_argv(args, side_root, side_python, out), side_root, out, timeout)
        runs.append({"side": side, "out": str(out), "ok": result is not None})
        if result is not None:
            got[side].append(result)
    this_sha, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain"))
    rows, unread = compare.figures(got["ref"], got["this"], sections)
    said = {"ref": args.against if sha.startswith(args.against) else f"{args.against} ({sha[:9]})",
            "this": f"this checkout ({this_sha[:9]}{', with uncommitted changes' if dirty else ''})"}
    head = (f"## scripts/bench --against {args.against}: sections {args.sections}, {args.rounds} run(s) a side"
            f"{' (--quick)' if args.quick else ''}\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, {os.cpu_count()} CPUs, took "
            f"{time.monotonic() - started:.0f} s; 1-min load average {load_before} before, {loadavg()} after.\n\n"
            f"- A = {said['ref']}: its own checkout ({root}), {env_said}\n- B = {said['this']}\n"
            f"- order: {' '.join('A' if s == 'ref' else 'B' for s in order(args.rounds))}; each run's results "
            f"and log: {runs_dir}\n")
    failed = [f"run {i + 1} ({r['side']}) failed: see {r['out']}/bench.log" for i, r in enumerate(runs) if not r["ok"]]
    failed += unread
    text = head + "\n" + compare.markdown(rows) + "".join(f"\n- {f}" for f in failed)
    print(text, flush=True)
    write(Path(args.out), sha[:9], text, {
        "ref": args.against, "ref_sha": sha, "this_sha": this_sha, "this_dirty": dirty, "sections": sections,
        "rounds": args.rounds, "quick": args.quick, "order": order(args.rounds), "environment": env_said,
        "code": code, "cpus": os.cpu_count(), "runs": runs, "problems": failed, "figures": rows,
        "noise_floor": compare.NOISE_FLOOR})
    return 1 if failed or not got["ref"] or not got["this"] else 0


def write(out: Path, short: str, text: str, report: dict) -> None:
    """against-SHA.md (the table) and .json (the figures, each run's values) beside the bench's results."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"against-{short}.md").write_text(text + "\n")
    (out / f"against-{short}.json").write_text(json.dumps(report, indent=1))
