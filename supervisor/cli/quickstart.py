"""A first model without a config file: `llm-pool serve model.gguf …` serves GGUF files on
llama-server with defaults taken from the files, and `llm-pool init model.gguf …` writes the
same pool as a commented pool.toml to grow from."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from supervisor.config import NAME_MAX, NAME_PATTERN, ConfigError, PoolConfig, parse_config
from supervisor.cli.gguf_header import GGUFError, GGUFInfo, read_header

# A trained context of 128K tokens would make llama-server reserve its KV cache for all of it
# (gigabytes for a 7B model): per slot, the file's context up to this; --ctx-size for more.
MAX_DEFAULT_CONTEXT = 32768
FALLBACK_CONTEXT = 4096  # a file whose header names none


def model_name(path: Path, taken: set[str]) -> str:
    """The file's stem as a model name: characters a name cannot hold become '-',
    at most NAME_MAX characters, '-2', '-3' … when two files share a stem."""
    stem = re.sub(r"[^A-Za-z0-9._:-]", "-", path.stem).lstrip("._:-")[:NAME_MAX] or "model"
    name, n = stem, 2
    while name in taken:
        suffix = f"-{n}"
        name, n = stem[:NAME_MAX - len(suffix)] + suffix, n + 1
    assert NAME_PATTERN.match(name)
    return name


def describe(paths: list[Path]) -> list[tuple[Path, GGUFInfo]]:
    found = []
    for path in paths:
        path = Path(os.path.abspath(path.expanduser()))  # not resolved: a link's own name names the model
        if not path.is_file():
            raise ConfigError(f"{path}: no such file")
        try:
            found.append((path, read_header(path)))
        except (GGUFError, OSError) as exc:
            raise ConfigError(str(exc)) from None
    return found


def model_entries(paths: list[Path], slots: int = 1, ctx_per_slot: int | None = None) -> list[dict]:
    """One [[models]] table per file: llama_server, its own chat template (--jinja)."""
    entries, taken = [], set()
    for path, info in describe(paths):
        name = model_name(path, taken)
        taken.add(name)
        context = ctx_per_slot or min(info.context_length or FALLBACK_CONTEXT, MAX_DEFAULT_CONTEXT)
        entries.append({"name": name, "backend": "llama_server", "target_inflight": slots,
                        "options": {"model": str(path), "ctx_size": context * slots, "extra_args": ["--jinja"]}})
    return entries


def pool_config(paths: list[Path], host: str = "127.0.0.1", port: int = 8000, slots: int = 1,
                ctx_per_slot: int | None = None) -> PoolConfig:
    raw = {"server": {"host": host, "port": port}, "models": model_entries(paths, slots, ctx_per_slot)}
    return parse_config(raw, source="llm-pool serve")


def _toml(value) -> str:
    return json.dumps(value)  # strings, numbers and lists of strings: JSON's spelling is TOML's


def _line(code: str, comment: str) -> str:
    return f"{code:<28} # {comment}"


def init_toml(paths: list[Path], slots: int = 1, ctx_per_slot: int | None = None) -> str:
    """A commented pool.toml serving these files; every key is in docs/configuration-reference.md."""
    from supervisor.models.memory import estimate_mb
    infos = dict(describe(paths))
    cfg = pool_config(paths, slots=slots, ctx_per_slot=ctx_per_slot)
    lines = [
        "# pool.toml, written by `llm-pool init`. Serve it: llm-pool serve --config pool.toml",
        "# Every key: docs/configuration-reference.md. Apply edits to a running pool: llm-pool reload",
        "",
        "[server]",
        _line('host = "127.0.0.1"', "another address needs api_key and admin_key"),
        "port = 8000",
        _line('# api_key = "sk-..."', "or env LLM_POOL_API_KEY; unset: no key asked"),
        _line('# admin_key = "..."', "/admin only; or env LLM_POOL_ADMIN_KEY"),
        _line("# memory_budget_mb = 16000", "host RAM the loaded models may use together"),
        _line("# idle_unload_s = 900", "unload a model idle this long (every model's default)"),
    ]
    for m in cfg.models:
        info = infos[Path(m.options["model"])]
        trained = f"trained context {info.context_length}" if info.context_length else "no context in its header"
        lines += [
            "",
            "[[models]]",
            _line(f"name = {_toml(m.name)}", 'what requests put in "model"'),
            'backend = "llama_server"',
            _line(f"target_inflight = {m.target_inflight}", "requests at once (llama-server's slots)"),
            _line("# replicas = 1", "more processes, each its own llama-server"),
            _line('# aliases = ["gpt-4o-mini"]', "other names that route here"),
            _line("# idle_unload_s = 600", "unload after this long idle"),
            _line(f"# memory_mb = {estimate_mb(m):.0f}", "unset: estimated so (file size plus context), "
                  "then measured"),
            "[models.options]",
            f"model = {_toml(m.options['model'])}",
            _line(f"ctx_size = {m.options['ctx_size']}", f"tokens over all slots ({info.architecture}, {trained})"),
            _line(f"extra_args = {_toml(m.options['extra_args'])}", "the GGUF's own chat template; more "
                  'llama-server flags here ("-ngl", "99")'),
        ]
    return "\n".join(lines) + "\n"
