"""Smoke test of scripts/bench: the quick run finishes, cleans up and prints a
markdown table. No timing is asserted: the numbers depend on the machine."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psutil
import pytest

from tests.pool import ROOT

pytestmark = pytest.mark.llama

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


@pytest.mark.timeout(600)
def test_bench_quick(llama_server_bin, tmp_path):
    mark = uuid.uuid4().hex
    env = {**os.environ, "LLAMA_SERVER_BIN": llama_server_bin, "PYTHONUNBUFFERED": "1", MARK: mark}
    try:
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench"), "--quick", "--skip-litellm",
                              "--out", str(tmp_path / "results")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
        assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
        assert any(line.startswith("|") for line in out.stdout.splitlines()), out.stdout[-3000:]
        assert (tmp_path / "results" / "results.md").is_file()
    finally:
        left = _left_behind(mark)
        for line in left:  # never leave anything behind, even when failing
            try:
                psutil.Process(int(line.split(":")[0])).kill()
            except psutil.Error:
                pass
    assert not left, f"processes left after the benchmark: {left}"
