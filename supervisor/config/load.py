"""Reading a pool's TOML: validated before anything starts. Every error names the
file, the model (or tenant) and the key."""

from __future__ import annotations

import importlib.util
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path

from pydantic import Field, PrivateAttr, ValidationError

from supervisor.config.common import ConfigError, Strict
from supervisor.config.models import BACKEND_OPTIONS, NAME_MAX, NAME_PATTERN, ModelConfig, RayPlacement
from supervisor.config.server import ServerConfig
from supervisor.config.tenants import TenantConfig


def chain_error(models: Iterable) -> str | None:
    """Why the models' fallbacks are wrong (a name that is no model, a loop); None when right."""
    models = list(models)
    names = {n: m.name for m in models for n in (m.name, *m.aliases)}
    after: dict[str, list[str]] = {}
    for m in models:
        for key, targets in (("fallbacks", m.fallbacks), ("context_fallback", [m.context_fallback] if
                                                            m.context_fallback else [])):
            for target in targets:
                if target not in names:
                    return f"model {m.name!r}: key {key!r}: {target!r} is not a model"
                after.setdefault(m.name, []).append(names[target])
    for start in after:  # depth first from each model: a model met again on the path is a loop
        path, stack = [start], [iter(after[start])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                path.pop()
            elif nxt in path:
                return f"model {start!r}: key 'fallbacks': a loop: {' -> '.join([*path[path.index(nxt):], nxt])}"
            else:
                path.append(nxt)
                stack.append(iter(after.get(nxt, ())))
    return None



class PoolConfig(Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)
    _source: str | None = PrivateAttr(None)  # the file it was read from: a reload reads it again
    # [server] keys the command line set over the file's (serve --host/--port): a reload keeps them
    _overrides: dict = PrivateAttr(default_factory=dict)

    @property
    def source(self) -> str | None:
        return self._source

    def override_server(self, **values) -> None:
        """Set [server] keys over the file's, for as long as the pool runs (reloads too)."""
        for key, value in values.items():
            setattr(self.server, key, value)
        self._overrides.update(values)

    def keep_overrides(self, new: PoolConfig) -> PoolConfig:
        """`new` (the file read again) with this config's command-line overrides."""
        new.override_server(**self._overrides)
        return new

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def load_config(path: str | Path) -> PoolConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        raise ConfigError(f"{path}: cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    cfg = parse_config(raw, source=str(path))
    cfg._source = str(path)
    return cfg


def parse_config(raw: dict, source: str = "<config>") -> PoolConfig:
    try:
        cfg = PoolConfig.model_validate(raw)
    except ValidationError as exc:
        raise _config_error(source, raw, exc) from None
    seen: set[str] = set()
    for m in cfg.models:
        if m.name in seen:
            raise ConfigError(f"{source}: model {m.name!r}: key 'name': duplicate model name")
        seen.add(m.name)
    for m in cfg.models:
        for alias in m.aliases:
            if not NAME_PATTERN.match(alias):
                raise ConfigError(f"{source}: model {m.name!r}: key 'aliases': {alias!r} is not a valid name")
            if len(alias) > NAME_MAX:
                raise ConfigError(f"{source}: model {m.name!r}: key 'aliases': {alias[:NAME_MAX]!r}... is "
                                  f"{len(alias)} characters, over the {NAME_MAX} a name may have")
            if alias in seen:
                raise ConfigError(f"{source}: model {m.name!r}: key 'aliases': {alias!r} is already "
                                  f"the name or an alias of a model")
            seen.add(alias)
        budget = cfg.server.memory_budget_mb
        if budget is not None and m.memory_mb is not None and m.memory_mb > budget and not m.remote:
            raise ConfigError(f"{source}: model {m.name!r}: key 'memory_mb': {m.memory_mb:g} MB is more than "
                              f"the whole server.memory_budget_mb ({budget:g} MB)")
    for m in cfg.models:
        _check_placement(source, cfg.server, m)
    gpu_budget = cfg.server.gpu_memory_budget_mb
    for m in cfg.models:
        if gpu_budget is None or m.gpu_memory_mb is None or m.remote:
            continue
        if m.replica_devices is None:
            raise ConfigError(f"{source}: model {m.name!r}: key 'gpu_memory_mb': with server.gpu_memory_budget_mb "
                              f"set, it needs replica_devices (the GPU each replica uses)")
        share = max(m.gpu_memory_mb / len(d.split(",")) for d in m.replica_devices)
        if share > gpu_budget:
            raise ConfigError(f"{source}: model {m.name!r}: key 'gpu_memory_mb': {share:g} MB on one device is "
                              f"more than server.gpu_memory_budget_mb ({gpu_budget:g} MB)")
    budget = cfg.server.memory_budget_mb
    at_start = sum(m.memory_mb or 0 for m in cfg.models if m.load_on_start and not m.remote)
    if budget is not None and at_start > budget:
        raise ConfigError(f"{source}: key 'server.memory_budget_mb': the models with load_on_start declare "
                          f"{at_start:g} MB together, more than the budget ({budget:g} MB)")
    _check_tenants(source, cfg)
    if (wrong := chain_error(cfg.models)) is not None:
        raise ConfigError(f"{source}: {wrong}")
    for i, m in enumerate(cfg.models):
        try:
            BACKEND_OPTIONS[m.backend].model_validate(m.options)
        except ValidationError as exc:
            raise _config_error(source, raw, exc, ("models", i, "options")) from None
        if m.options.get("kv_events") is True and (m.replica_routing != "prefix" or m.remote):
            raise ConfigError(f"{source}: model {m.name!r}: key 'options.kv_events': KV events feed routing "
                              f"\"prefix\" on local replicas; this model has routing {m.replica_routing!r}"
                              f"{' and placement ray' if m.remote else ''}")
    return cfg


def _check_tenants(source: str, cfg: PoolConfig) -> None:
    """Names are unique; every tenant has a key; every key names one tenant and is
    not the admin key; every key_env variable is set. Messages never show a key."""
    names: set[str] = set()
    owner: dict[str, str] = {}  # key -> tenant
    admin = cfg.server.admin_key
    for t in cfg.tenants:
        where = f"{source}: tenant {t.name!r}"
        if t.name in names:
            raise ConfigError(f"{where}: key 'name': duplicate tenant name")
        names.add(t.name)
        keys = list(t.keys)
        for var in t.key_env:
            value = os.environ.get(var)
            if not value:
                raise ConfigError(f"{where}: key 'key_env': the environment variable {var} is not set or empty")
            keys.append(value)
        if not keys and not (t.name == "default" and cfg.server.api_key):
            raise ConfigError(f"{where}: key 'keys': a tenant needs at least one key (keys or key_env)")
        for key in keys:
            if admin and key == admin:
                raise ConfigError(f"{where}: key 'keys': the admin key is not a tenant key")
            if key == cfg.server.api_key and t.name != "default":
                raise ConfigError(f"{where}: key 'keys': server.api_key is the key of tenant 'default'")
            if owner.setdefault(key, t.name) != t.name:
                raise ConfigError(f"{where}: key 'keys': a key of tenant {owner[key]!r} too (a key names one tenant)")


def _check_placement(source: str, server: ServerConfig, m: ModelConfig) -> None:
    """placement = "ray" needs a cluster and Ray; [models.ray] and replica_devices each
    belong to one placement. (The host budgets count this host's models only.)"""
    where = f"{source}: model {m.name!r}"
    if not m.remote:
        if m.ray is not None:
            raise ConfigError(f'{where}: key \'ray\': [models.ray] applies only with placement = "ray"')
        return
    if m.replica_devices is not None:
        raise ConfigError(f"{where}: key 'replica_devices': with placement = \"ray\", Ray assigns the GPUs "
                          f"(set ray.num_gpus)")
    if server.ray_address is None:
        raise ConfigError(f"{where}: key 'placement': \"ray\" needs server.ray_address (\"auto\", or the "
                          f"head node's host:port)")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"{where}: key 'placement': \"ray\" needs Ray: pip install 'llm-pool[ray]'")
    if m.ray is None:
        m.ray = RayPlacement()


def _config_error(source: str, raw: dict, exc: ValidationError, prefix: tuple = ()) -> ConfigError:
    err = exc.errors()[0]
    loc = (*prefix, *err["loc"])
    message = f"{source}: {_where(raw, loc)}: {err['msg'].removeprefix('Value error, ')}"
    if err["type"] == "extra_forbidden" and prefix and loc[-1] in ModelConfig.model_fields:
        message += " (it is a model key: put it above [models.options])"
    return ConfigError(message)


def _where(raw: dict, loc: tuple) -> str:
    """Turn a pydantic error location into 'model "x": key "y"'."""
    if len(loc) >= 2 and loc[0] == "tenants" and isinstance(loc[1], int):
        tenants = raw.get("tenants") or []
        entry = tenants[loc[1]] if loc[1] < len(tenants) and isinstance(tenants[loc[1]], dict) else {}
        name = entry.get("name", f"#{loc[1]}")
        return f"tenant {name!r}: key {'.'.join(str(x) for x in loc[2:]) or '(tenant)'!r}"
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        models = raw.get("models") or []
        name = models[loc[1]].get("name", f"#{loc[1]}") if loc[1] < len(models) and isinstance(
            models[loc[1]], dict) else f"#{loc[1]}"
        key = ".".join(str(x) for x in loc[2:]) or "(model)"
        return f"model {name!r}: key {key!r}"
    return "key " + repr(".".join(str(x) for x in loc))
