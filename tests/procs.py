"""The process helpers the tests use, where they live: procutil (the package's) and
testkit (the harness the tests share with scripts/)."""

from procutil.net import free_port
from procutil.tree import descendants, stop_tree
from testkit import ROOT
from testkit.llama import find_llama_server
from testkit.waits import until, wait_for

__all__ = ["ROOT", "descendants", "find_llama_server", "free_port", "stop_tree", "until", "wait_for"]
