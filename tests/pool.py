"""The pool harness the tests use (testkit/pool.py, shared with scripts/)."""

from testkit.pool import ROOT, Pool, free_port, wait_for

__all__ = ["ROOT", "Pool", "free_port", "wait_for"]
