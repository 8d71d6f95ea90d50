"""ExLlamaV3 in-process: one model, one paged cache, one dynamic generator
with one Job per request (continuous batching).

Options: model (directory, required), max_batch_size (the capability; default
target_inflight), cache_tokens (default 8192, rounded up to 256), max_chunk_size,
max_new_tokens (default when the request sets none).

exllamav3 needs CUDA and is imported only in start(), so this module and the
worker import on any machine. The generator is not thread-safe: one thread
owns it and runs `iterate()`; the worker's event loop talks to that thread
through a command queue and gets events back with call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from protocol.errors import ErrorCode
from runtime_worker.backends.base import Backend, BackendLoadError, Event, Finished, JobError, TextDelta

PAGE_TOKENS = 256


def load_chat_template(model_dir: Path) -> str:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a
    string, or a list of named templates: the "default" one)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        raise BackendLoadError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template


def render_chat(template: str, messages: list[dict], bos_token: str = "", eos_token: str = "") -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # the template comes with the model files

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos_token, eos_token=eos_token)


# OpenAI field -> ComboSampler argument (exllamav3.generator.sampler.presets)
SAMPLER_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "rep_p", "presence_penalty": "pres_p", "frequency_penalty": "freq_p"}


def _number(request: dict, key: str, kind: type = float):
    value = request[key]
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise JobError(ErrorCode.INVALID_REQUEST, f"{key} must be a{'n integer' if kind is int else ' number'}",
                       param=key)
    return kind(value)


def job_settings(request: dict, eos_ids: list[int], default_max_new_tokens: int) -> dict:
    """Job and sampler arguments for a request (the parts that need no
    tensors). Every field in ExLlamaV3Backend.honours is mapped here."""
    max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise JobError(ErrorCode.INVALID_REQUEST, "stop must be a string or a list of strings", param="stop")
    sampler = {"temperature": 1.0, "top_p": 1.0}
    for key, arg in SAMPLER_FIELDS.items():
        if request.get(key) is not None:
            sampler[arg] = _number(request, key, int if key == "top_k" else float)
    if request.get("logit_bias"):
        bias = request["logit_bias"]
        try:  # OpenAI sends token ids as strings
            sampler["logit_bias"] = {int(token): float(value) for token, value in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise JobError(ErrorCode.INVALID_REQUEST, "logit_bias must map token ids to numbers",
                           param="logit_bias") from None
    return {
        "max_new_tokens": int(max_tokens or default_max_new_tokens),
        "stop_conditions": [*eos_ids, *stop],
        "seed": _number(request, "seed", int) if request.get("seed") is not None else None,
        "sampler": sampler,
    }


def events_from_result(result: dict) -> list[Event]:
    """Map one generator result dict to worker events; raise JobError on an error stage."""
    stage = result.get("stage")
    if stage == "error":
        raise JobError(ErrorCode.RUNTIME_ERROR, repr(result.get("error")))
    if stage != "streaming":
        return []  # "started" / "prefill": progress only
    events: list[Event] = []
    if result.get("text"):
        events.append(TextDelta(result["text"]))
    if result.get("eos"):
        reason = "length" if result.get("eos_reason") == "max_new_tokens" else "stop"
        events.append(Finished(reason, int(result.get("prompt_tokens", 0)), int(result.get("new_tokens", 0))))
    return events


class GeneratorThread:
    """Owns the generator; every generator call happens on this thread."""

    def __init__(self, generator, loop: asyncio.AbstractEventLoop) -> None:
        self.generator = generator
        self.loop = loop
        self.commands: queue.Queue = queue.Queue()
        self.jobs: dict[str, tuple[object, asyncio.Queue]] = {}  # id -> (Job, its event queue)
        self.thread = threading.Thread(target=self._guarded_run, name="exl3-generator", daemon=True)
        # resolves with the reason if the thread dies (a CUDA error, say): the worker then
        # exits non-zero and is restarted, instead of heartbeating while every job waits
        self.died: asyncio.Future = loop.create_future()

    def start(self) -> None:
        self.thread.start()

    def submit(self, job_id: str, job, events: asyncio.Queue) -> None:
        self.commands.put(("submit", job_id, job, events))

    def cancel(self, job_id: str) -> None:
        self.commands.put(("cancel", job_id, None, None))

    def stop(self) -> None:
        self.commands.put(("stop", None, None, None))
        self.thread.join(timeout=10)

    def _emit(self, events: asyncio.Queue, item) -> None:
        self.loop.call_soon_threadsafe(events.put_nowait, item)

    def _handle(self, kind: str, job_id, job, events) -> bool:
        if kind == "stop":
            self.generator.clear_queue()
            return False
        if kind == "submit":
            try:
                self.generator.enqueue(job)
                self.jobs[job_id] = (job, events)
            except AssertionError as exc:  # prompt + max_new_tokens do not fit the cache
                self._emit(events, JobError(ErrorCode.INVALID_REQUEST, f"request too long for the cache: {exc}"))
        elif kind == "cancel" and job_id in self.jobs:
            self.generator.cancel(self.jobs.pop(job_id)[0])
        return True

    def _guarded_run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            reason = f"the generator thread died: {type(exc).__name__}: {exc}"
            self.loop.call_soon_threadsafe(lambda: self.died.done() or self.died.set_result(reason))

    def _run(self) -> None:
        while True:
            block = self.generator.num_remaining_jobs() == 0  # sleep only when idle
            try:
                while True:
                    if not self._handle(*self.commands.get(block=block)):
                        return
                    block = False
            except queue.Empty:
                pass
            for result in self.generator.iterate():
                job_id = result.get("identifier")
                if job_id not in self.jobs:
                    continue  # cancelled during this step
                events = self.jobs[job_id][1]
                try:
                    for event in events_from_result(result):
                        self._emit(events, event)
                        if isinstance(event, Finished):
                            self.jobs.pop(job_id, None)
                except JobError as exc:
                    self.jobs.pop(job_id, None)
                    self._emit(events, exc)


class ExLlamaV3Backend(Backend):
    name = "exllamav3"
    # What job_settings maps onto exllamav3's Job and ComboSampler. Not yet: logprobs (the
    # generator's return_top_tokens/return_probs would need mapping to token strings),
    # response_format (its llguidance filter), tools, n > 1: refused with 400 by name.
    honours = frozenset({"messages", "max_tokens", "max_completion_tokens", "stop", "seed", "logit_bias",
                         "user", "metadata", "prompt_cache_key", *SAMPLER_FIELDS})

    async def start(self) -> tuple[int, dict]:
        model_dir = Path(str(self.options.get("model", ""))).expanduser()
        if not (model_dir / "config.json").is_file():
            raise BackendLoadError(f"options.model must be a model directory with config.json: {model_dir}")
        try:
            import exllamav3  # noqa: F401  (CUDA only; compiles its extension on first import)
        except Exception as exc:
            raise BackendLoadError(f"exllamav3 is not usable here: {type(exc).__name__}: {exc}") from None
        self.template = load_chat_template(model_dir)
        self.capacity = int(self.options.get("max_batch_size", self.target_inflight))
        self.default_max_new_tokens = int(self.options.get("max_new_tokens", 1024))
        cache_tokens = -(-int(self.options.get("cache_tokens", 8192)) // PAGE_TOKENS) * PAGE_TOKENS
        # loading blocks for seconds to minutes: keep the event loop (heartbeats) running
        await asyncio.to_thread(self._load, model_dir, cache_tokens)
        self.thread = GeneratorThread(self.generator, asyncio.get_running_loop())
        self.thread.start()
        return self.capacity, {"cache_tokens": cache_tokens, "max_batch_size": self.capacity}

    def _load(self, model_dir: Path, cache_tokens: int) -> None:
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        self.config = Config.from_directory(str(model_dir))
        self.model = Model.from_config(self.config)
        self.cache = Cache(self.model, max_num_tokens=cache_tokens)  # before load(), as exllamav3 requires
        self.model.load()
        self.tokenizer = Tokenizer.from_config(self.config)
        self.generator = Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer,
                                   max_batch_size=self.capacity,
                                   max_chunk_size=int(self.options.get("max_chunk_size", 2048)))

    async def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        from exllamav3 import ComboSampler, Job

        settings = job_settings(request, list(self.config.eos_token_id_list or []), self.default_max_new_tokens)
        prompt = render_chat(self.template, request["messages"])
        input_ids = self.tokenizer.encode(prompt, add_bos=False, encode_special_tokens=True)
        generator_job = Job(input_ids=input_ids, max_new_tokens=settings["max_new_tokens"], identifier=job,
                            stop_conditions=settings["stop_conditions"], seed=settings["seed"],
                            sampler=ComboSampler(**settings["sampler"]))
        events: asyncio.Queue = asyncio.Queue()
        self.thread.submit(job, generator_job, events)
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, JobError):
                    raise event
                yield event
                if isinstance(event, Finished):
                    finished = True
                    return
        finally:
            if not finished:
                self.thread.cancel(job)  # the client left or the worker stops: free the pages

    async def wait_dead(self) -> str:
        return await self.thread.died

    async def stop(self) -> None:
        if getattr(self, "thread", None):
            await asyncio.to_thread(self.thread.stop)
        if getattr(self, "model", None):
            self.model.unload()
