"""Which of llama-server's tasks serve a job, exactly, so that the job's story shows the
runtime's own log lines of that job (`slot ...: id N | task T | ...`), not a time window.

llama-server's OpenAI routes name neither the slot nor the task of a request, and none of
its log lines at the default verbosity names anything of a request. Its `/slots` does:
each slot's task (`id_task`; an idle slot keeps its last one) and that task's sampling
`seed`. So each job carries a seed no other live job of this worker carries: when neither
the client nor the operator set one, one the worker draws at random (a request without a
seed gets a random one from llama-server anyway: the same kind of answer). Once the job's
first output came (its tasks are in their slots), one look at /slots says which slots hold
tasks with its seed. Child tasks (n > 1) carry the seed + 1, + 2, ... (llama-server's
server_task::add_child).

Exact, or nothing: no tie when another live job's seeds overlap this one's (a client's own
seed used twice at once, an operator's fixed seed), when more slots show them than the job
has tasks, when a seed the worker did not draw shows only in an idle slot (an earlier job's
task may have left it there), or when /slots does not answer (--no-slots, a crash) or answers
more than warm_swap.SLOTS_MAX_BYTES (each slot's prompt text in it: LLAMA_SERVER_SLOTS_DEBUG).

Not `id_slot` (pinning each job to a slot the worker picks): llama-server then skips its own
choice of the slot whose cache shares the longest prefix with the prompt, and the save to
and load from its host prompt cache that goes with a slot change (get_available_slot)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

from protocol.choices import MAX_CHOICES, choice_limit
from protocol.messages import MAX_RUNTIME_TASKS
from runtime_worker.backends.base import Event, Finished, RuntimeTasks
from runtime_worker.warm_swap import SlotsTooLarge

log = logging.getLogger("runtime_worker")

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a new random seed for each task
SEED_FLAGS = ("-s", "--seed")
TIE_WAIT_S = 1.0  # at a job's end, how long its look at /slots may still take before the Done goes without it
RECENT_SEEDS = 4096  # seeds of ended jobs a new draw avoids (their tasks may still show in idle slots)


def fixed_seed(options: dict) -> int | None:
    """The seed the operator gave every request (options.extra_body.seed, a --seed flag, or
    LLAMA_ARG_SEED); -1 when one is given that the worker cannot read; None when none is."""
    given = (options.get("extra_body") or {}).get("seed")
    args = [str(a) for a in options.get("extra_args", [])]
    for i, arg in enumerate(args):
        if arg in SEED_FLAGS:
            given = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith("--seed="):
            given = arg.removeprefix("--seed=")
    if given is None:
        given = os.environ.get("LLAMA_ARG_SEED")
    if given is None:
        return None
    try:
        return int(given)
    except (TypeError, ValueError):
        return -1


class TaskTies:
    """The seeds of a worker's live jobs, and the look at /slots that ties a job to its tasks.
    `slots`: an awaitable that answers llama-server's GET /slots (a list of slot objects):
    warm_swap.SlotClient.slots, which reads it up to a byte cap (SlotsTooLarge past it: no tie)."""

    def __init__(self, options: dict, slots: Callable[[], Awaitable[list]]) -> None:
        self.fixed = fixed_seed(options)
        self.slots = slots
        self.live: dict[str, range] = {}  # job -> the seeds its tasks carry
        self.drawn: set[str] = set()  # live jobs whose seed the worker drew
        self.recent: collections.deque[range] = collections.deque(maxlen=RECENT_SEEDS)
        self.too_large_said = False  # the warning that /slots was over its cap, once per worker

    def mark(self, job: str, request: dict, endpoint: str) -> dict:
        """The request as it goes to llama-server: with a drawn seed when nobody chose one."""
        n = choice_limit(request, endpoint)
        if "seed" in request:
            seed = request["seed"]
        elif self.fixed is not None:
            seed = self.fixed
        else:
            seed = self._draw(n)
            request = {**request, "seed": seed}
            self.drawn.add(job)
        if type(seed) is int and 0 <= seed and seed + n <= RANDOM_SEED:  # else random or unreadable: no tie
            self.live[job] = range(seed, seed + n)
        return request

    def _draw(self, n: int) -> int:
        taken = [*self.live.values(), *self.recent]
        while True:
            seed = secrets.randbelow(RANDOM_SEED - MAX_CHOICES)
            if not any(seed < r.stop and r.start < seed + n for r in taken):
                return seed

    def forget(self, job: str) -> None:
        seeds = self.live.pop(job, None)
        if job in self.drawn:
            self.drawn.discard(job)
            if seeds is not None:
                self.recent.append(seeds)

    async def lookup(self, job: str) -> tuple | None:
        """The job's (slot, task id) pairs, by task id; None when they cannot be told for sure."""
        seeds = self.live.get(job)
        if seeds is None or any(other != job and seeds.start < r.stop and r.start < seeds.stop
                                for other, r in self.live.items()):
            return None
        try:
            slots = await self.slots()
        except SlotsTooLarge as exc:  # its slots' prompt text in it: reading on would cost without bound
            if not self.too_large_said:
                log.warning("llama-server's tasks are not tied to jobs while its /slots answers this much "
                            "(%s; LLAMA_SERVER_SLOTS_DEBUG puts each slot's prompt text in it): their stories "
                            "show their time window's lines", exc)
                self.too_large_said = True
            log.debug("job %s: no tie: %s", job, exc)
            return None
        except Exception as exc:  # no answer (--no-slots, a crash): no tie, and the job goes on
            log.debug("job %s: no look at llama-server's /slots: %r", job, exc)
            return None
        found = []
        for slot in slots if isinstance(slots, list) else ():
            params = slot.get("params") if isinstance(slot, dict) else None
            seed, task, index = (params or {}).get("seed"), slot.get("id_task"), slot.get("id")
            if (type(seed) is int and seed in seeds and type(task) is int and type(index) is int
                    and task >= 0 and index >= 0 and (job in self.drawn or slot.get("is_processing") is True)):
                found.append((index, task))
        if not found or len(found) > min(len(seeds), MAX_RUNTIME_TASKS):
            return None
        return tuple(sorted(found, key=lambda pair: pair[1]))

    async def events(self, job: str, request: dict, endpoint: str,
                     open_stream: Callable[[dict], AsyncIterator[Event]]) -> AsyncIterator[Event]:
        """The job's events (from `open_stream(request)`, with its seed), and its RuntimeTasks
        once /slots answered, which is asked once the first event came (the job's tasks are in
        their slots by then). The look runs as one task beside the stream: each later event
        only checks whether it is done (no wait of its own), and the tie goes out before the
        first event after its answer; the Finished (or the stream's end) waits for the answer
        TIE_WAIT_S at most (else the job ends without its tasks said)."""
        request = self.mark(job, request, endpoint)
        stream = open_stream(request)
        lookup: asyncio.Task | None = None  # the look at /slots, None again once its answer is out
        looked = False
        try:
            async for event in stream:
                if lookup is not None and (lookup.done() or isinstance(event, Finished)):
                    tasks = lookup.result() if lookup.done() else await _answer(lookup)
                    lookup = None
                    if tasks:
                        yield RuntimeTasks(tasks)
                yield event
                if not looked:
                    looked, lookup = True, asyncio.create_task(self.lookup(job))
            if lookup is not None:  # the stream ended with no Finished: the answer comes now or never
                if tasks := await _answer(lookup):
                    yield RuntimeTasks(tasks)
        except Exception:  # the stream failed (its runtime died): a tie already known still goes out
            if lookup is not None and lookup.done() and (tasks := lookup.result()):
                yield RuntimeTasks(tasks)
            raise
        finally:
            if lookup is not None:
                lookup.cancel()
            self.forget(job)
            await stream.aclose()


async def _answer(lookup: asyncio.Task) -> tuple | None:
    try:
        return await asyncio.wait_for(asyncio.shield(lookup), TIE_WAIT_S)
    except TimeoutError:
        return None
