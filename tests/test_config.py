"""Config validation: each error stops `serve` with one message naming the
file, the model and the key, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.config import ConfigError, load_config
from tests.pool import ROOT

GOOD_MODEL = '[[models]]\nname = "a"\nbackend = "synthetic"\n'


@pytest.mark.parametrize("text, expected", [
    (GOOD_MODEL + 'replicass = 2\n', ["model 'a'", "'replicass'", "Extra inputs"]),
    (GOOD_MODEL + 'target_inflight = "4"\n', ["model 'a'", "'target_inflight'", "integer"]),
    (GOOD_MODEL + 'target_inflight = 0\n', ["model 'a'", "'target_inflight'", "greater than"]),
    (GOOD_MODEL + GOOD_MODEL, ["model 'a'", "'name'", "duplicate"]),
    ('[[models]]\nname = "b"\nbackend = "tensorrt"\n', ["model 'b'", "'backend'", "llama_server"]),
    (GOOD_MODEL + 'replicas = 2\nreplica_devices = ["0"]\n', ["model 'a'", "replica_devices has 1"]),
    ('[server]\nprot = 1\n', ["'server.prot'"]),
    ('[[models]]\nname = "a"\n', ["'backend'", "Field required"]),
    ('models = [\n', ["not valid TOML"]),
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


def test_serve_refuses_a_bad_config_before_starting_anything(tmp_path):
    path = tmp_path / "pool.toml"
    path.write_text(GOOD_MODEL + 'max_queue = -1\n')
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "serve", "--config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"config error: {path}: model 'a': key 'max_queue'" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_a_public_bind_without_keys(tmp_path):
    path = tmp_path / "pool.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\n' + GOOD_MODEL)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "serve", "--config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refusing to bind 0.0.0.0" in r.stderr


def test_example_configs_are_valid():
    for path in (ROOT / "configs").glob("*.toml"):
        assert load_config(path).models, path
