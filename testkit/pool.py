"""Test harness: a real `llm-pool serve` subprocess on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import tomli_w

from procutil.net import free_port
from procutil.tree import stop_tree
from testkit import ROOT
from testkit.waits import wait_for

__all__ = ["ROOT", "Pool", "free_port", "wait_for"]


class Pool:
    def __init__(self, tmp: Path, models: list[dict], server: dict | None = None,
                 env: dict | None = None, tenants: list[dict] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp / "pool.toml"
        server = {"host": "127.0.0.1", "port": self.port, "state_dir": str(tmp / "state"),
                  "heartbeat_s": 0.5, "liveness_s": 5.0, **(server or {})}
        self.config_path.write_text(tomli_w.dumps({"server": server, **({"tenants": tenants} if tenants else {}),
                                                   "models": models}))
        self.log_path = tmp / "supervisor.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.seen_pids: set[int] = set()
        # what start() runs; a test of `llm-pool serve FILE.gguf` (no config file) replaces it
        self.command = [sys.executable, "-m", "supervisor.cli", "serve", "--config", str(self.config_path)]

    def start(self, wait_ready: bool = True, timeout: float = 60) -> Pool:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_for(self._healthy, timeout, what=f"pool /health (log: {self.log_path})")
            if wait_ready:
                wait_for(self._ready, timeout, what=f"pool /ready (log: {self.log_path})")
        except BaseException:  # a fixture that fails here gets no teardown: stop it now
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        """/ready is 200 (the start-up loads settled); a model that failed to load fails the
        wait, with its error (/ready is 200 while another model serves)."""
        ready = self.http.get("/ready").status_code == 200
        models = self.http.get("/admin/models")
        if models.status_code != 200:  # an admin key is set: /ready alone decides
            return ready
        failed = {m["name"]: m.get("error") for m in models.json()["models"] if m["state"] == "failed"}
        if failed:
            raise AssertionError(f"models failed to load: {failed}")
        return ready

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"supervisor exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def rewrite_config(self, models: list[dict], server: dict | None = None) -> None:
        """The config file with these models (and these [server] keys changed), for a reload."""
        import tomllib

        import tomli_w
        raw = tomllib.loads(self.config_path.read_text())
        raw["models"] = models
        raw["server"].update(server or {})
        self.config_path.write_text(tomli_w.dumps(raw))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def descendants(self) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen_pids.update(p.pid for p in procs)
        return procs

    def models(self) -> dict[str, dict]:
        return {m["name"]: m for m in self.http.get("/admin/models").json()["models"]}

    def model(self, name: str) -> dict:
        return self.models()[name]

    def workers(self, model: str | None = None) -> list[dict]:
        rows = self.http.get("/admin/workers").json()["workers"]
        self.seen_pids.update(w["pid"] for w in rows if w["pid"])
        self.seen_pids.update(c["pid"] for w in rows for c in w["children"])
        return [w for w in rows if model is None or w["model"] == model]

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the supervisor (graceful), then check that nothing it started lives."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None  # stopped once: a pid seen then may belong to another process later
        leftovers = stop_tree(proc, self.seen_pids, timeout)  # kills them, even when failing
        self.http.close()
        self._log.close()
        assert not leftovers, f"processes left after the supervisor stopped: {leftovers}"
