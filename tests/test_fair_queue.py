"""The fair queue's discipline (VTC), as pure property tests: a simulated
model with K slots driven by an injected clock (ticks), no processes.

Each tick: queued jobs fill the free slots in the queue's order, then every
running job produces one output token (one delta), and a job with all its
tokens ends with the runtime's usage. Service is counted here, independently
of the queue's counters: a job's prompt when it is handed out, each output
token as it streams (weighted as the queue weighs them)."""

from __future__ import annotations

from collections import defaultdict, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import Delta, Done
from supervisor.scheduling.fair_queue import FairQueue, Share
from supervisor.scheduling.jobs import Job


def make_job(tenant: str, prompt_chars: int = 0) -> Job:
    return Job("m", {"prompt": "x" * prompt_chars}, 60, tenant=tenant)


class Sim:
    """A model with `slots` slots serving `queue`; time advances one tick per `step`."""

    def __init__(self, queue: FairQueue, slots: int) -> None:
        self.queue, self.slots = queue, slots
        self.running: list[list] = []  # [job, output tokens left]
        self.served: dict[str, float] = defaultdict(float)  # weighted tokens / weight
        self.tokens: dict[str, float] = defaultdict(float)  # weighted tokens
        self.order: list[Job] = []  # jobs in the order they were handed out
        self.max_cost = 0.0  # the largest single job's weighted cost (the bound's U)

    def weight(self, tenant: str) -> float:
        return self.queue.shares(tenant).weight

    def step(self, outputs: dict[Job, int]) -> None:
        while len(self.running) < self.slots and self.queue:
            job = self.queue.pop()
            assert job is not None  # work-conserving: a queued job and a free slot always meet
            out = outputs[job]
            self.order.append(job)
            self.max_cost = max(self.max_cost, job.meter.prompt + self.queue.output_weight * out)
            self._serve(job.tenant, job.meter.prompt)
            self.running.append([job, out])
        for entry in self.running:
            job = entry[0]
            job.push(Delta(job=job.id, text="t"))
            self._serve(job.tenant, self.queue.output_weight)
            entry[1] -= 1
            if entry[1] == 0:
                job.finish(Done(job=job.id, finish_reason="stop",
                                usage={"input_tokens": job.meter.prompt, "output_tokens": job.meter.output}))
        self.running = [e for e in self.running if e[1] > 0]

    def _serve(self, tenant: str, cost: float) -> None:
        self.tokens[tenant] += cost
        self.served[tenant] += cost / self.weight(tenant)


def shares_of(table: dict[str, Share]):
    return lambda tenant: table.get(tenant, Share())


# -- order ----------------------------------------------------------------------------------------------------
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), min_size=1, max_size=60))
def test_fifo_within_each_tenant_whatever_the_interleaving(ops):
    """Pushes from three tenants, with a pop after some: each tenant's jobs leave in the order they came."""
    queue = FairQueue(shares_of({"a": Share(2.0), "c": Share(0.5)}))
    pushed, popped = defaultdict(list), defaultdict(list)
    for tenant, pop_after in ops:
        job = make_job(tenant, 10)
        queue.push(job)
        pushed[tenant].append(job)
        if pop_after:
            job = queue.pop()
            popped[job.tenant].append(job)
    while queue:
        peeked = queue.peek()
        job = queue.pop()
        assert job is peeked  # peek says what pop returns
        popped[job.tenant].append(job)
    assert dict(popped) == dict(pushed)
    assert queue.pop() is None and queue.peek() is None and len(queue) == 0


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 40)), min_size=1, max_size=40),
       st.sets(st.sampled_from("abcd")), st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 30))))
def test_a_filtered_pop_is_the_same_rule_over_the_eligible_tenants_only(pushes, eligible, charges):
    """pop(eligible) (newcomer slots: tenants with nothing running) chooses as a queue holding
    only the eligible tenants' jobs would, with the same counters; the others' jobs stay, in order."""
    shares = shares_of({"a": Share(2.0), "b": Share(1.0, priority=1), "d": Share(0.5)})
    whole, only = FairQueue(shares, output_weight=2.0), FairQueue(shares, output_weight=2.0)
    jobs = [make_job(tenant, chars) for tenant, chars in pushes]
    for job in jobs:
        whole.push(job)
        only.push(job)
    for job in jobs:
        if job.tenant not in eligible:
            only.remove(job)
    for i, (tenant, tokens) in enumerate(charges):  # service of running jobs, between hand-overs
        whole.charge(tenant, tokens, i % 3)
        only.charge(tenant, tokens, i % 3)
    left_out = [job for job in jobs if job.tenant not in eligible]
    while True:
        expected = only.pop()
        assert whole.peek(eligible.__contains__) is expected
        assert whole.pop(eligible.__contains__) is expected
        if expected is None:
            break
        assert whole.counters == only.counters
    assert len(whole) == len(left_out)
    assert whole.take_all() == left_out  # untouched, in admission order


@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.data())
def test_one_tenant_is_plain_fifo_with_requeue_at_the_head(sizes, data):
    fair, fifo = FairQueue(), deque()  # the deque: what plain FIFO with requeue at the head is
    jobs = [make_job("default", n) for n in sizes]
    for job in jobs:
        fair.push(job)
        fifo.append(job)
    while fifo:
        assert fair.peek() is fifo[0]
        job = fair.pop()
        assert job is fifo.popleft()
        if data.draw(st.booleans()):  # its worker died before answering: back to the head
            fair.push_front(job)
            fifo.appendleft(job)
    assert not fair


def test_requeue_returns_the_charge_and_keeps_the_tenants_head():
    queue = FairQueue()
    first, second = make_job("a", 400), make_job("a", 0)
    queue.push(first)
    queue.push(second)
    job = queue.pop()
    charged = queue.counters["a"]
    assert job is first and charged >= 100  # its prompt, estimated from its size, charged on hand-over
    queue.push_front(job)
    assert queue.counters["a"] == 0 and job.meter is None
    assert queue.pop() is first and queue.pop() is second


def test_remove_and_take_all_keep_admission_order():
    queue = FairQueue()
    jobs = [make_job(t) for t in "abab"]
    for job in jobs:
        queue.push(job)
    assert queue.remove(jobs[1]) and not queue.remove(jobs[1])
    assert len(queue) == 3 and queue.waiting() == {"a": 2, "b": 1}
    assert list(queue.take_all()) == [jobs[0], jobs[2], jobs[3]]
    assert len(queue) == 0 and queue.waiting() == {}


# -- the VTC bound ----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 4), out_weight=st.sampled_from([1.0, 2.0]),
       weights=st.tuples(st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 0.5])),
       pattern=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 200), st.integers(1, 12)),
                        min_size=30, max_size=120))
def test_service_difference_of_two_backlogged_tenants_stays_within_the_bound(slots, out_weight, weights, pattern):
    """Whenever both tenants are backlogged over a window, the weighted service
    each got in it differs by at most 2 * slots * U / min weight, where U is the
    largest job's weighted cost: a tenant is chosen only while its counter is
    the lower one, and after that at most `slots` of its jobs go on charging it."""
    table = {"a": Share(weights[0]), "b": Share(weights[1])}
    queue = FairQueue(shares_of(table), output_weight=out_weight)
    sim, outputs = Sim(queue, slots), {}
    diffs: list[float | None] = []  # served difference at each tick where both were backlogged, None else
    for new_a, new_b, prompt_chars, out in pattern:
        for tenant, count in (("a", new_a), ("b", new_b)):
            for _ in range(count):
                job = make_job(tenant, prompt_chars)
                outputs[job] = out
                queue.push(job)
        sim.step(outputs)
        both = queue.waiting().keys() >= {"a", "b"}
        diffs.append(sim.served["a"] - sim.served["b"] if both else None)
    bound = 2 * slots * sim.max_cost / min(weights)
    # within each run of backlogged ticks, the change of the difference over any window is max - min
    run: list[float] = []
    for d in diffs + [None]:
        if d is None:
            if run:
                assert max(run) - min(run) <= bound, (run, bound)
            run = []
        else:
            run.append(d)


def flood(queue: FairQueue, tenant: str, count: int, outputs: dict, prompt_chars: int = 40, out: int = 8) -> None:
    for _ in range(count):
        job = make_job(tenant, prompt_chars)
        outputs[job] = out
        queue.push(job)


def test_weights_three_to_one_get_three_to_one_of_the_tokens():
    queue = FairQueue(shares_of({"a": Share(3.0), "b": Share(1.0)}), output_weight=2.0)
    sim, outputs = Sim(queue, slots=4), {}
    flood(queue, "a", 400, outputs)
    flood(queue, "b", 400, outputs)
    for _ in range(300):
        sim.step(outputs)
    assert queue.waiting().keys() == {"a", "b"}  # both stayed backlogged throughout
    ratio = sim.tokens["a"] / sim.tokens["b"]
    assert 2.7 <= ratio <= 3.3, ratio


def test_a_newly_active_tenant_is_served_at_once_and_starves_nobody():
    """b floods alone for a long time; then a arrives, then floods too. a starts
    at b's counter: it is served within the next two hand-overs (no wait behind
    b's backlog), yet with no banked credit: from then on they alternate."""
    queue = FairQueue()
    sim, outputs = Sim(queue, slots=2), {}
    flood(queue, "b", 300, outputs, prompt_chars=0, out=4)
    for _ in range(100):
        sim.step(outputs)
    handed_before = len(sim.order)
    flood(queue, "a", 100, outputs, prompt_chars=0, out=4)
    for _ in range(60):
        sim.step(outputs)
    after = sim.order[handed_before:]
    assert after[0].tenant == "a"  # the next free slot: lifted to b's counter, and b was served last
    share_a = sum(j.tenant == "a" for j in after) / len(after)
    assert 0.4 <= share_a <= 0.6, share_a  # neither starved nor starving: idleness banked no credit


def test_a_tenant_back_from_idle_has_no_banked_credit():
    """a is served, goes idle while b is served a lot, then comes back: it is
    lifted to b's counter, so it does not get a run of its own to catch up."""
    queue = FairQueue()
    sim, outputs = Sim(queue, slots=1), {}
    flood(queue, "a", 5, outputs, prompt_chars=0, out=2)
    for _ in range(12):
        sim.step(outputs)
    flood(queue, "b", 200, outputs, prompt_chars=0, out=2)
    for _ in range(100):
        sim.step(outputs)
    start = len(sim.order)
    flood(queue, "a", 50, outputs, prompt_chars=0, out=2)
    for _ in range(40):
        sim.step(outputs)
    tenants = [j.tenant for j in sim.order[start:]]
    longest_a_run = max(len(r) for r in "".join(tenants).split("b"))
    assert longest_a_run <= 2, tenants


def test_a_higher_priority_band_goes_first_while_it_waits():
    queue = FairQueue(shares_of({"hi": Share(priority=1), "lo": Share(priority=0)}))
    sim, outputs = Sim(queue, slots=1), {}
    flood(queue, "lo", 20, outputs, out=1)
    flood(queue, "hi", 5, outputs, out=1)
    for _ in range(10):
        sim.step(outputs)
    assert [j.tenant for j in sim.order] == ["hi"] * 5 + ["lo"] * 5  # hi's counter grows, it still goes first
    flood(queue, "hi", 1, outputs, out=1)
    sim.step(outputs)
    assert sim.order[-1].tenant == "hi"


def handed_out() -> tuple[FairQueue, Job, float]:
    """Tenant a's one job, handed out (output weighs 2): the queue, the job, a's counter then."""
    queue = FairQueue(output_weight=2.0)
    job = make_job("a", 0)
    queue.push(job)
    queue.pop()
    return queue, job, queue.counters["a"]


def test_tokens_are_charged_as_they_stream_not_at_the_end():
    queue, job, start = handed_out()
    for _ in range(3):
        job.push(Delta(job=job.id, text="t"))
    assert queue.counters["a"] == start + 6
    job.finish(Done(job=job.id, finish_reason="stop", usage={"input_tokens": job.meter.prompt, "output_tokens": 5}))
    assert queue.counters["a"] == start + 10  # the runtime's count sets the estimate right


def test_a_delta_that_joins_several_tokens_is_charged_all_of_them():
    queue, job, start = handed_out()
    job.push(Delta(job=job.id, text="three tokens", tokens=3))
    job.push(Delta(job=job.id, text="", tokens=0))
    assert queue.counters["a"] == start + 6


def test_a_reload_that_changes_a_weight_applies_to_the_next_charge():
    table = {"a": Share(1.0)}
    queue = FairQueue(shares_of(table), output_weight=1.0)
    job = make_job("a", 0)
    queue.push(job)
    queue.pop()
    before = queue.counters["a"]
    job.push(Delta(job=job.id, text="t"))
    table["a"] = Share(4.0)
    job.push(Delta(job=job.id, text="t"))
    assert queue.counters["a"] == before + 1 + 0.25
