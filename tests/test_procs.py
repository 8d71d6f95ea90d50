"""The shared tree-kill (tests/procs.py stop_tree): what a child leaves behind is killed,
and named unless it went down with the child's process group."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests.procs import descendants, stop_tree, wait_for

# A parent that ignores SIGTERM, with two children: one in its process group, one in a
# session of its own (as a daemonising runtime would be).
PARENT = ("import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "subprocess.Popen(['sleep', '300']); subprocess.Popen(['setsid', 'sleep', '300']); time.sleep(300)")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _children(pid: int) -> tuple[set[int], set[int]] | None:
    """Its two children once they are there and one leads a session of its own."""
    pids = descendants(pid)
    own_session = {p for p in pids if os.getsid(p) == p}
    return (pids, own_session) if len(pids) == 2 and len(own_session) == 1 else None


@pytest.mark.parametrize("group", [False, True])
def test_stop_tree_kills_what_outlives_the_child(group):
    proc = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=group)
    seen: set[int] = set()
    try:
        pids, own_session = wait_for(lambda: _children(proc.pid), 10, what="both children")
        seen |= pids
        # with group, killpg took the child in the group: only the other is named
        expected = own_session if group else seen
        left = stop_tree(proc, seen, timeout=0.5, group=group)
        assert proc.returncode is not None  # it ignored SIGTERM: SIGKILLed after the timeout
        assert {int(entry.split()[0]) for entry in left} == expected, left
        wait_for(lambda: all(_gone(pid) for pid in seen), 10, what="both children gone")
        assert stop_tree(proc, seen, timeout=0.5, group=group) == []  # a second stop finds nothing
    finally:
        proc.kill()
        for pid in seen:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def test_descendant_pids_read_from_proc_match_psutils_walk():
    """procutil's /proc children lists find the same tree as psutil's walk of every
    process (a thread's children included: each task has its own list)."""
    from procutil.tree import child_pids, descendant_pids
    code = ("import subprocess, threading, time; subprocess.Popen(['sleep', '300']); "
            "threading.Thread(target=lambda: subprocess.Popen(['sh', '-c', 'sleep 300 & sleep 300'])).start(); "
            "time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for(lambda: len(psutil.Process(parent.pid).children(recursive=True)) >= 4, 20,
                 what="the parent's four descendants")
        walked = {p.pid for p in psutil.Process(parent.pid).children(recursive=True)}
        assert set(descendant_pids(parent.pid)) == walked
        assert sorted(child_pids(parent.pid)) == sorted(p.pid for p in psutil.Process(parent.pid).children())
    finally:
        stop_tree(parent, set(), 10)
    assert child_pids(parent.pid) == [] and descendant_pids(parent.pid) == []


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    """Servers' ports come from below the range the kernel gives outgoing connections, so
    no client's connection can take one between its choice and its bind."""
    import socket

    from procutil.net import LOWEST, ephemeral_low, free_port
    for _ in range(20):
        port = free_port()
        assert LOWEST <= port < ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
