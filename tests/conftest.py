from __future__ import annotations

import pytest

from tests.pool import Pool


@pytest.fixture
def make_pool(tmp_path_factory):
    """Start pools for one test; every one is stopped and checked for leftovers."""
    pools: list[Pool] = []

    def make(models: list[dict], server: dict | None = None, wait_ready: bool = True,
             env: dict | None = None, tenants: list[dict] | None = None) -> Pool:
        pool = Pool(tmp_path_factory.mktemp("pool"), models, server, env, tenants)
        pools.append(pool)
        return pool.start(wait_ready=wait_ready)

    yield make
    errors = []
    for pool in pools:
        try:
            pool.stop()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, errors


def synthetic(name: str, *, replicas: int = 1, target_inflight: int = 1, capacity: int = 1,
              tps: float = 0, ttft_ms: float = 0, tokens: int = 16, **extra) -> dict:
    return {"name": name, "backend": "synthetic", "replicas": replicas, "target_inflight": target_inflight,
            "options": {"capacity": capacity, "tokens_per_second": tps, "ttft_ms": ttft_ms,
                        "output_tokens": tokens}, **extra}


@pytest.fixture(scope="session")
def llama_server_bin() -> str:
    """The llama-server binary: $LLAMA_SERVER_BIN, else the one scripts/install-llama-server
    cached. Missing: skipped on a developer machine, an error under CI."""
    import os

    from tests.procs import find_llama_server
    path = find_llama_server()
    if not path:
        if os.environ.get("CI"):
            pytest.fail("llama-server is missing: .ci/run must run scripts/install-llama-server")
        pytest.skip("no llama-server: run scripts/install-llama-server")
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    from testkit.tiny_gguf import write_tiny_gguf
    return str(write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf"))


def llama(name: str, model: str, binary: str, *, slots: int = 1, ctx: int | None = None,
          extra_args: list[str] | None = None, **extra) -> dict:
    return {"name": name, "backend": "llama_server", "target_inflight": slots,
            "options": {"model": model, "binary": binary, "ctx_size": ctx or 16384 * slots,
                        "extra_args": extra_args or []}, **extra}


IGNORE_EOS = ["--ignore-eos"]  # random weights hit EOS after ~300 tokens; long jobs need this


def vllm_python() -> str | None:
    """The interpreter of an environment with vLLM (scripts/test-vllm makes one)."""
    import os
    from pathlib import Path
    path = os.environ.get("LLM_POOL_VLLM_PYTHON")
    default = Path.home() / ".cache" / "llm-pool" / "vllm-venv" / "bin" / "python"
    return path or (str(default) if default.exists() else None)
