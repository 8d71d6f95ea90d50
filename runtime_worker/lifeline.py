"""Tie a process's life to its parent's (Linux parent-death signal).

A runtime the worker starts gets it without `preexec_fn` (which CPython says
may deadlock in a process with threads, as the worker is: ZeroMQ's I/O
threads): the worker starts `python -m runtime_worker.lifeline PARENT_PID --
ARGV...`, a fresh single-threaded process that asks for the signal, checks
that its parent still lives, and execs ARGV; the request survives the exec."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
NO_PARENT_EXIT = 4  # the parent died before the signal was asked for (WorkerExit.SUPERVISOR_GONE)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread exits.
    Call it in the child; then compare os.getppid() with the expected parent,
    since the parent may already have died before the call."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def lifeline_argv(argv: list[str], parent_pid: int | None = None) -> list[str]:
    """The command that runs `argv` with the parent-death signal set, as `argv` itself (exec)."""
    return [sys.executable, "-m", "runtime_worker.lifeline", str(parent_pid or os.getpid()), "--", *argv]


def main(args: list[str]) -> int:
    parent, sep, argv = args[0], args[1], args[2:]
    if sep != "--" or not argv:
        print("usage: python -m runtime_worker.lifeline PARENT_PID -- ARGV...", file=sys.stderr)
        return 2
    die_with_parent()
    if os.getppid() != int(parent):
        return NO_PARENT_EXIT
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"cannot run {argv[0]}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
