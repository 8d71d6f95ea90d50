"""The model state machine (supervisor/states.py MODEL_TRANSITIONS), edge by
edge, through the real engine and its owners (supervisor/models/) with the
launcher and the transport injected: no processes, no sockets. Each scenario
runs on a fresh event loop; waits are bounded by `settle`.

`test_every_edge_is_walked_and_every_other_refused` drives each allowed edge
by its real cause and proves each disallowed one raises."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import protocol as p
from protocol.errors import ErrorCode, PoolError, WorkerExit
from supervisor.config import ModelConfig, PoolConfig, ServerConfig
from supervisor.engine import ModelRouterEngine
from supervisor.scheduling.jobs import Job, JobState
from supervisor.models import reload as reloading
from supervisor.models.registry import ActionLock, ModelEntry
from supervisor.scheduling.executor import Executor
from supervisor.states import HAS_EXECUTOR, MODEL_TRANSITIONS, IllegalTransition, ModelState
from tests.test_state_machines import FakeLauncher, FakeTransport, outcome, scenario, settle

S = ModelState


class EngineTransport(FakeTransport):
    async def close(self) -> None:
        pass


class Machine:
    """An engine wired to fakes. Workers exit on Shutdown; `ready` answers a
    replica's start; every model transition is recorded in `edges`."""

    def __init__(self, *models: ModelConfig, **server) -> None:
        self.transport = EngineTransport()
        self.launcher = FakeLauncher()
        self.transport.on_send = self._on_send
        self.config = PoolConfig(server=ServerConfig(heartbeat_s=0.05, liveness_s=5.0, state_dir="/nonexistent",
                                                     **server), models=list(models))
        self.engine = ModelRouterEngine(self.config, launcher=self.launcher, transport=self.transport)
        self.edges: list[tuple[ModelState, ModelState, str]] = []

    def _on_send(self, identity, msg) -> None:
        if isinstance(msg, p.Shutdown):
            for proc in self.launcher.alive():
                if proc.identity == identity:
                    asyncio.get_running_loop().call_soon(proc.exit, 0)

    def entry(self, name: str) -> ModelEntry:
        return self.engine.models[name]

    def state(self, name: str) -> ModelState:
        return self.entry(name).state

    def procs(self, name: str, index: int = 0) -> list:
        return [proc for proc in self.launcher.procs if proc.identity.startswith(f"{name}/{index}#")]

    async def spawned(self, name: str, index: int = 0, count: int = 1):
        await settle(lambda: len(self.procs(name, index)) >= count, f"{name}/{index} spawn {count}")
        return self.procs(name, index)[count - 1]

    async def ready(self, name: str, index: int = 0, count: int = 1, capacity: int = 1):
        proc = await self.spawned(name, index, count)
        await settle(lambda: proc.identity in self.transport.handlers, f"{proc.identity} registered")
        self.transport.deliver(proc.identity, p.Ready(capacity=capacity, info={}))
        return proc

    async def loaded(self, name: str) -> None:
        """Load `name` (all its replicas answer ready)."""
        counts = [len(self.procs(name, i)) + 1 for i in range(self.entry(name).cfg.replicas)]
        load = asyncio.create_task(self.engine.load(name))
        for i, count in enumerate(counts):
            await self.ready(name, i, count=count)
        await load
        assert self.state(name) is S.LOADED

    def submit(self, name: str) -> Job:
        """A job made and queued as admission does it, without a tenant's limits."""
        entry = self.engine.entry(name)
        job = self.engine.make_job(entry, {"messages": [{"role": "user", "content": "hi"}]}, "chat")
        self.engine.enqueue(entry, job)
        return job

    def done(self, job: Job) -> None:
        self.transport.deliver(job.run.replica.identity, p.Done(job=job.id, finish_reason="stop"))

    async def reload_to(self, *models: ModelConfig) -> dict:
        """engine.reload, without the file: the same diff and apply."""
        new = PoolConfig(server=self.config.server, models=list(models))
        change = reloading.diff(self.engine.config, new)
        self.engine.config = new
        self.engine.reloader.apply(change, new)
        return change.summary()

    async def close(self) -> None:
        await self.engine.shutdown(0)
        assert not self.launcher.alive(), "a fake worker was left running"


@contextlib.contextmanager
def recorded(machine: Machine):
    """Every ModelEntry.set_state while inside, as (from, to, model)."""
    original = ModelEntry.set_state

    def set_state(entry: ModelEntry, new: ModelState) -> None:
        before = entry.state
        original(entry, new)
        if new is not before:
            machine.edges.append((before, new, entry.cfg.name))
    ModelEntry.set_state = set_state
    try:
        yield machine.edges
    finally:
        ModelEntry.set_state = original


def idle_now(m: Machine, name: str = "m") -> None:
    """A heartbeat tick after the model's idle_unload_s (its last use moved back:
    the tick's clock also checks the workers' liveness, which must hold)."""
    m.entry(name).last_used -= m.entry(name).cfg.idle_unload_s + 1
    m.engine.tick(time.monotonic())


def model(name: str = "m", **kw) -> ModelConfig:
    return ModelConfig(name=name, backend="synthetic", **kw)


def took(machine: Machine, a: ModelState, b: ModelState, name: str = "m") -> bool:
    return (a, b, name) in machine.edges


# -- the scenarios the issue names ---------------------------------------------------------------

async def crash_during_a_load_on_demand(m: Machine) -> None:
    """LOADING -> FAILED: the worker dies before it is ready; every waiter gets the
    load's error; the next request loads again (FAILED -> LOADING)."""
    jobs = [m.submit("m") for _ in range(2)]
    assert m.state("m") is S.LOADING and m.entry("m").executor.queue_depth == 2
    proc = await m.spawned("m")
    proc.exit(WorkerExit.BOOT_FAILURE)
    await settle(lambda: m.state("m") is S.FAILED, "failed")
    for job in jobs:
        error = outcome(job)
        assert isinstance(error, PoolError) and error.code is ErrorCode.LOAD_FAILED
    assert m.entry("m").executor is None and not m.engine.memory.holds(m.entry("m"))
    again = m.submit("m")  # tries again
    assert m.state("m") is S.LOADING
    await m.ready("m", count=2)
    await settle(lambda: m.state("m") is S.LOADED, "loaded")
    await settle(lambda: again.state is JobState.SUBMITTED, "dispatched")
    m.done(again)
    assert outcome(again).finish_reason == "stop"


@scenario
async def test_a_crash_during_a_load_on_demand_fails_its_waiters_and_the_next_request_loads_again():
    m = Machine(model())
    with recorded(m):
        await crash_during_a_load_on_demand(m)
    assert took(m, S.LOADING, S.FAILED) and took(m, S.FAILED, S.LOADING) and took(m, S.LOADING, S.LOADED)
    await m.close()


async def eviction_chosen_while_its_victim_loads(m: Machine) -> None:
    """Budget for one: `a` is loading (replica not ready yet) when `b` needs room.
    A loading model is never a victim: `b` waits for memory, and once `a` is loaded
    and idle, `a` is evicted (LOADED -> AUTO_UNLOADING -> UNLOADED) and `b` loads."""
    load_a = asyncio.create_task(m.engine.load("a"))
    await m.spawned("a")
    assert m.state("a") is S.LOADING and m.engine.memory.holds(m.entry("a"))
    job_b = m.submit("b")
    assert m.state("b") is S.LOADING
    # b's gate looks, finds nothing it may evict (a loading model is no victim), and waits
    await settle(lambda: job_b.routing.queue_reason is not None, "b waits for memory")
    assert job_b.routing.queue_reason.code is ErrorCode.INSUFFICIENT_MEMORY
    assert m.state("a") is S.LOADING and not m.engine.memory.holds(m.entry("b"))
    await m.ready("a")
    await load_a
    await settle(lambda: m.state("a") is S.UNLOADED, "a evicted")
    await m.ready("b")
    await settle(lambda: m.state("b") is S.LOADED, "b loaded")
    assert m.engine.evictions == 1 and m.engine.swaps == 1
    await settle(lambda: job_b.state is JobState.SUBMITTED, "b's job dispatched")
    m.done(job_b)
    assert outcome(job_b).finish_reason == "stop"


@scenario
async def test_an_eviction_chosen_while_its_victim_loads_waits_for_the_load():
    m = Machine(model("a", memory_mb=100), model("b", memory_mb=100), memory_budget_mb=150)
    with recorded(m):
        await eviction_chosen_while_its_victim_loads(m)
    assert took(m, S.LOADED, S.AUTO_UNLOADING, "a") and took(m, S.AUTO_UNLOADING, S.UNLOADED, "a")
    await m.close()


@scenario
async def test_an_evicted_model_keeps_its_queued_requests_for_its_next_load():
    """A busy model made to yield (max_swap_wait_s = 0): its running job finishes, its
    queued one waits through the unload and starts the next load."""
    m = Machine(model("a", memory_mb=100), model("b", memory_mb=100), memory_budget_mb=150, max_swap_wait_s=0)
    await m.loaded("a")
    running, queued = m.submit("a"), m.submit("a")
    assert running.state is JobState.SUBMITTED and queued.state is JobState.QUEUED
    with recorded(m):
        job_b = m.submit("b")
        await settle(lambda: m.state("a") is S.AUTO_UNLOADING, "a yields")
        assert m.entry("a").waiting == [queued]
        late = m.submit("a")  # comes during the unload: waits too
        m.done(running)  # never cut
        assert outcome(running).finish_reason == "stop"
        await m.ready("b")
        await settle(lambda: m.state("b") is S.LOADED, "b loaded")
        await settle(lambda: m.state("a") is S.LOADING, "a loads again for its waiters")
        assert [j.state for j in (queued, late)] == [JobState.QUEUED, JobState.QUEUED]
    assert took(m, S.AUTO_UNLOADING, S.UNLOADED, "a") and took(m, S.UNLOADED, S.LOADING, "a")
    m.done(job_b)
    await m.close()
    for job in (queued, late):  # the shutdown answers them
        assert outcome(job).code is ErrorCode.MODEL_UNLOADING


async def reload_removes_a_loading_model(m: Machine) -> None:
    job = m.submit("m")
    assert m.state("m") is S.LOADING
    await m.spawned("m")
    summary = await m.reload_to(model("other"))
    assert summary["removed"] == ["m"]
    with pytest.raises(PoolError) as gone:
        m.submit("m")
    assert gone.value.code is ErrorCode.MODEL_NOT_FOUND  # 404 at once
    assert m.state("m") is S.UNLOADING  # intake stopped at once
    await m.ready("m")  # the load ends; the unload drains and stops
    await settle(lambda: job.state is JobState.FINISHED, "the waiter answered")
    assert outcome(job).code is ErrorCode.MODEL_UNLOADING
    await settle(lambda: "m" not in m.engine.models, "m forgotten")
    assert all(proc.returncode is not None for proc in m.procs("m"))


@scenario
async def test_a_reload_that_removes_a_loading_model_answers_its_waiters_503_and_forgets_it():
    m = Machine(model())
    with recorded(m):
        await reload_removes_a_loading_model(m)
    assert took(m, S.LOADING, S.UNLOADING) and took(m, S.UNLOADING, S.UNLOADED)
    await m.close()


@scenario
async def test_a_reload_that_removes_a_model_with_queued_and_running_requests():
    m = Machine(model())
    await m.loaded("m")
    running, queued = m.submit("m"), m.submit("m")
    assert queued.state is JobState.QUEUED
    await m.reload_to()
    await settle(lambda: queued.state is JobState.FINISHED, "the queued job answered")
    assert outcome(queued).code is ErrorCode.MODEL_UNLOADING and m.state("m") is S.UNLOADING
    assert m.engine.model_list() == []  # gone from /v1/models at once
    m.done(running)  # a running one finishes
    assert outcome(running).finish_reason == "stop"
    await settle(lambda: "m" not in m.engine.models, "m forgotten")
    await m.close()


@scenario
async def test_a_reload_that_removes_a_model_while_its_requests_wait_through_an_idle_unload():
    m = Machine(model(idle_unload_s=1))
    await m.loaded("m")
    running = m.submit("m")
    m.done(running)
    idle_now(m)
    assert m.state("m") is S.AUTO_UNLOADING
    waiter = m.submit("m")
    await m.reload_to(model("other"))
    await settle(lambda: waiter.state is JobState.FINISHED, "the waiter answered")
    assert outcome(waiter).code is ErrorCode.MODEL_UNLOADING and "removed from the config" in outcome(waiter).message
    await settle(lambda: "m" not in m.engine.models, "m forgotten")
    assert m.procs("m", 0)[-1].returncode is not None
    await m.close()


@scenario
async def test_a_request_admitted_before_a_reload_removed_its_unloaded_model_loads_nothing():
    """Issue 53, finding 7: admission looks the model up, awaits (the prompt's token ids), and a
    reload removes the model meanwhile; the resumed enqueue is refused (404 model_not_found) and
    starts no load of the forgotten entry, which nothing would list, idle out or stop."""
    m = Machine(model(), model("other"))
    entry = m.engine.entry("m")  # looked up before the await
    job = m.engine.make_job(entry, {"messages": [{"role": "user", "content": "hi"}]}, "chat")
    await m.reload_to(model("other"))
    with pytest.raises(PoolError) as gone:
        m.engine.enqueue(entry, job)
    assert gone.value.code is ErrorCode.MODEL_NOT_FOUND and "removed by a reload" in gone.value.message
    assert entry.state is S.UNLOADED and not m.procs("m")
    await m.close()


async def unload_racing_an_idle_unload(m: Machine) -> None:
    await m.loaded("m")
    idle_now(m)  # idle: the automatic unload starts
    assert m.state("m") is S.AUTO_UNLOADING
    waiter = m.submit("m")  # would wait for the next load...
    unload = asyncio.create_task(m.engine.unload("m"))
    await asyncio.sleep(0)
    assert m.state("m") is S.UNLOADING  # ...but the operator's unload overrides it
    assert outcome(waiter).code is ErrorCode.MODEL_UNLOADING
    entry = await unload
    # a load for waiters would have started in the idle unload's last step, before this one ran
    assert entry.state is S.UNLOADED and entry.executor is None and not entry.waiting
    assert len(m.launcher.procs) == 1


@scenario
async def test_an_unload_racing_an_idle_unload_ends_unloaded_without_a_reload():
    m = Machine(model(idle_unload_s=1))
    with recorded(m):
        await unload_racing_an_idle_unload(m)
    assert took(m, S.AUTO_UNLOADING, S.UNLOADING) and took(m, S.UNLOADING, S.UNLOADED)
    await m.close()


@scenario
async def test_an_idle_unload_and_a_second_tick_start_one_unload():
    m = Machine(model(idle_unload_s=1))
    await m.loaded("m")
    idle_now(m)
    m.engine.tick(time.monotonic())  # the unload holds the model's action lock: nothing more starts
    await settle(lambda: m.state("m") is S.UNLOADED, "unloaded")
    assert len(m.launcher.procs) == 1
    await m.close()


# -- replicas decide between LOADED, DEGRADED and DOWN ---------------------------------------------

async def degrade_and_recover(m: Machine) -> None:
    await m.loaded("m")
    m.procs("m", 1)[-1].exit(-9)  # a crash: restarted at once
    await settle(lambda: m.state("m") is S.DEGRADED, "degraded")
    assert m.engine.model_view(m.entry("m"))["state"] == "degraded"
    assert m.engine.ready()  # one replica serves: the pool is ready
    await m.ready("m", 1, count=2)
    await settle(lambda: m.state("m") is S.LOADED, "loaded again")


@scenario
async def test_a_crashed_replica_degrades_the_model_until_it_is_ready_again():
    m = Machine(model(replicas=2, load_on_start=True))
    with recorded(m):
        await degrade_and_recover(m)
    assert took(m, S.LOADED, S.DEGRADED) and took(m, S.DEGRADED, S.LOADED)
    await m.close()


async def down_and_restart(m: Machine, replicas: int) -> None:
    await m.loaded("m")
    for i in range(replicas):
        m.procs("m", i)[-1].exit(WorkerExit.BOOT_FAILURE)  # fatal at once: no restart
    await settle(lambda: m.state("m") is S.DOWN, "down")
    view = m.engine.model_view(m.entry("m"))
    assert view["state"] == "failed" and "no replica is running" in view["error"]
    with pytest.raises(PoolError) as refused:
        m.submit("m")
    assert refused.value.code is ErrorCode.NO_HEALTHY_REPLICA
    restart = asyncio.create_task(m.engine.restart("m"))
    for i in range(replicas):
        await m.ready("m", i, count=2)
    await restart
    assert m.state("m") is S.LOADED


@scenario
async def test_every_replica_fatal_is_down_shown_failed_and_a_restart_brings_it_back():
    m = Machine(model())
    with recorded(m):
        await down_and_restart(m, 1)
    assert took(m, S.LOADED, S.DOWN) and took(m, S.DOWN, S.DEGRADED) and took(m, S.DEGRADED, S.LOADED)
    await m.close()


@scenario
async def test_the_replica_choice_forgets_a_worker_that_crashed_or_was_replaced():
    m = Machine(model(replicas=2))
    await m.loaded("m")
    executor = m.entry("m").executor
    forgotten = []
    executor.choice.forget = forgotten.append
    m.procs("m", 0)[-1].exit(-9)
    await settle(lambda: forgotten, "forgotten")
    assert [r.index for r in forgotten] == [0]
    await m.ready("m", 0, count=2)
    await settle(lambda: m.state("m") is S.LOADED, "loaded")
    assert len(forgotten) == 1  # its new worker is new to the choice: nothing more to forget
    await m.close()


# -- load, unload, the memory gate ---------------------------------------------------------------------

async def memory_gate_gives_up(m: Machine) -> None:
    await m.loaded("pin")
    job = m.submit("big")
    await settle(lambda: job.state is JobState.FINISHED, "the wait ends", timeout=3)
    assert outcome(job).code is ErrorCode.INSUFFICIENT_MEMORY and "pin (150 MB)" in outcome(job).message
    await settle(lambda: m.state("big") is S.UNLOADED, "given up")
    assert "needs 100 MB" in m.entry("big").error and m.state("pin") is S.LOADED


@scenario
async def test_a_load_that_cannot_get_memory_gives_up_unloaded_with_the_reason():
    m = Machine(model("pin", memory_mb=150, pinned=True), model("big", memory_mb=100, queue_timeout_s=0.3),
                memory_budget_mb=200)
    with recorded(m):
        await memory_gate_gives_up(m)
    assert took(m, S.LOADING, S.UNLOADED, "big")
    await m.close()


async def unload_during_a_load(m: Machine) -> None:
    load = asyncio.create_task(m.engine.load("m"))
    await m.spawned("m")
    job = m.submit("m")
    unload = asyncio.create_task(m.engine.unload("m"))
    await asyncio.sleep(0)
    assert m.state("m") is S.UNLOADING  # intake stops at once
    with pytest.raises(PoolError) as refused:
        m.submit("m")
    assert refused.value.code is ErrorCode.MODEL_UNLOADING
    with pytest.raises(PoolError) as overridden:  # the unload wins: the worker loading is stopped
        await load
    assert overridden.value.code is ErrorCode.MODEL_UNLOADING
    assert (await unload).state is S.UNLOADED
    assert outcome(job).code is ErrorCode.MODEL_UNLOADING and not m.launcher.alive()
    assert len(m.launcher.procs) == 1 and m.entry("m").error is None  # nothing started after; not a failure


@scenario
async def test_an_unload_during_a_load_wins_the_loading_worker_is_stopped():
    m = Machine(model())
    with recorded(m):
        await unload_during_a_load(m)
    assert took(m, S.LOADING, S.UNLOADING)
    await m.close()


async def unload_a_failed_model(m: Machine) -> None:
    load = asyncio.create_task(m.engine.load("m"))
    (await m.spawned("m")).exit(WorkerExit.BOOT_FAILURE)
    with pytest.raises(PoolError) as failed:
        await load
    assert failed.value.code is ErrorCode.LOAD_FAILED and m.state("m") is S.FAILED
    entry = await m.engine.unload("m")
    assert entry.state is S.UNLOADED and entry.error  # the reason stays readable


@scenario
async def test_unloading_a_failed_model_clears_it():
    m = Machine(model())
    with recorded(m):
        await unload_a_failed_model(m)
    assert took(m, S.FAILED, S.UNLOADED)
    await m.close()


@scenario
async def test_a_reload_change_of_a_failed_model_clears_it_and_loads_the_new_config():
    m = Machine(model(load_on_start=True))
    load = asyncio.create_task(m.engine.load("m"))
    (await m.spawned("m")).exit(WorkerExit.BOOT_FAILURE)
    with pytest.raises(PoolError):
        await load
    with recorded(m):
        summary = await m.reload_to(model(load_on_start=True, target_inflight=2))
        assert summary["reloaded"] == ["m"]
        await m.ready("m", count=2, capacity=2)
        await settle(lambda: m.state("m") is S.LOADED, "loaded with its new config")
    assert took(m, S.FAILED, S.UNLOADED) and m.entry("m").cfg.target_inflight == 2
    await m.close()


@scenario
async def test_a_restart_during_a_load_is_refused_and_two_restarts_run_one():
    m = Machine(model())
    load = asyncio.create_task(m.engine.load("m"))
    await m.spawned("m")
    with pytest.raises(PoolError) as busy:
        await m.engine.restart("m")
    assert busy.value.code is ErrorCode.MODEL_BUSY and "loading" in busy.value.message
    await m.ready("m")
    await load
    first = asyncio.create_task(m.engine.restart("m"))
    await asyncio.sleep(0)
    with pytest.raises(PoolError) as busy:
        await m.engine.restart("m")
    assert busy.value.code is ErrorCode.MODEL_BUSY
    await m.ready("m", count=2)
    await first
    assert m.state("m") is S.LOADED and len(m.launcher.alive()) == 1
    await m.close()


@scenario
async def test_shutdown_drains_every_model_through_the_machine():
    m = Machine(model("a"), model("b"))
    await m.loaded("a")
    load_b = asyncio.create_task(m.engine.load("b"))
    await m.spawned("b")
    job = m.submit("a")
    with recorded(m):
        drain = asyncio.create_task(m.engine.drain_all(5))
        await asyncio.sleep(0)
        assert m.state("a") is S.UNLOADING and m.state("b") is S.UNLOADING and not m.engine.ready()
        m.done(job)
        await drain
        await m.engine.shutdown(0)
    assert outcome(job).finish_reason == "stop"
    with pytest.raises(PoolError) as cut:  # its starting replica was stopped
        await load_b
    assert cut.value.code in (ErrorCode.LOAD_FAILED, ErrorCode.MODEL_UNLOADING)
    assert m.state("a") is S.UNLOADED and m.state("b") is S.UNLOADED and not m.launcher.alive()


# -- the table itself ------------------------------------------------------------------------------

async def _load(m: Machine) -> None:
    await m.loaded("m")


async def _degraded(m: Machine) -> None:
    await m.loaded("m")
    m.procs("m", 1)[-1].exit(-9)
    await settle(lambda: m.state("m") is S.DEGRADED, "degraded")


async def _down(m: Machine) -> None:
    await m.loaded("m")
    m.procs("m", 0)[-1].exit(WorkerExit.BOOT_FAILURE)
    await settle(lambda: m.state("m") is S.DOWN, "down")


async def _degraded_to_down(m: Machine) -> None:
    await _degraded(m)
    m.procs("m", 0)[-1].exit(WorkerExit.BOOT_FAILURE)
    await m.spawned("m", 1, count=2)
    m.procs("m", 1)[-1].exit(WorkerExit.BOOT_FAILURE)
    await settle(lambda: m.state("m") is S.DOWN, "down")


def _unload_from(prepare):
    async def run(m: Machine) -> None:
        await prepare(m)
        assert (await m.engine.unload("m")).state is S.UNLOADED
    run.prepared_by = prepare
    return run


def _idle_from(prepare):
    async def run(m: Machine) -> None:
        await prepare(m)
        idle_now(m)
        assert m.state("m") is S.AUTO_UNLOADING
        await settle(lambda: m.state("m") is S.UNLOADED, "idle unload done")
    run.prepared_by = prepare
    return run


async def _down_restart(m: Machine) -> None:
    await down_and_restart(m, 2)


async def _failed_then_load(m: Machine) -> None:
    load = asyncio.create_task(m.engine.load("m"))
    (await m.spawned("m")).exit(WorkerExit.BOOT_FAILURE)
    with pytest.raises(PoolError):
        await load
    await m.loaded("m")


async def _gate(m: Machine) -> None:
    await memory_gate_gives_up(m)


TWO_REPLICAS = {_degraded, degrade_and_recover, _degraded_to_down, _down_restart}


def _machine_for(edge, driver) -> Machine:
    if edge == (S.LOADING, S.UNLOADED):
        return Machine(model("pin", memory_mb=150, pinned=True), model("big", memory_mb=100, queue_timeout_s=0.3),
                       memory_budget_mb=200)
    two = driver in TWO_REPLICAS or getattr(driver, "prepared_by", None) in TWO_REPLICAS
    return Machine(model(replicas=2 if two else 1, idle_unload_s=1))


def _edge_drivers() -> dict:
    """Each allowed edge of MODEL_TRANSITIONS and the scenario that takes it by its cause."""
    return {
        (S.UNLOADED, S.LOADING): _load,
        (S.LOADING, S.LOADED): _load,
        (S.LOADING, S.FAILED): crash_during_a_load_on_demand,
        (S.LOADING, S.UNLOADED): _gate,
        (S.LOADING, S.UNLOADING): unload_during_a_load,
        (S.LOADED, S.DEGRADED): _degraded,
        (S.DEGRADED, S.LOADED): degrade_and_recover,
        (S.LOADED, S.DOWN): _down,
        (S.DEGRADED, S.DOWN): _degraded_to_down,
        (S.DOWN, S.DEGRADED): _down_restart,
        (S.LOADED, S.UNLOADING): _unload_from(_load),
        (S.DEGRADED, S.UNLOADING): _unload_from(_degraded),
        (S.DOWN, S.UNLOADING): _unload_from(_down),
        (S.LOADED, S.AUTO_UNLOADING): _idle_from(_load),
        (S.DEGRADED, S.AUTO_UNLOADING): _idle_from(_degraded),
        (S.DOWN, S.AUTO_UNLOADING): _idle_from(_down),
        (S.AUTO_UNLOADING, S.UNLOADING): unload_racing_an_idle_unload,
        (S.UNLOADING, S.UNLOADED): _unload_from(_load),
        (S.AUTO_UNLOADING, S.UNLOADED): _idle_from(_load),
        (S.FAILED, S.LOADING): _failed_then_load,
        (S.FAILED, S.UNLOADED): unload_a_failed_model,
    }


def test_every_edge_is_walked_and_every_other_refused():
    allowed = {(a, b) for a, targets in MODEL_TRANSITIONS.items() for b in targets}

    async def walk() -> None:
        drivers = _edge_drivers()
        assert set(drivers) == allowed, f"edges without a scenario: {allowed - set(drivers)}"
        for edge, driver in drivers.items():
            m = _machine_for(edge, driver)
            with recorded(m):
                await asyncio.wait_for(driver(m), 10)
            name = "big" if edge == (S.LOADING, S.UNLOADED) else "m"
            assert (*edge, name) in m.edges, f"{edge[0]} -> {edge[1]} not taken: {m.edges}"
            await m.close()
    asyncio.run(walk())

    for a in ModelState:  # every other edge raises, whatever the model holds
        for b in ModelState:
            if a is b or (a, b) in allowed:
                continue
            entry = ModelEntry(model())
            entry.state = a
            if a in HAS_EXECUTOR:
                entry.executor = Executor(entry.cfg)
            with pytest.raises(IllegalTransition):
                entry.set_state(b)
            assert entry.state is a


def test_the_executor_and_the_waiters_follow_the_table():
    """No state without its executor, none with one it must not have, no waiters
    outside an automatic unload; intake follows the state."""
    entry = ModelEntry(model())
    with pytest.raises(IllegalTransition, match="without an executor"):
        entry.set_state(S.LOADING)
    entry.executor = Executor(entry.cfg)
    entry.set_state(S.LOADING)
    assert entry.executor.accepting_new_requests and entry.executor.loading
    entry.set_state(S.LOADED)
    assert entry.executor.accepting_new_requests and not entry.executor.loading
    entry.waiting = [Job("m", {}, 60)]
    entry.set_state(S.AUTO_UNLOADING)
    assert not entry.executor.accepting_new_requests
    with pytest.raises(IllegalTransition, match="waiting"):
        entry.set_state(S.UNLOADING)
    entry.waiting = []
    with pytest.raises(IllegalTransition, match="with an executor"):
        entry.set_state(S.UNLOADED)
    entry.executor = None
    entry.set_state(S.UNLOADED)


def test_public_states_are_the_six_of_the_contract():
    assert {s.public.value for s in ModelState} == {"unloaded", "loading", "loaded", "degraded", "unloading",
                                                     "failed"}
    assert S.DOWN.public is S.FAILED and S.AUTO_UNLOADING.public is S.UNLOADING


@scenario
async def test_the_action_lock_hands_over_in_order_and_take_now_never_waits():
    lock = ActionLock()
    assert lock.take_now() and not lock.take_now()
    order = []

    async def waiter(i: int) -> None:
        async with lock:
            order.append(i)
            await asyncio.sleep(0)
    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    lock.release()
    assert lock.locked() and not lock.take_now()  # handed to the first waiter: nobody slips in
    cancelled = tasks[1]
    cancelled.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2] and not lock.locked() and lock.take_now()


@scenario
async def test_watchers_hear_every_change_and_a_failing_one_changes_nothing():
    m = Machine(model())
    heard = []
    m.engine.registry.watch(lambda entry, old, new: heard.append((entry.cfg.name, old, new)))
    m.engine.registry.watch(lambda entry, old, new: 1 / 0)
    await m.loaded("m")
    await m.engine.unload("m")
    assert heard == [("m", S.UNLOADED, S.LOADING), ("m", S.LOADING, S.LOADED), ("m", S.LOADED, S.UNLOADING),
                     ("m", S.UNLOADING, S.UNLOADED)]
    await m.close()


@scenario
async def test_a_removed_model_still_draining_never_shadows_the_alias_that_took_its_name():
    m = Machine(model("old"), model("new"))
    await m.loaded("old")
    await m.loaded("new")
    running = m.submit("old")
    await m.reload_to(model("new", aliases=["old"]))
    assert m.state("old") is S.UNLOADING  # drains its running job
    assert m.engine.entry("old") is m.entry("new")  # the name routes to the alias's model at once
    assert m.engine.entry("old", removed_too=False).cfg.name == "new"
    taken = m.submit("old")
    assert taken.model == "new"
    m.done(running)
    await settle(lambda: "old" not in m.engine.models, "old forgotten")
    await settle(lambda: taken.state is JobState.SUBMITTED, "dispatched")
    m.done(taken)
    await m.close()
