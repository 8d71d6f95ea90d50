from __future__ import annotations

import pytest

from tests.pool import Pool


@pytest.fixture
def make_pool(tmp_path_factory):
    """Start pools for one test; every one is stopped and checked for leftovers."""
    pools: list[Pool] = []

    def make(models: list[dict], server: dict | None = None, wait_ready: bool = True,
             env: dict | None = None) -> Pool:
        pool = Pool(tmp_path_factory.mktemp("pool"), models, server, env)
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
