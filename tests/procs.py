"""The process helpers the tests use, where they live: procutil (the package's) and
testkit (the harness the tests share with scripts/)."""

import contextlib

import psutil

from procutil.net import free_port
from procutil.tree import descendants, stop_tree
from testkit import ROOT
from testkit.llama import find_llama_server
from testkit.waits import until, wait_for

__all__ = ["ROOT", "descendants", "find_llama_server", "free_port", "frozen", "stop_tree", "until",
           "wait_for"]


@contextlib.contextmanager
def frozen(*processes: psutil.Process):
    """The processes stopped (SIGSTOP) while the block runs, resumed after, whatever happens:
    what a test looks at while a runtime holds its jobs stays put however slow the machine is
    (the pool and its worker run on; a request to a stopped server waits in its socket)."""
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            process.resume()
