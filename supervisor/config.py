"""TOML config, validated before anything starts. Every error names the file,
the model and the key."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BackendName = Literal["synthetic", "llama_server", "openai_remote", "vllm_serve", "exllamav3"]


class ConfigError(Exception):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None  # or env LLM_POOL_API_KEY
    admin_key: str | None = None  # or env LLM_POOL_ADMIN_KEY
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    heartbeat_s: float = Field(1.0, gt=0)  # both directions
    liveness_s: float = Field(10.0, gt=0)  # no heartbeat this long: the peer is gone
    shutdown_grace_s: float = Field(30.0, ge=0)
    sse_ping_s: float = Field(15.0, gt=0)  # a stream quiet this long gets a ": ping" comment line
    state_dir: str | None = None  # replica logs; default: the user's state dir
    # The HTTP edge (supervisor/http_guard.py): bounds on what a client may send before a route runs.
    allowed_hosts: list[str] = Field(default_factory=list)  # more Host names for /admin ("name" or "name:port")
    max_connections: int = Field(1000, ge=1, le=1_000_000)  # more are closed at once
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)  # request line + headers; else 431
    max_headers: int = Field(100, ge=8, le=10_000)  # header lines per request; else 431
    header_timeout_s: float = Field(15.0, gt=0)  # headers complete this long after their first byte
    body_timeout_s: float = Field(60.0, gt=0)  # body complete this long after the headers

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        for h in hosts:
            if not h or any(c.isspace() or c in "/@?#," for c in h):
                raise ValueError(f"{h!r} is not a host name (expected 'name', 'name:port' or '*')")
        return hosts


class ModelConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    backend: BackendName
    replicas: int = Field(1, ge=1, le=64)
    target_inflight: int = Field(1, ge=1, le=4096)
    max_queue: int = Field(256, ge=0)
    load_on_start: bool = True
    load_timeout_s: float = Field(120.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)  # whole job, queue wait included
    queue_timeout_s: float | None = Field(None, gt=0)  # max wait in the queue; then 503 queue_timeout
    retry_unstarted_on_crash: bool = True  # a crash before the first token: run it once more elsewhere
    stop_timeout_s: float = Field(10.0, gt=0)  # drain-free stop: SIGTERM .. SIGKILL
    replica_devices: list[str] | None = None  # CUDA_VISIBLE_DEVICES per replica
    options: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _devices_per_replica(self) -> ModelConfig:
        if self.replica_devices is not None and len(self.replica_devices) != self.replicas:
            raise ValueError(f"replica_devices has {len(self.replica_devices)} entries "
                             f"for {self.replicas} replicas")
        return self


class PoolConfig(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(default_factory=list)

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def load_config(path: str | Path) -> PoolConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, source: str = "<config>") -> PoolConfig:
    try:
        cfg = PoolConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"{source}: {_where(raw, err['loc'])}: {err['msg']}") from None
    seen: set[str] = set()
    for m in cfg.models:
        if m.name in seen:
            raise ConfigError(f"{source}: model {m.name!r}: key 'name': duplicate model name")
        seen.add(m.name)
    return cfg


def _where(raw: dict, loc: tuple) -> str:
    """Turn a pydantic error location into 'model "x": key "y"'."""
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        models = raw.get("models") or []
        name = models[loc[1]].get("name", f"#{loc[1]}") if loc[1] < len(models) and isinstance(
            models[loc[1]], dict) else f"#{loc[1]}"
        key = ".".join(str(x) for x in loc[2:]) or "(model)"
        return f"model {name!r}: key {key!r}"
    return "key " + repr(".".join(str(x) for x in loc))
