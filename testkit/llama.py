"""The llama-server binary for tests and scripts."""

from __future__ import annotations

import os
import subprocess

from runtime_worker.backends.llama_server import cached_llama_server
from testkit import ROOT


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
