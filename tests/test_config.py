"""Config validation: each error stops `serve` with one message naming the
file, the model and the key, before anything starts."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from supervisor.config import ConfigError, load_config
from tests.conftest import synthetic
from tests.pool import ROOT

GOOD_MODEL = '[[models]]\nname = "a"\nbackend = "synthetic"\n'


@pytest.mark.parametrize("text, expected", [
    (GOOD_MODEL + 'replicass = 2\n', ["model 'a'", "'replicass'", "Extra inputs"]),
    (GOOD_MODEL + 'target_inflight = "4"\n', ["model 'a'", "'target_inflight'", "integer"]),
    (GOOD_MODEL + 'target_inflight = 0\n', ["model 'a'", "'target_inflight'", "greater than"]),
    ('[server]\nmax_job_output_bytes = 1000\n' + GOOD_MODEL, ["'server.max_job_output_bytes'", "greater than"]),
    ('[server]\nrequest_log_max_bytes = "big"\n' + GOOD_MODEL, ["'server.request_log_max_bytes'", "integer"]),
    (GOOD_MODEL + GOOD_MODEL, ["model 'a'", "'name'", "duplicate"]),
    # names and aliases share one namespace; no model larger than the whole budget
    (GOOD_MODEL + '[[models]]\nname = "b"\nbackend = "synthetic"\naliases = ["a"]\n',
     ["model 'b'", "'aliases'", "'a' is already"]),
    (GOOD_MODEL + 'aliases = ["x", "x"]\n', ["model 'a'", "'aliases'", "'x' is already"]),
    (GOOD_MODEL + 'aliases = ["bad name"]\n', ["model 'a'", "'aliases'", "not a valid name"]),
    # a name fits the page's tables: at most 64 characters, name and aliases alike
    ('[[models]]\nname = "' + "n" * 65 + '"\nbackend = "synthetic"\n',
     ["model '" + "n" * 65 + "'", "'name'", "at most 64 characters"]),
    (GOOD_MODEL + 'aliases = ["' + "x" * 65 + '"]\n', ["model 'a'", "'aliases'", "65 characters, over the 64"]),
    ('[server]\nmemory_budget_mb = 100\n' + GOOD_MODEL + 'memory_mb = 200\n',
     ["model 'a'", "'memory_mb'", "more than the whole server.memory_budget_mb"]),
    ('[server]\ngpu_memory_budget_mb = 100\n' + GOOD_MODEL + 'gpu_memory_mb = 60\n',
     ["model 'a'", "'gpu_memory_mb'", "needs replica_devices"]),
    ('[server]\ngpu_memory_budget_mb = 100\n' + GOOD_MODEL + 'gpu_memory_mb = 160\nreplica_devices = ["0"]\n',
     ["model 'a'", "'gpu_memory_mb'", "160 MB on one device"]),
    ('[server]\nmemory_budget_mb = 100\n' + GOOD_MODEL + 'memory_mb = 60\n' + GOOD_MODEL.replace('"a"', '"b"')
     + 'memory_mb = 60\n', ["'server.memory_budget_mb'", "load_on_start declare 120 MB"]),
    ('[[models]]\nname = "b"\nbackend = "tensorrt"\n', ["model 'b'", "'backend'", "llama_server"]),
    (GOOD_MODEL + 'replicas = 2\nreplica_devices = ["0"]\n', ["model 'a'", "replica_devices has 1"]),
    ('[server]\nprot = 1\n', ["'server.prot'"]),
    ('[[models]]\nname = "a"\n', ["'backend'", "Field required"]),
    ('models = [\n', ["not valid TOML"]),
    # [models.options] is typed per backend
    (GOOD_MODEL + '[models.options]\ncapcity = 2\n', ["model 'a'", "'options.capcity'", "Extra inputs"]),
    (GOOD_MODEL + '[models.options]\ncapacity = "2"\n', ["model 'a'", "'options.capacity'", "integer"]),
    (GOOD_MODEL + '[models.options]\nchaos = "loud"\n', ["model 'a'", "'options.chaos'", "garbage"]),
    ('[[models]]\nname = "l"\nbackend = "llama_server"\n[models.options]\nmodel = "m.gguf"\n'
     'extra_args = ["-ngl", 99]\n', ["model 'l'", "'options.extra_args.1'", "string"]),
    ('[[models]]\nname = "l"\nbackend = "llama_server"\n[models.options]\nmodel = "m.gguf"\n'
     'stop_timeout_s = 5\n', ["model 'l'", "'options.stop_timeout_s'", "a model key"]),
    ('[[models]]\nname = "v"\nbackend = "vllm_serve"\n[models.options]\nbinary = "vllm"\n',
     ["model 'v'", "'options.model'", "Field required"]),
    # vLLM's KV offloading: MiB of host memory, a whole number, set in one place
    ('[[models]]\nname = "v"\nbackend = "vllm_serve"\n[models.options]\nmodel = "m"\nkv_offload_mb = -1\n',
     ["model 'v'", "'options.kv_offload_mb'", "greater than or equal to 0"]),
    ('[[models]]\nname = "v"\nbackend = "vllm_serve"\n[models.options]\nmodel = "m"\nkv_offload_mb = "4G"\n',
     ["model 'v'", "'options.kv_offload_mb'", "valid integer"]),
    ('[[models]]\nname = "v"\nbackend = "vllm_serve"\n[models.options]\nmodel = "m"\nkv_offload_mb = 1.5\n',
     ["model 'v'", "'options.kv_offload_mb'", "valid integer"]),
    ('[[models]]\nname = "v"\nbackend = "vllm_serve"\n[models.options]\nmodel = "m"\nkv_offload_mb = 512\n'
     'extra_args = ["--kv_offloading_size=2"]\n',
     ["model 'v'", "'options'", "kv_offload_mb and --kv-offloading-size in extra_args", "set one"]),
    ('[[models]]\nname = "l"\nbackend = "llama_server"\n[models.options]\nmodel = "m.gguf"\nkv_offload_mb = 5\n',
     ["model 'l'", "'options.kv_offload_mb'", "Extra inputs"]),
    ('[[models]]\nname = "r"\nbackend = "openai_remote"\n[models.options]\nbase_url = "http://h/v1"\n'
     'model = "m"\nextra_body = ["top_k"]\n', ["model 'r'", "'options.extra_body'", "dictionary"]),
    ('[[models]]\nname = "x"\nbackend = "exllamav3"\n[models.options]\nmodel = "/m"\ncache_tokens = 0\n',
     ["model 'x'", "'options.cache_tokens'", "greater than"]),
    ('[server]\nheartbeat_s = 2.0\nliveness_s = 2.0\n', ["'server.liveness_s'", "greater than heartbeat_s"]),
    ('[server]\nliveness_s = 0.5\n', ["'server.liveness_s'", "greater than heartbeat_s (1.0)"]),
    ('[server]\nliveness_s = 20.0\nsupervisor_patience_s = 19.5\n',
     ["'server.supervisor_patience_s'", "must be at least liveness_s (20.0)"]),
    ('[server]\nmax_body_bytes = 8192\nmax_buffered_body_bytes = 4096\n',
     ["'server.max_buffered_body_bytes'", "must be at least max_body_bytes (8192)"]),
    (GOOD_MODEL + 'newcomer_slots = -1\n', ["model 'a'", "'newcomer_slots'", "greater than or equal to 0"]),
    # replicas on a Ray cluster (placement = "ray")
    (GOOD_MODEL + 'placement = "ray"\n', ["model 'a'", "'placement'", "needs server.ray_address"]),
    (GOOD_MODEL + 'placement = "k8s"\n', ["model 'a'", "'placement'", "'local' or 'ray'"]),
    ('[server]\nray_address = "ray://head:10001"\n', ["'server.ray_address'", "ray:// addresses are not supported"]),
    ('[server]\nray_bind_port = 70000\n', ["'server.ray_bind_port'", "less than or equal"]),
    (GOOD_MODEL + '[models.ray]\nnum_gpus = 1\n', ["model 'a'", "'ray'", 'only with placement = "ray"']),
    ('[server]\nray_address = "auto"\n' + GOOD_MODEL + 'placement = "ray"\n[models.ray]\nnum_gpu = 1\n',
     ["model 'a'", "'ray.num_gpu'", "Extra inputs"]),
    ('[server]\nray_address = "auto"\n' + GOOD_MODEL + 'placement = "ray"\n[models.ray]\nnum_gpus = -1\n',
     ["model 'a'", "'ray.num_gpus'", "greater than or equal to 0"]),
    ('[server]\nray_address = "auto"\n' + GOOD_MODEL + 'placement = "ray"\n[models.ray]\nresources = {GPU = 1}\n',
     ["model 'a'", "'ray.resources'", "use num_cpus / num_gpus"]),
    ('[server]\nray_address = "auto"\n' + GOOD_MODEL + 'placement = "ray"\n[models.ray]\nresources = {a = 0}\n',
     ["model 'a'", "'ray.resources'", "greater than 0"]),
    ('[server]\nray_address = "auto"\n' + GOOD_MODEL + 'placement = "ray"\n[models.ray]\nnode_labels = {gpu = 1}\n',
     ["model 'a'", "'ray.node_labels.gpu'", "string"]),
    ('[server]\nray_address = "auto"\n' + GOOD_MODEL + 'placement = "ray"\nreplica_devices = ["0"]\n',
     ["model 'a'", "'replica_devices'", "Ray assigns the GPUs"]),
])
def test_config_errors_name_file_model_and_key(tmp_path, text, expected):
    path = tmp_path / "pool.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    message = str(exc.value)
    assert message.startswith(str(path))
    for part in expected:
        assert part in message, message


@pytest.mark.parametrize("text, key", [
    (GOOD_MODEL + 'max_queue = -1\n', "max_queue"),
    (GOOD_MODEL + '[models.options]\noutput_tokens = 1.5\n', "options.output_tokens"),
])
def test_serve_refuses_a_bad_config_before_starting_anything(tmp_path, text, key):
    path = tmp_path / "pool.toml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "serve", "--config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"config error: {path}: model 'a': key '{key}'" in r.stderr
    assert "Traceback" not in r.stderr


def test_options_of_every_backend_pass_as_given(tmp_path):
    path = tmp_path / "pool.toml"
    path.write_text('''
[[models]]
name = "l"
backend = "llama_server"
[models.options]
model = "m.gguf"
ctx_size = 4096
extra_args = ["--no-jinja"]
extra_body = {ignore_eos = true, nested = {a = [1, 2]}}

[[models]]
name = "v"
backend = "vllm_serve"
[models.options]
model = "org/model"
python = "/venv/bin/python"
env = {VLLM_CPU_KVCACHE_SPACE = 1, OTHER = "x"}

[[models]]
name = "x"
backend = "exllamav3"
load_timeout_s = 900
[models.options]
model = "/models/x"
max_batch_size = 8

[[models]]
name = "r"
backend = "openai_remote"
[models.options]
base_url = "https://api.example.com/v1"
model = "gpt"
api_key_env = "KEY"

[[models]]
name = "s"
backend = "synthetic"
[models.options]
tokens_per_second = 20
ttft_ms = 0.5
chaos = "garbage"
''')
    cfg = load_config(path)
    # the worker gets the options exactly as written (JSON on its command line)
    assert cfg.model("l").options["extra_body"] == {"ignore_eos": True, "nested": {"a": [1, 2]}}
    assert cfg.model("v").options["env"] == {"VLLM_CPU_KVCACHE_SPACE": 1, "OTHER": "x"}
    assert cfg.model("s").options == {"tokens_per_second": 20, "ttft_ms": 0.5, "chaos": "garbage"}
    # vLLM's cold start takes minutes: its default load timeout is longer; a set one is kept
    assert {m.name: m.load_timeout_s for m in cfg.models} == {"l": 120, "v": 600, "x": 900, "r": 120, "s": 120}


RAY_MODEL = ('[server]\nray_address = "auto"\nmemory_budget_mb = 100\n' + GOOD_MODEL +
             'placement = "ray"\nmemory_mb = 500\n[models.ray]\nnum_gpus = 1\nresources = {gpu_host_a = 1}\n'
             'node_labels = {zone = "a"}\n')


def test_a_ray_placed_model_parses_and_stays_out_of_this_hosts_budget(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "ray" else real(name, *a))
    path = tmp_path / "pool.toml"
    path.write_text(RAY_MODEL + GOOD_MODEL.replace('"a"', '"b"') + 'placement = "ray"\n')
    cfg = load_config(path)
    a, b = cfg.models
    assert a.remote and a.ray.num_gpus == 1 and a.ray.resources == {"gpu_host_a": 1}
    assert a.ray.node_labels == {"zone": "a"}
    assert b.remote and b.ray.num_cpus == 1 and b.ray.num_gpus == 0  # defaults: one CPU, no GPU
    assert cfg.server.ray_address == "auto" and cfg.server.ray_bind_port == 0


def test_a_ray_placed_model_without_ray_installed_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    path = tmp_path / "pool.toml"
    path.write_text(RAY_MODEL)
    with pytest.raises(ConfigError,
                       match=r"model 'a': key 'placement': \"ray\" needs Ray: pip install 'llm-pool\[ray\]'"):
        load_config(path)


def test_serve_refuses_a_public_bind_without_keys(tmp_path):
    path = tmp_path / "pool.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\n' + GOOD_MODEL)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "serve", "--config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refusing to bind 0.0.0.0" in r.stderr


def test_example_configs_are_valid():
    paths = sorted((ROOT / "configs").glob("*.toml"))
    assert {"demo.toml", "synthetic.toml"} <= {p.name for p in paths}, paths
    for path in paths:
        assert load_config(path).models, path


def test_a_shared_state_dir_keeps_its_mode_and_the_pool_makes_its_own(make_pool, tmp_path):
    """state_dir set to a shared directory (mode 1777) was once chmod-ed to 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    pool = make_pool([synthetic("s", tokens=2)], server={"state_dir": str(shared)})
    assert pool.http.post("/v1/chat/completions", json={"model": "s", "messages": [
        {"role": "user", "content": "hi"}]}).status_code == 200
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    own = shared / "llm-pool"
    assert stat.S_IMODE(own.stat().st_mode) == 0o700 and stat.S_IMODE((own / "logs").stat().st_mode) == 0o700
    assert (own / "logs" / "s-0.log").is_file() and (own / "requests.sqlite3").is_file()
    assert sorted(p.name for p in shared.iterdir()) == ["llm-pool"]  # nothing of the pool's lies open beside it


VLLM_MODEL = '[[models]]\nname = "v"\nbackend = "vllm_serve"\nreplicas = {replicas}\n{extra}[models.options]\nmodel = "m"\n'


@pytest.mark.parametrize("replicas, extra, kv_option, expected", [
    (2, "", "", True),  # routing defaults to prefix for 2 replicas: KV events on
    (1, "", "", False),  # least_inflight: off
    (2, "", "kv_events = false\n", False),
    (2, 'routing = "session"\n', "", False),
    (1, 'routing = "prefix"\n', "kv_events = true\n", True),
])
def test_vllm_kv_events_follow_prefix_routing(tmp_path, replicas, extra, kv_option, expected):
    path = tmp_path / "pool.toml"
    path.write_text(VLLM_MODEL.format(replicas=replicas, extra=extra) + kv_option)
    assert load_config(path).models[0].worker_options["kv_events"] is expected


@pytest.mark.parametrize("extra, kv_option, expected", [
    ('routing = "least_inflight"\n', "kv_events = true\n", "routing 'least_inflight'"),
    ("", 'kv_events = "yes"\n', "options.kv_events"),
])
def test_vllm_kv_events_refused_where_nothing_reads_them(tmp_path, extra, kv_option, expected):
    path = tmp_path / "pool.toml"
    path.write_text(VLLM_MODEL.format(replicas=2, extra=extra) + kv_option)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "options.kv_events" in str(exc.value) and expected in str(exc.value), str(exc.value)
