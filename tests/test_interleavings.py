"""The interleaving explorer: the real lifecycle (registry, lifecycle, scheduler, replicas,
admission, tenants) driven concurrently in seeded random orders, with invariants checked
after every history.

Hypothesis's stateful testing draws a history of operations: requests (with and without a
deadline, from a tenant with limits), load, unload, restart, a reload with a changed
config, a worker that crashes, answers, is slow to stop or slow to load, shutdown. Every
operation starts as a task on one event loop, and the loop runs a drawn number of turns
between operations, so the awaits of different operations interleave in drawn orders. At
the end the history is run to quiet (workers answer, everything ends) and checked:

- every job ended exactly once, and every client got exactly one answer;
- every tenant's in-flight count is back to 0 and its token reserve settled;
- no worker runs for an unloaded or failed model, and none was started for a model being
  unloaded or after shutdown began;
- a model's running config is the one it shows;
- no load happened that neither an operator nor load_on_demand asked for.

Workers are in-process fakes (tests/test_state_machines.py) for speed: hundreds of
histories a run. A failure prints hypothesis's shortest history and its seed
(`--hypothesis-seed=N` replays it). INTERLEAVINGS_EXAMPLES=2000 runs a longer soak."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import protocol as p
from protocol import Done
from protocol.errors import PoolError
from supervisor.admission.admit import Admission
from supervisor.config import ModelConfig, PoolConfig, ServerConfig, TenantConfig
from supervisor.engine import ModelRouterEngine
from supervisor.models import reload as reloading
from supervisor.states import ModelState, ReplicaState
from tests.test_model_machine import EngineTransport
from tests.test_state_machines import FakeLauncher

EXAMPLES = int(os.environ.get("INTERLEAVINGS_EXAMPLES", "150"))
MODELS = ("od", "manual")  # loads on demand; loads only when an operator asks
TENANTS = {"k-small": "small", "k-big": "big"}
QUIET_S = 10.0  # a history must run to quiet within this (real) time
UNLOADS = (ModelState.UNLOADING, ModelState.AUTO_UNLOADING)


def model_cfg(name: str, generation: int = 0) -> ModelConfig:
    """`generation`: a reload's change (target_inflight differs, so the model reloads)."""
    return ModelConfig(name=name, backend="synthetic", replicas=2, target_inflight=1 + generation % 2,
                       load_on_demand=name == "od", load_on_start=False, stop_timeout_s=0.05,
                       drain_timeout_s=0.05, request_timeout_s=QUIET_S / 2, load_timeout_s=QUIET_S / 2)


def pool_config(generations: dict[str, int]) -> PoolConfig:
    return PoolConfig(server=ServerConfig(heartbeat_s=0.05, liveness_s=60.0, state_dir="/nonexistent"),
                      tenants=[TenantConfig(name="small", keys=["k-small"], max_inflight=2, tpm=50_000),
                               TenantConfig(name="big", keys=["k-big"])],
                      models=[model_cfg(name, generations[name]) for name in MODELS])


class Lab:
    """The engine on fakes, and the record of a history: who asked what, what happened."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.generations = dict.fromkeys(MODELS, 0)
        self.transport = EngineTransport()
        self.launcher = FakeLauncher()
        self.engine = ModelRouterEngine(pool_config(self.generations), launcher=self.launcher,
                                        transport=self.transport)
        self.admission = Admission(self.engine, self.engine.tenants)
        self.transport.on_send = self._on_send
        self.slow_stop: set[str] = set()  # identities of workers that ignore Shutdown
        self.tasks: list[asyncio.Task] = []
        self.answers: dict[int, list] = {}  # client -> its answers (exactly one each)
        self.ends: dict[str, int] = {}  # job id -> times its on_end ran
        self.held: list = []  # what each admitted request holds of its tenant (admission.Counted)
        self.violations: list[str] = []
        self.shutdown_asked = False
        self._watch_spawns()
        self._watch_loads()

    # -- what the history records ------------------------------------------------------------
    def _watch_spawns(self) -> None:
        launch = self.launcher.__call__

        async def launcher(args, log_path, env):
            name = args[args.index("--replica") + 1].split("/")[0]
            entry = self.engine.models.get(name)
            if self.engine.shutting_down:
                self.violations.append(f"a worker of {name} was started after shutdown began")
            elif entry is not None and entry.state in UNLOADS:
                self.violations.append(f"a worker of {name} was started while it unloaded ({entry.state})")
            return await launch(args, log_path, env)
        self.engine.lifecycle.launcher = launcher

    def _watch_loads(self) -> None:
        """A load on demand (a request's) only for a model whose config asks for it; every
        other load is `Lifecycle.load`: an operator's, a reload's or the start's."""
        on_demand = self.engine.lifecycle.load_on_demand

        def load_on_demand(entry, by):
            if not entry.cfg.load_on_demand:
                self.violations.append(f"model {entry.cfg.name} loaded on demand though its load_on_demand is off")
            if self.engine.shutting_down:
                self.violations.append(f"model {entry.cfg.name} loaded on demand after shutdown began")
            return on_demand(entry, by)
        self.engine.lifecycle.load_on_demand = load_on_demand

    def _on_send(self, identity: str, msg) -> None:
        if isinstance(msg, p.Shutdown) and identity not in self.slow_stop:
            for proc in self.launcher.alive():
                if proc.identity == identity:
                    self.loop.call_soon(proc.exit, 0)

    # -- running the loop ------------------------------------------------------------------------
    def start(self, coro) -> None:
        self.tasks.append(self.loop.create_task(coro))

    def turns(self, count: int) -> None:
        for _ in range(count):
            self.loop.run_until_complete(asyncio.sleep(0))

    def wait(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    # -- the clients and the operator ------------------------------------------------------------
    async def client(self, number: int, model: str, key: str, deadline_ms: str | None) -> None:
        answers = self.answers.setdefault(number, [])
        headers = {"x-slo-ttft-ms": deadline_ms} if deadline_ms else {}
        try:
            tenant = self.admission.tenant([(b"authorization", b"Bearer " + key.encode())])
            job = await self.admission.admit(tenant, model, {"messages": [{"role": "user", "content": "hi"}]},
                                             "chat", headers=headers)
        except PoolError as exc:
            answers.append(exc.code)
            return
        counted = job.on_end
        self.held.append(getattr(counted, "__self__", None))  # admission.Counted: given back once, however it ends

        def on_end(job, outcome) -> None:
            self.ends[job.id] = self.ends.get(job.id, 0) + 1
            counted(job, outcome)
        job.on_end = on_end
        try:
            while True:
                event = await job.next_event(self.engine.cancel)
                if isinstance(event, Done):
                    answers.append("done")
                    return
        except PoolError as exc:
            answers.append(exc.code)

    async def operator(self, name: str, action: str) -> None:
        try:
            if action == "load":
                await self.engine.load(name)
            elif action == "unload":
                await self.engine.unload(name)
            elif action == "restart":
                await self.engine.restart(name)
        except PoolError:
            pass  # refused or failed: the operator is told; the invariants say whether that was right

    async def reload(self, name: str) -> None:
        """A reload that changes `name`'s config (as engine.reload, without the file)."""
        self.generations[name] += 1
        new = pool_config(self.generations)
        change = reloading.diff(self.engine.config, new)
        self.engine.config = new
        self.engine.reloader.apply(change, new)

    # -- workers ---------------------------------------------------------------------------------
    def unready(self) -> list:
        return [proc for proc in self.launcher.alive() if proc.identity in self.transport.handlers
                and any(r.identity == proc.identity and r.state is ReplicaState.STARTING
                        for r in self.replicas())]

    def replicas(self) -> list:
        return [r for e in self.engine.models.values() if e.executor for r in e.executor.replicas]

    def running_jobs(self) -> list:
        return [job for r in self.replicas() for job in r.inflight.values()]

    def answer(self, job) -> None:
        replica = job.run.replica
        if replica is not None and replica.identity in self.transport.handlers:
            self.transport.deliver(replica.identity, p.Done(job=job.id, finish_reason="stop",
                                                            usage={"input_tokens": 3, "output_tokens": 2}))

    def settled(self) -> bool:
        """No action under way on any model (a reload's or a request's load runs on its own)."""
        return all(not e.action.locked() and e.state not in (ModelState.LOADING, *UNLOADS)
                   for e in self.engine.models.values())

    async def run_to_quiet(self) -> None:
        """Workers load, answer and stop (the slow ones too) until every operation has ended."""
        self.slow_stop.clear()
        loop = asyncio.get_running_loop()
        ends = loop.time() + QUIET_S
        while any(not t.done() for t in self.tasks) or not self.settled():
            if loop.time() > ends:
                stuck = [t.get_coro().__qualname__ for t in self.tasks if not t.done()]
                self.violations.append(f"the history did not end within {QUIET_S}s: {stuck}")
                return
            for proc in self.unready():
                self.transport.deliver(proc.identity, p.Ready(capacity=2, info={}))
            for job in self.running_jobs():
                self.answer(job)
            await asyncio.sleep(0.005)



INDEX = st.integers(0, 15)  # a worker or job of those at a step (pick)


def pick(items: list, index: int):
    """One of `items` (never empty) by `index`, a rule's argument drawn from a fixed range
    whether or not anything is alive or running at that step: what is may differ between
    hypothesis's replays of a history (the loop's timing), and a draw that one replay makes
    and another skips, or whose range changed, is refused as inconsistent data."""
    return items[index % len(items)]


class Interleavings(RuleBasedStateMachine):
    """One history per example; the rules are its operations."""

    @initialize()
    def begin(self) -> None:
        self.lab = Lab()
        self.clients = 0

    @rule(model=st.sampled_from(MODELS), key=st.sampled_from(sorted(TENANTS)),
          deadline=st.sampled_from([None, None, "0.001", "50", "60000"]), turns=st.integers(0, 4))
    def request(self, model: str, key: str, deadline: str | None, turns: int) -> None:
        self.clients += 1
        self.lab.start(self.lab.client(self.clients, model, key, deadline))
        self.lab.turns(turns)

    @rule(model=st.sampled_from(MODELS), action=st.sampled_from(["load", "unload", "restart"]),
          turns=st.integers(0, 4))
    def operator(self, model: str, action: str, turns: int) -> None:
        self.lab.start(self.lab.operator(model, action))
        self.lab.turns(turns)

    @precondition(lambda self: not self.lab.shutdown_asked)
    @rule(model=st.sampled_from(MODELS), turns=st.integers(0, 4))
    def reload_changed(self, model: str, turns: int) -> None:
        self.lab.start(self.lab.reload(model))
        self.lab.turns(turns)

    @rule(index=INDEX)
    def worker_ready(self, index: int) -> None:
        unready = self.lab.unready()
        if unready:
            proc = pick(unready, index)
            self.lab.transport.deliver(proc.identity, p.Ready(capacity=2, info={}))

    @rule(index=INDEX)
    def worker_answers(self, index: int) -> None:
        jobs = self.lab.running_jobs()
        if jobs:
            self.lab.answer(pick(jobs, index))

    @rule(index=INDEX)
    def worker_crashes(self, index: int) -> None:
        alive = self.lab.launcher.alive()
        if alive:
            pick(alive, index).exit(-9)

    @rule(index=INDEX)
    def worker_slow_to_stop(self, index: int) -> None:
        alive = self.lab.launcher.alive()
        if alive:
            self.lab.slow_stop.add(pick(alive, index).identity)

    @rule(turns=st.integers(1, 8))
    def turns(self, turns: int) -> None:
        self.lab.turns(turns)

    @rule(seconds=st.sampled_from([0.01, 0.06]))
    def time_passes(self, seconds: float) -> None:
        self.lab.wait(seconds)  # past stop_timeout_s and drain_timeout_s: the slow paths run

    @precondition(lambda self: not self.lab.shutdown_asked)
    @rule()
    def shutdown(self) -> None:
        self.lab.shutdown_asked = True
        self.lab.start(self.lab.engine.shutdown(0))

    @invariant()
    def nothing_wrong_so_far(self) -> None:
        assert not self.lab.violations, self.lab.violations

    def teardown(self) -> None:
        lab = getattr(self, "lab", None)
        if lab is None:
            return
        try:
            lab.loop.run_until_complete(lab.run_to_quiet())
            self.check(lab)
        finally:
            lab.shutdown_asked = True
            lab.loop.run_until_complete(lab.engine.shutdown(0))
            lab.loop.run_until_complete(lab.run_to_quiet())
            leftover = lab.launcher.alive()
            lab.loop.close()
            asyncio.set_event_loop(None)
        assert not leftover, f"workers left running after shutdown: {[p.identity for p in leftover]}"

    def check(self, lab: Lab) -> None:
        assert not lab.violations, lab.violations
        for number in range(1, self.clients + 1):
            assert len(lab.answers.get(number, [])) == 1, f"client {number} got {lab.answers.get(number)}"
        assert all(count == 1 for count in lab.ends.values()), f"a job ended more than once: {lab.ends}"
        for tenant in lab.engine.tenants.by_name.values():
            assert tenant.inflight == 0, f"tenant {tenant.name} still counts {tenant.inflight} in flight"
        assert not [c for c in lab.held if c is not None and c.open], "a token reserve was never settled"
        for entry in lab.engine.models.values():
            name = entry.cfg.name
            if entry.executor is not None:  # what it runs is what it shows (keys applied in place aside)
                shown = entry.cfg.model_dump(exclude=reloading.IN_PLACE_KEYS)
                for runs in (entry.executor.cfg, *(r.cfg for r in entry.executor.replicas)):
                    assert runs.model_dump(exclude=reloading.IN_PLACE_KEYS) == shown, \
                        f"{name} runs a config other than the one it shows"
            if entry.state in (ModelState.UNLOADED, ModelState.FAILED):
                running = [proc.identity for proc in lab.launcher.alive()
                           if proc.identity.startswith(f"{name}/")]
                assert not running, f"{name} is {entry.state} with workers alive: {running}"
            if not lab.shutdown_asked:
                assert entry.cfg == model_cfg(name, lab.generations[name]) and getattr(entry, "next_cfg", None) is None, \
                    f"{name} shows a config that is not the last reload's"


Interleavings.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=25, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestInterleavings = pytest.mark.timeout(600)(Interleavings.TestCase)
