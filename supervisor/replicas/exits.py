"""Who ended a worker, and why, in words ops can act on. One owner of that sentence: the
replica's event, its last_error and fatal message, /admin/workers, `llm-pool ps` and
/health all show what `describe_exit` made of an exit.

`by` is one of: "pool" (the supervisor or the worker killed it: malformed frames, no
heartbeat, a runtime still busy after a cancel), "operator" (a planned stop an operator
asked: an unload, a restart), "planned" (a stop the pool planned: an idle unload, an
eviction, a reload, a shutdown), "outside" (a signal nobody in the pool sent: the OOM
killer, another process), "self" (it exited on its own with a code)."""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import ErrorCode, PoolError, exit_text
from supervisor.states import ReplicaState

BY_POOL, BY_OPERATOR, BY_PLANNED, BY_OUTSIDE, BY_SELF = "pool", "operator", "planned", "outside", "self"
OUTSIDE_GUESS = "the OOM killer, or another process"  # when the kernel's log cannot be read
OOM_LOOKBACK_S = 60.0  # a kernel OOM record this recent may name a runtime the worker saw die
KMSG_MAX_RECORDS = 20000  # a bound on one read of the kernel's ring buffer
LOG_TAIL_BYTES = 16384  # how much of a worker's log is read for its last meaningful line
# lines a log ends with that say nothing of the cause
NOISE = re.compile(r"^(Traceback \(most recent call last\):|\s*File \".*|\s*\^+\s*|\s*)$")


@dataclass(frozen=True)
class ExitFacts:
    """What the replica knew when its worker exited."""
    worker_code: int
    planned: bool  # it was being stopped (STOPPING, RESTARTING)
    stop_by: str  # who asked the planned stop: BY_OPERATOR or BY_PLANNED
    stop_why: str | None  # why, in words ("asked by admin", "idle for 300s", "shutdown")
    kill_why: str | None  # the pool killed it: why
    runtime_code: int | None  # its runtime's exit, when its worker reported that the runtime died
    runtime_killed_by_worker: bool  # the worker killed its own runtime (a cancel it did not honour)
    message: str | None  # the worker's last word on it (a dead runtime's reason), first line
    load_failed: bool = False  # its load failed, and the worker said why (message)


def facts_of(replica, code: int) -> ExitFacts:
    """What a Replica knew when its worker exited with `code`. A stop after a failed load is
    no planned stop: its exit tells the load's cause (the pool's kill of it, or its own code)."""
    timed_out, why = replica.load_failure or (False, replica.last_error)
    first = why.splitlines()[0] if why else None
    failed = replica.load_failure is not None
    return ExitFacts(
        code, replica.state in (ReplicaState.STOPPING, ReplicaState.RESTARTING) and not failed, replica.stop_by,
        replica.stop_why, replica.kill_why or (f"its load failed: {first}" if timed_out else None),
        replica.runtime_exit_code, replica.runtime_killed_by_worker, first, load_failed=failed)


def describe_exit(facts: ExitFacts, kernel_note: str | None = None, last_line: str | None = None) -> tuple[str, str]:
    """(by, text): who ended the worker, and the sentence that says who and why.
    `kernel_note`: what the kernel's log says of an outside kill (oom_note), if it could be
    read; `last_line`: the last meaningful line of its log, for an exit with a code."""
    if facts.kill_why:
        return BY_POOL, f"killed by the pool: {facts.kill_why}"
    if facts.runtime_code is not None:  # its runtime died; the worker then exited (code 1)
        signal_ = facts.runtime_code < 0
        said = facts.message or (f"its runtime was killed by {exit_text(facts.runtime_code)}" if signal_
                                 else f"its runtime exited with {exit_text(facts.runtime_code)}")
        if facts.runtime_killed_by_worker:  # the message says so: "(by its worker: ...)"
            return BY_POOL, f"killed by the pool: {said}"
        if signal_:
            return BY_OUTSIDE, f"crashed: {said}, from outside the pool ({kernel_note or OUTSIDE_GUESS})"
        return BY_SELF, f"crashed: {said}"
    if facts.load_failed and facts.message:  # its worker said why; the exit after it is the symptom
        return BY_SELF, f"its load failed: {facts.message} (then exited with {exit_text(facts.worker_code)})"
    if facts.planned:
        return facts.stop_by, f"stopped ({facts.stop_why or 'a planned stop'})"
    if facts.worker_code < 0:
        return BY_OUTSIDE, (f"killed by {exit_text(facts.worker_code)} from outside the pool "
                            f"({kernel_note or OUTSIDE_GUESS})")
    why = facts.message or last_line
    return BY_SELF, f"exited with {exit_text(facts.worker_code)}" + (f": {why}" if why else "")


async def explain(facts: ExitFacts, pid: int, log_path: Path) -> tuple[str, str]:
    """describe_exit, with what the disk tells of it: the kernel's log (an OOM kill) or the
    worker's last line, read off the loop, bounded."""
    disk = await asyncio.to_thread(read_disk, facts, pid, log_path) if needs_disk(facts) else (None, None)
    return describe_exit(facts, *disk)


def lost_job_error(state: ReplicaState, name: str, exit_why: str) -> PoolError:
    """What a job still running when its worker exited (`exit_why`) is told, by its replica's state."""
    if state is ReplicaState.RESTARTING:
        return PoolError(ErrorCode.RUNTIME_RESTARTED, f"replica {name} was restarted by the operator "
                         "before the request finished")
    if state is ReplicaState.STOPPING:  # what a drain's grace did not let finish (unload, shutdown)
        return PoolError(ErrorCode.MODEL_UNLOADING, f"replica {name} was stopped (unload or shutdown) "
                         "before the request finished")
    return PoolError(ErrorCode.RUNTIME_CRASHED, f"the runtime of replica {name} exited ({exit_why}) during the request")


def needs_disk(facts: ExitFacts) -> bool:
    """Whether describe_exit's words would gain from the kernel's log or the worker's log."""
    if facts.kill_why or facts.planned or facts.runtime_killed_by_worker:
        return False
    if facts.runtime_code is not None:
        return facts.runtime_code < 0
    return facts.worker_code < 0 or not facts.message


def read_disk(facts: ExitFacts, pid: int, log_path: Path) -> tuple[str | None, str | None]:
    """(kernel_note, last_line) for describe_exit: blocking reads, run in a thread."""
    if facts.runtime_code is not None or facts.worker_code < 0:
        return oom_note(read_kmsg(), pid if facts.runtime_code is None else None, time.monotonic()), None
    return None, last_log_line(log_path)


def read_kmsg() -> list[str]:
    """The kernel's log records, or [] where this user may not read them (dmesg_restrict)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    records = []
    try:
        for _ in range(KMSG_MAX_RECORDS):
            try:
                records.append(os.read(fd, 8192).decode(errors="replace"))
            except BlockingIOError:  # read all there is
                break
            except OSError:  # EPIPE: a record was overwritten while read; go on with the next
                continue
    finally:
        os.close(fd)
    return records


_KILLED = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+) \(([^)]*)\)")


def oom_note(records: list[str], pid: int | None, now: float) -> str | None:
    """The OOM killer's record of `pid` (None: any process it killed in the last
    OOM_LOOKBACK_S, for a runtime whose pid the supervisor never knew), in words."""
    for record in reversed(records):
        head, _, text = record.partition(";")
        match = _KILLED.search(text)
        if match is None:
            continue
        fields = head.split(",")
        try:
            at = int(fields[2]) / 1e6  # microseconds since boot: the monotonic clock's base on Linux
        except (IndexError, ValueError):
            at = None
        recent = at is not None and now - at <= OOM_LOOKBACK_S
        if int(match.group(1)) == pid if pid is not None else recent:
            return f"the kernel's OOM killer killed process {match.group(1)} ({match.group(2)}): out of memory"
    return None


def last_log_line(path: Path) -> str | None:
    """The last meaningful line of a worker's log (an exception's text, a runtime's last word)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if not NOISE.match(line):
            return line.strip()[:300]
    return None
