"""Token-fair order across tenants (virtual token counters, as in VTC: Sheng
et al., "Fairness in Serving Large Language Models", OSDI'24).

`FairQueue` implements `JobQueue`. Each tenant has its own FIFO lane and a
virtual counter: the weighted tokens the tenant was served on this model,
divided by its weight. The next job comes from the backlogged tenant with the
lowest counter within the highest priority band that is waiting (ties: the
tenant served longest ago, then the older head job), so with one tenant it is
plain FIFO.

Counters are charged as tokens are produced, not when a request ends: a job
handed out is charged its prompt at once (an estimate from its size, set right
from the runtime's usage at its end) and, for each delta it streams, the
output tokens that delta carries (also set right at the end). Output tokens weigh `output_weight`
prompt tokens.

A tenant whose lane was empty is lifted, when a job arrives, to the lowest
counter of the backlogged tenants of its band (or, with none, to the counter
last served in that band): idle time banks no credit. Nothing waits while a
job is queued (work-conserving). Weights and priorities are read at each
decision, so a reload that changes them applies to the next choice."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from supervisor.scheduling.jobs import Job

PROMPT_BYTES_PER_TOKEN = 4  # the prompt's charge at hand-over, before the runtime tells the real count


@dataclass(frozen=True, slots=True)
class Share:
    """A tenant's claim on a contended model."""
    weight: float = 1.0
    priority: int = 0


DEFAULT_SHARE = Share()


def _equal_shares(tenant: str) -> Share:  # noqa: ARG001 -- every tenant alike
    return DEFAULT_SHARE


class _Lane:
    __slots__ = ("jobs", "band")

    def __init__(self, band: int) -> None:
        self.jobs: deque[tuple[int, Job]] = deque()  # (arrival number, job), FIFO
        self.band = band  # its tenant's priority as of the last decision (for `ahead`'s estimate)


class TokenMeter:
    """Charges one handed-out job's tokens to its tenant's counter as they come."""

    __slots__ = ("queue", "tenant", "prompt", "output")

    def __init__(self, queue: FairQueue, tenant: str, prompt_estimate: int) -> None:
        self.queue = queue
        self.tenant = tenant
        self.prompt = prompt_estimate  # prompt tokens charged so far
        self.output = 0  # output tokens charged so far
        queue.charge(tenant, prompt_estimate, 0)

    def delta(self, tokens: int = 1) -> None:
        """One more piece of output streamed: the tokens its delta says it carries."""
        self.output += tokens
        self.queue.charge(self.tenant, 0, tokens)

    def done(self, usage: dict) -> None:
        """The runtime's own counts: charge what the estimates missed (or give back what they overcounted)."""
        prompt = int(usage.get("input_tokens") or self.prompt)
        output = int(usage.get("output_tokens") or self.output)
        self.queue.charge(self.tenant, prompt - self.prompt, output - self.output)
        self.prompt, self.output = prompt, output

    def refund(self) -> None:
        """The job comes back unserved (its worker died before answering): its charge is returned."""
        self.queue.charge(self.tenant, -self.prompt, -self.output)
        self.prompt = self.output = 0


class FairQueue:
    """Per-tenant FIFO lanes; the lowest virtual counter in the highest waiting band goes first."""

    def __init__(self, shares: Callable[[str], Share] = _equal_shares, output_weight: float = 1.0) -> None:
        self.shares = shares  # tenant name -> Share; replaced on reload
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}  # tenant -> weighted tokens served / weight
        self._lanes: dict[str, _Lane] = {}  # backlogged tenants only
        self._floor: dict[int, float] = {}  # band -> counter of the tenant served last in it
        self._served: dict[str, int] = {}  # tenant -> number of its last hand-over (ties go to the longest ago)
        self._handed = 0
        self._len = 0
        self._seq = 0  # arrival numbers; a requeued job takes a number before every other
        self._front_seq = 0

    # -- charging --------------------------------------------------------------------------------------------
    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        cost = prompt_tokens + self.output_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.shares(tenant).weight

    # -- JobQueue --------------------------------------------------------------------------------------------
    def push(self, job: Job) -> None:
        self._seq += 1
        self._lane(job.tenant).jobs.append((self._seq, job))
        self._len += 1

    def push_front(self, job: Job) -> None:
        if job.meter is not None:  # it was charged when handed out; it was not served
            job.meter.refund()
            job.meter = None
        self._front_seq -= 1
        self._lane(job.tenant).jobs.appendleft((self._front_seq, job))
        self._len += 1

    def extend(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            self.push(job)

    def peek(self, eligible: Callable[[str], bool] | None = None) -> Job | None:
        tenant = self._next_tenant(eligible)
        return None if tenant is None else self._lanes[tenant].jobs[0][1]

    def pop(self, eligible: Callable[[str], bool] | None = None) -> Job | None:
        tenant = self._next_tenant(eligible)
        if tenant is None:
            return None
        lane = self._lanes[tenant]
        job = lane.jobs.popleft()[1]
        self._len -= 1
        counter = self.counters.get(tenant, 0.0)
        band = self.shares(tenant).priority
        self._floor[band] = max(self._floor.get(band, counter), counter)
        self._handed += 1
        self._served[tenant] = self._handed
        if not lane.jobs:
            del self._lanes[tenant]
        job.meter = TokenMeter(self, tenant, len(job.frame) // PROMPT_BYTES_PER_TOKEN)
        return job

    def remove(self, job: Job) -> bool:
        lane = self._lanes.get(job.tenant)
        if lane is None:
            return False
        for i, (_, queued) in enumerate(lane.jobs):
            if queued is job:
                del lane.jobs[i]
                self._len -= 1
                if not lane.jobs:
                    del self._lanes[job.tenant]
                return True
        return False

    def take_all(self) -> list[Job]:
        """Every queued job, in the order they were admitted (a requeued one first)."""
        jobs = [job for _, job in sorted((e for lane in self._lanes.values() for e in lane.jobs),
                                         key=lambda e: e[0])]
        self._lanes.clear()
        self._len = 0
        return jobs

    def over_share(self, tenant: str, room: int) -> bool:
        """Whether `tenant` holds its share of `room` queued jobs or more: `room` split by weight
        among the tenants waiting, this one counted as waiting. A full queue still takes a tenant
        under its share (one tenant cannot fill it for the others)."""
        lane = self._lanes.get(tenant)
        held = len(lane.jobs) if lane is not None else 0
        weights = sum(self.shares(t).weight for t in self._lanes if t != tenant) + self.shares(tenant).weight
        return held >= room * self.shares(tenant).weight / weights

    def waiting(self) -> dict[str, int]:
        """Queued jobs per backlogged tenant."""
        return {tenant: len(lane.jobs) for tenant, lane in self._lanes.items()}

    def ahead(self, tenant: str, index: int | None = None) -> int:
        """About how many queued jobs go before the `index`th job of `tenant`'s lane (None: a
        new one, at its end): every job of a higher band, and in its own band, from each other
        lane as many as this lane has before it, one more from a lane that would go first
        (`_next_tenant`'s order now): the discipline's turns as round robin, weights left out.
        An estimate for the predictions and the queue position a waiting stream shows; on
        every admission, so one pass over the lanes with no call (their bands as of the last
        decision: a reload's new priorities count from the next one)."""
        lanes, counters, served = self._lanes, self.counters, self._served
        lane = lanes.get(tenant)
        index = (len(lane.jobs) if lane is not None else 0) if index is None else index
        band = self.shares(tenant).priority
        my_counter = counters.get(tenant, 0.0)
        my_tie = (served.get(tenant, 0), lane.jobs[0][0] if lane is not None else self._seq + 1)
        count = index
        for other, queued in lanes.items():
            priority = queued.band
            if priority < band or other == tenant:
                continue
            n = len(queued.jobs)
            if priority > band or n <= index:
                count += n
                continue
            # one more from a lane whose head would go before this one's (the counter decides
            # but for a tie: no tuple is built for it)
            counter = counters.get(other, 0.0)
            count += index + (counter < my_counter or (
                counter == my_counter and (served.get(other, 0), queued.jobs[0][0]) < my_tie))
        return count

    def position(self, job: Job) -> int | None:
        """`ahead` for a queued job; None when it is not queued here."""
        lane = self._lanes.get(job.tenant)
        for i, (_, queued) in enumerate(lane.jobs if lane is not None else ()):
            if queued is job:
                return self.ahead(job.tenant, i)
        return None

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Job]:
        return (job for lane in list(self._lanes.values()) for _, job in lane.jobs)

    # -- the discipline --------------------------------------------------------------------------------------
    def _lane(self, tenant: str) -> _Lane:
        lane = self._lanes.get(tenant)
        if lane is None:  # the tenant becomes backlogged: lift it, so idleness banks no credit
            band = self.shares(tenant).priority
            waiting = [self.counters.get(t, 0.0) for t in self._lanes if self.shares(t).priority == band]
            floor = min(waiting) if waiting else self._floor.get(band)
            if floor is not None and self.counters.get(tenant, 0.0) < floor:
                self.counters[tenant] = floor
            lane = self._lanes[tenant] = _Lane(band)
        return lane

    def _next_tenant(self, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The tenant whose head job goes next; with `eligible`, among the tenants it accepts only
        (the same rule over fewer lanes: e.g. newcomer slots, which only a tenant with nothing
        running on the model may take)."""
        best, best_key = None, None
        for tenant, lane in self._lanes.items():
            if eligible is not None and not eligible(tenant):
                continue
            lane.band = priority = self.shares(tenant).priority
            key = (-priority, self.counters.get(tenant, 0.0), self._served.get(tenant, 0), lane.jobs[0][0])
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best
