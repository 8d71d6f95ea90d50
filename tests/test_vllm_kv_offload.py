"""vLLM's native KV offloading (issue 48 item 6): options.kv_offload_mb reaches vLLM as
--kv-offloading-size, and its host buffer counts in the model's memory (the estimate, the
budget's gate and eviction), as do the offloading flags given in extra_args.

The real vLLM runs under the `vllm` marker (its CPU build refuses offloading: CUDA and XPU
only). Without it, two stand-in `vllm` CLIs, one whose help lists --kv-offloading-size and
one from before it, show what the worker starts and what it refuses; each exits instead of
serving, so those loads fail after the command line is in the replica's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from supervisor.config.models import vllm_kv_offload_mb
from tests.conftest import synthetic, vllm_python
from tests.pool import ROOT, wait_for
from tests.test_lifecycle import admin, post

NO_VLLM_PYTHON = {"LLM_POOL_VLLM_PYTHON": ""}  # options.binary decides, even in the vLLM tier's shell


@pytest.mark.parametrize("options, mb", [
    ({"kv_offload_mb": 512}, 512),
    ({}, 0),
    ({"extra_args": ["--kv-offloading-size", "2"]}, 2048),  # GiB
    ({"extra_args": ["--kv_offloading_size=0.5", "--kv-offloading-backend", "native"]}, 512),
    # LMCache keeps its store in its own server: not this model's memory
    ({"extra_args": ["--kv-offloading-size", "4", "--kv-offloading-backend", "lmcache"]}, 0),
    ({"extra_args": ["--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 3 * 2**30}})]}, 3072),
    # vLLM's units in its JSON flags: M is 2**20, g is 10**9
    ({"extra_args": ['--kv-transfer-config={"kv_connector":"OffloadingConnector",'
                     '"kv_connector_extra_config":{"cpu_bytes_to_use":80M}}']}, 80),
    ({"extra_args": ['--kv-transfer-config', '{"kv_connector":"OffloadingConnector",'
                     '"kv_connector_extra_config":{"cpu_bytes_to_use":1g,"note":"1g"}}']}, 10**9 / 2**20),
    # a MultiConnector's offloading part; SimpleCPUOffloadConnector takes 8 GiB when unset
    ({"extra_args": ["--kv-transfer-config", json.dumps({
        "kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "NixlConnector"}, {"kv_connector": "SimpleCPUOffloadConnector"}]}})]}, 8192),
    # a size beside a transfer config: vLLM sets the connector's bytes from the size
    ({"extra_args": ["--kv-transfer-config", '{"kv_connector":"NixlConnector"}', "--kv-offloading-size", "1"]},
     1024),
])
def test_the_offload_counted_is_what_vllm_allocates(options, mb):
    assert vllm_kv_offload_mb(options) == pytest.approx(mb)


def vllm_model(name: str, offload_mb: int, replicas: int = 1, **options) -> dict:
    return {"name": name, "backend": "vllm_serve", "replicas": replicas, "load_on_start": False,
            "load_timeout_s": 120, "options": {"model": "/nonexistent/model", "kv_offload_mb": offload_mb, **options}}


def test_the_estimate_and_the_budget_count_the_offload(make_pool):
    """No vLLM runs here: the budget's gate refuses the load, or evicts for it, before the runtime."""
    # queue_timeout_s: how long the gate waits for room before it refuses
    pool = make_pool([{**vllm_model("huge", 700, replicas=2), "queue_timeout_s": 1}, vllm_model("mid", 700, binary="/nonexistent/vllm"),
                      vllm_model("none", 0), synthetic("old", load_on_start=False, memory_mb=400)],
                     server={"memory_budget_mb": 1000}, env=NO_VLLM_PYTHON)
    assert (pool.model("huge")["memory_mb"], pool.model("huge")["memory_source"]) == (1400, "estimated")
    assert (pool.model("none")["memory_mb"], pool.model("none")["memory_source"]) == (None, None)
    r = admin(pool, "huge", "load")
    assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory", r.text
    assert "it needs 1400 MB of memory_budget_mb 1000" in r.json()["error"]["message"], r.text
    assert pool.model("huge")["state"] != "loaded"

    # 400 MB held: a model whose offload takes 700 MB makes room by evicting it
    assert post(pool, "old").status_code == 200
    admin(pool, "mid", "load")  # its runtime cannot start: what matters is the room made for it first
    wait_for(lambda: pool.model("mid")["state"] == "failed", 60, what="mid's load done")
    assert pool.model("old")["state"] == "unloaded"
    assert ("model old: unloading (evicted to make room for mid in it needs 700 MB of memory_budget_mb 1000, "
            "in use by old (400 MB)") in pool.log()


FAKE_VLLM = """import sys
if "--help" in sys.argv:
    print("usage: vllm serve [--max-num-seqs MAX_NUM_SEQS]" + KNOWS)
    sys.exit(0)
sys.exit("error: fake vllm, a stand-in that does not serve")
"""


def fake_vllm(tmp_path: Path, knows: bool) -> str:
    binary = tmp_path / ("vllm-new" if knows else "vllm-old")
    flag = ' [--kv-offloading-size KV_OFFLOADING_SIZE]' if knows else ''
    binary.write_text(f"#!{sys.executable}\nKNOWS = {flag!r}\n{FAKE_VLLM}")
    binary.chmod(0o755)
    return str(binary)


def replica_log(pool, model: str) -> str:
    return (Path(pool.config_path).parent / "state" / "llm-pool" / "logs" / f"{model}-0.log").read_text(errors="replace")


def test_the_option_reaches_vllm_as_its_flag_and_an_older_vllm_is_refused_by_name(make_pool, tmp_path):
    pool = make_pool([vllm_model("new", 512, binary=fake_vllm(tmp_path, True)),
                      vllm_model("old", 512, binary=fake_vllm(tmp_path, False)),
                      vllm_model("off", 0, binary=fake_vllm(tmp_path, False))], env=NO_VLLM_PYTHON)
    for name in ("new", "old", "off"):
        admin(pool, name, "load")
        wait_for(lambda: pool.model(name)["state"] == "failed", 60, what=f"{name}: its load done")
    started = [line for line in replica_log(pool, "new").splitlines() if "starting vllm:" in line]
    assert len(started) == 1 and started[0].endswith(
        "--kv-offloading-size 0.5 --kv-offloading-backend native"), started
    assert "fake vllm, a stand-in" in pool.model("new")["error"]  # it ran, and said why it stopped
    # the older vLLM: not started, and the error names the option
    assert "starting vllm:" not in replica_log(pool, "old")
    error = pool.model("old")["error"]
    assert "options.kv_offload_mb: this vLLM has no --kv-offloading-size" in error, error
    # no offload asked: no flag, and no help run for it
    started = [line for line in replica_log(pool, "off").splitlines() if "starting vllm:" in line]
    assert len(started) == 1 and "kv-offloading" not in started[0], started


@pytest.mark.vllm
def test_real_vllm_builds_its_offloading_connector_from_the_option(make_pool, tmp_path):
    """vLLM parses --kv-offloading-size and creates its OffloadingConnector with the bytes; its
    CPU build then refuses offloading (CUDA and XPU only), a GPU build serves with the buffer."""
    python = vllm_python()
    if not python:
        pytest.skip("no vLLM environment: run scripts/test-vllm")
    model_dir = tmp_path / "tinyhf"
    subprocess.run([python, str(ROOT / "testkit" / "tiny_hf_llama.py"), str(model_dir)], check=True,
                   capture_output=True, timeout=300)
    pool = make_pool([{**vllm_model("off", 64), "load_timeout_s": 900, "options": {
        "model": str(model_dir), "python": python, "kv_offload_mb": 64,
        "extra_args": ["--dtype", "bfloat16", "--max-model-len", "4096"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}])
    assert (pool.model("off")["memory_mb"], pool.model("off")["memory_source"]) == (64, "estimated")
    # the load answers once it is done (or failed): vLLM's CPU build takes minutes to start on a
    # cold machine (its first imports), past admin()'s 60 s, so the wait is the load's own bound
    httpx.post(f"{pool.url}/admin/models/off/load", timeout=900)
    wait_for(lambda: pool.model("off")["state"] in ("loaded", "failed"), 60, what="vLLM's load done")
    log = replica_log(pool, "off")
    assert "'kv_offloading_size': 0.0625" in log  # vLLM's "non-default args": 64 MiB in GiB
    assert "Creating v1 connector with name: OffloadingConnector" in log
    if pool.model("off")["state"] == "failed":
        assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in log
    else:
        assert pool.model("off")["memory_mb"] >= 64
        assert admin(pool, "off", "unload").json()["state"] == "unloaded"
