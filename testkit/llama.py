"""The llama-server binary for tests and scripts."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx

from procutil.net import free_port
from runtime_worker.backends.llama_server import cached_llama_server
from testkit import ROOT
from testkit.waits import wait_for


def find_llama_server(build: bool = False) -> str | None:
    """$LLAMA_SERVER_BIN, else the build scripts/install-llama-server cached (the
    worker's own lookup); with `build`, it builds one when none is cached (minutes).
    None when there is none."""
    path = os.environ.get("LLAMA_SERVER_BIN") or cached_llama_server()
    if path or not build:
        return path
    try:
        out = subprocess.run([str(ROOT / "scripts" / "install-llama-server")], capture_output=True, text=True,
                             timeout=3600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


@contextlib.contextmanager
def direct_llama_server(binary: str, model: str, args: list[str], log_path: Path) -> Iterator[str]:
    """A llama-server started here on a free loopback port (`args` after -m MODEL), for a
    test to compare the pool against: its base URL once it is healthy. Always stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary, "-m", model, *args, "--host", "127.0.0.1", "--port", str(port),
                                 "--no-webui"], stdout=log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {proc.returncode} (log: {log_path})")
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        try:
            wait_for(healthy, 60, what=f"direct llama-server (log: {log_path})")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
