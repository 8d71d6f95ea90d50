"""GPU tier: the exllamav3 backend on a real CUDA GPU, through the pool.
Skipped where torch with CUDA or exllamav3 is missing (any CPU-only machine);
scripts/gpu-check runs the same path and prints throughput."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.gpu


def cuda_ready() -> bool:
    try:
        import torch
        import exllamav3  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(not cuda_ready(), reason="needs torch with CUDA and exllamav3")
def test_exllamav3_serves_concurrent_jobs_on_gpu(make_pool, tmp_path):
    from testkit.tiny_hf_llama import write_tiny_hf_llama
    model = write_tiny_hf_llama(str(tmp_path / "tiny"))
    pool = make_pool([{"name": "exl", "backend": "exllamav3", "target_inflight": 4, "load_timeout_s": 600,
                       "options": {"model": model, "cache_tokens": 8192}}], server={"liveness_s": 60})
    assert pool.workers("exl")[0]["capacity"] == 4
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda i: pool.http.post("/v1/responses", json={
            "model": "exl", "input": f"q{i}", "max_output_tokens": 32}), range(6)))
    assert all(r.status_code == 200 and 0 < r.json()["usage"]["output_tokens"] <= 32 for r in results)
    too_long = pool.http.post("/v1/responses", json={"model": "exl", "input": "x" * 20000, "max_output_tokens": 8})
    assert too_long.status_code == 400
