"""A first model without a config file: `llm-pool serve model.gguf` and `llm-pool init`,
the GGUF header they read, against the tiny GGUF and real llama-server."""

from __future__ import annotations

import os
import struct
import sys
import tomllib
from pathlib import Path

import gguf
import pytest

from supervisor.config import parse_config
from supervisor.cli.gguf_header import GGUFError, read_header
from supervisor.cli.quickstart import MAX_DEFAULT_CONTEXT, init_toml, model_name, pool_config
from tests.pool import Pool
from tests.test_cli import cli


def test_header_matches_the_gguf_package(tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf)
    arch = reader.fields["general.architecture"].contents()
    info = read_header(tiny_gguf)
    assert info.architecture == arch == "llama"
    assert info.context_length == reader.fields[f"{arch}.context_length"].contents() == 32768
    assert info.name == "llm-pool-tiny-test"
    assert info.size_bytes == Path(tiny_gguf).stat().st_size


def test_a_damaged_header_is_an_error_not_a_hang(tiny_gguf, tmp_path):
    data = Path(tiny_gguf).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    with pytest.raises(GGUFError, match="ends early"):
        read_header(cut)
    huge = tmp_path / "huge.gguf"  # one key whose name claims 2**62 bytes
    huge.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**62))
    with pytest.raises(GGUFError, match="a string of"):
        read_header(huge)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_header(text)


def test_names_come_from_the_file_stem():
    taken: set[str] = set()
    assert model_name(Path("/m/Qwen2.5-7B-Instruct-Q4_K_M.gguf"), taken) == "Qwen2.5-7B-Instruct-Q4_K_M"
    assert model_name(Path("/m/my model (v2).gguf"), taken) == "my-model--v2-"
    taken.add("tiny")
    assert model_name(Path("/other/tiny.gguf"), taken) == "tiny-2"
    assert len(model_name(Path("/m/" + "x" * 100 + ".gguf"), set())) == 64


def test_init_writes_the_pool_serve_runs(tiny_gguf, tmp_path):
    """init's pool.toml is the pool `serve FILE` runs (same models, same options), with
    comments to grow from; the context is the file's, bounded."""
    done = cli("init", tiny_gguf, tiny_gguf)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# pool.toml, written by `llm-pool init`")
    written = parse_config(tomllib.loads(done.stdout))
    direct = pool_config([Path(tiny_gguf)] * 2)
    assert [m.model_dump() for m in written.models] == [m.model_dump() for m in direct.models]
    assert [m.name for m in written.models] == ["tiny", "tiny-2"]
    assert written.models[0].options == {"model": os.path.abspath(tiny_gguf), "ctx_size": 32768,
                                         "extra_args": ["--jinja"]}
    slots = parse_config(tomllib.loads(init_toml([Path(tiny_gguf)], slots=4, ctx_per_slot=1024)))
    assert slots.models[0].target_inflight == 4 and slots.models[0].options["ctx_size"] == 4096
    assert MAX_DEFAULT_CONTEXT == 32768
    link = tmp_path / "my-chat.gguf"  # a link keeps its own name (scripts/demo links its model so)
    link.symlink_to(tiny_gguf)
    assert pool_config([link]).models[0].name == "my-chat"


def test_serve_refuses_what_it_cannot_serve(tiny_gguf, tmp_path):
    for args, text in [(("serve",), "give a config file"),
                       (("serve", tiny_gguf, "--config", "x.toml"), "not both"),
                       (("serve", "--config", "x.toml", "--slots", "2"), "--slots and --ctx-size are for GGUF"),
                       (("serve", str(tmp_path / "missing.gguf")), "no such file"),
                       (("serve", "--model", str(Path(__file__))), "not a GGUF file"),
                       (("init", str(tmp_path)), "no such file")]:
        done = cli(*args)
        assert done.returncode == 2 and text in done.stderr, (args, done.stderr)


@pytest.mark.llama
def test_serve_a_gguf_without_a_config(tiny_gguf, llama_server_bin, tmp_path):
    """`llm-pool serve tiny.gguf` (no config file) serves it on llama-server, named after the
    file, and answers a chat."""
    pool = Pool(tmp_path, [], env={"LLAMA_SERVER_BIN": llama_server_bin, "XDG_STATE_HOME": str(tmp_path / "state")})
    pool.command = [sys.executable, "-m", "supervisor.cli", "serve", tiny_gguf, "--port", str(pool.port)]
    pool.start(timeout=120)
    try:
        assert pool.model("tiny")["state"] == "loaded"
        r = pool.http.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert pool.model("tiny")["context_length"] == 32768
    finally:
        pool.stop()


def _header_only(path: Path, context: int | None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    if context is not None:
        w.add_context_length(context)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_context_is_the_files_within_a_bound(tmp_path):
    """A 128K-token trained context would reserve gigabytes of KV cache: at most 32,768 per
    slot unless asked; a header without one gets 4,096; --ctx-size is taken as given."""
    long = _header_only(tmp_path / "long.gguf", 131072)
    bare = _header_only(tmp_path / "bare.gguf", None)
    assert read_header(long).context_length == 131072 and read_header(bare).context_length is None
    cfg = pool_config([long, bare], slots=2)
    assert [m.options["ctx_size"] for m in cfg.models] == [2 * MAX_DEFAULT_CONTEXT, 2 * 4096]
    assert pool_config([long], ctx_per_slot=100_000).models[0].options["ctx_size"] == 100_000
