"""Model and replica states, each with its one transition table and the one
transition function that checks it (supervisor/models/ records the model's
state only through `ModelEntry.set_state`)."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

S = TypeVar("S", bound=StrEnum)


class ModelState(StrEnum):
    UNLOADED = "unloaded"  # nothing runs; a request loads it (load_on_demand) or gets 409
    LOADING = "loading"  # its queue takes requests; the memory gate, then its replicas start
    LOADED = "loaded"  # every configured replica is ready
    DEGRADED = "degraded"  # some replica is not ready (crashed, restarting, fatal); the others serve
    DOWN = "down"  # was loaded; no replica runs or will restart (all fatal or stopped): shown `failed`
    UNLOADING = "unloading"  # draining, then stopping; a new request gets 503
    # an automatic unload (idle, evicted) of a load_on_demand model: a new request waits
    # for the next load, which starts when this unload ends; shown `unloading`
    AUTO_UNLOADING = "auto_unloading"
    FAILED = "failed"  # its last load failed; nothing runs; a request or `load` tries again

    @property
    def public(self) -> ModelState:
        """The state as views show it: the six public names (contract) only."""
        return _PUBLIC.get(self, self)


_PUBLIC = {ModelState.DOWN: ModelState.FAILED, ModelState.AUTO_UNLOADING: ModelState.UNLOADING}

# States in which the model has an executor (a queue, replicas): the others have none.
HAS_EXECUTOR = frozenset({ModelState.LOADING, ModelState.LOADED, ModelState.DEGRADED, ModelState.DOWN,
                          ModelState.UNLOADING, ModelState.AUTO_UNLOADING})
# States whose executor takes new requests into its queue (its `accepting_new_requests`).
INTAKE_OPEN = frozenset({ModelState.LOADING, ModelState.LOADED, ModelState.DEGRADED, ModelState.DOWN})
# A loaded model: its replicas decide between these three (ModelEntry.replicas_changed).
RUNNING = frozenset({ModelState.LOADED, ModelState.DEGRADED, ModelState.DOWN})


class ReplicaState(StrEnum):
    """A replica's state says what its worker's exit means (Replica._watch), with no flag beside it."""
    STARTING = "starting"  # spawned, loading: an exit fails the start (never restarted from here)
    READY = "ready"  # in rotation: an exit is a crash, restarted with back-off
    DRAINING = "draining"  # an unload's drain: no new jobs; an exit is final (a crash event, never restarted)
    RESTARTING = "restarting"  # an operator restart, from its drain to its next start: its exit is planned
    STOPPING = "stopping"  # the pool stops it (unload, shutdown, a failed start): its exit is planned
    KILLING = "killing"  # hung, corrupt or unreachable: its tree is killed; its exit is a crash
    STOPPED = "stopped"
    BACKOFF = "backoff"
    FATAL = "fatal"


# Every edge, and what takes it (tests/test_model_machine.py walks each one):
#   UNLOADED  -> LOADING         load (operator, start, reload) or load on demand (a request)
#   LOADING   -> LOADED          every replica started
#   LOADING   -> FAILED          a replica failed to start (a crash during the load)
#   LOADING   -> UNLOADED        the memory gate gave up (nothing evictable in time; no waiter left)
#   LOADING   -> UNLOADING       unload or removal during the load: intake stops at once
#   LOADED    -> DEGRADED        a replica left ready (crash, restart)
#   DEGRADED  -> LOADED          every replica ready again
#   LOADED, DEGRADED -> DOWN     no replica runs or will restart
#   DOWN      -> DEGRADED        an operator restart brought a replica back (all ready next: LOADED)
#   LOADED, DEGRADED, DOWN -> UNLOADING       unload, reload change, removal, shutdown
#   LOADED, DEGRADED, DOWN -> AUTO_UNLOADING  idle unload or eviction of a load_on_demand model
#   AUTO_UNLOADING -> UNLOADING  an operator unload or a removal overrides it: the waiters get 503
#   UNLOADING, AUTO_UNLOADING -> UNLOADED   its replicas stopped
#   FAILED    -> LOADING         load again (operator, or a request)
#   FAILED    -> UNLOADED        unload or reload change of a failed model: its error is cleared
MODEL_TRANSITIONS: dict[ModelState, set[ModelState]] = {
    ModelState.UNLOADED: {ModelState.LOADING},
    ModelState.LOADING: {ModelState.LOADED, ModelState.FAILED, ModelState.UNLOADED, ModelState.UNLOADING},
    ModelState.LOADED: {ModelState.DEGRADED, ModelState.DOWN, ModelState.UNLOADING, ModelState.AUTO_UNLOADING},
    ModelState.DEGRADED: {ModelState.LOADED, ModelState.DOWN, ModelState.UNLOADING, ModelState.AUTO_UNLOADING},
    ModelState.DOWN: {ModelState.DEGRADED, ModelState.UNLOADING, ModelState.AUTO_UNLOADING},
    ModelState.UNLOADING: {ModelState.UNLOADED},
    ModelState.AUTO_UNLOADING: {ModelState.UNLOADED, ModelState.UNLOADING},
    ModelState.FAILED: {ModelState.LOADING, ModelState.UNLOADED},
}

REPLICA_TRANSITIONS: dict[ReplicaState, set[ReplicaState]] = {
    ReplicaState.STARTING: {ReplicaState.READY, ReplicaState.RESTARTING, ReplicaState.STOPPING,
                            ReplicaState.KILLING, ReplicaState.STOPPED, ReplicaState.FATAL},
    ReplicaState.READY: {ReplicaState.DRAINING, ReplicaState.RESTARTING, ReplicaState.STOPPING,
                         ReplicaState.KILLING, ReplicaState.STOPPED, ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.DRAINING: {ReplicaState.STOPPING, ReplicaState.STOPPED},
    # a stop (unload, shutdown) in any phase of an operator restart ends it; else, the old
    # worker gone, the restart starts the new one
    ReplicaState.RESTARTING: {ReplicaState.STOPPING, ReplicaState.STARTING},
    ReplicaState.STOPPING: {ReplicaState.STOPPED},
    # a crash kill ends in a back-off (or fatal), or stopped when it never was ready
    ReplicaState.KILLING: {ReplicaState.STOPPING, ReplicaState.RESTARTING, ReplicaState.STOPPED,
                           ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.STOPPED: {ReplicaState.STARTING, ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.BACKOFF: {ReplicaState.STARTING, ReplicaState.STOPPED},
    ReplicaState.FATAL: {ReplicaState.STARTING, ReplicaState.STOPPED},
}


class JobState(StrEnum):
    QUEUED = "queued"  # in the executor's queue; the scheduler may still drop it
    SUBMITTED = "submitted"  # handed to a worker: past the cancel boundary, counts as inflight
    FINISHED = "finished"


#   QUEUED    -> SUBMITTED   the driver loop hands it to a replica with a free slot
#   SUBMITTED -> QUEUED      its worker was lost before it produced anything: back to the queue's head
#   QUEUED, SUBMITTED -> FINISHED   its outcome (Done or an error), however it came
JOB_TRANSITIONS: dict[JobState, set[JobState]] = {
    JobState.QUEUED: {JobState.SUBMITTED, JobState.FINISHED},
    JobState.SUBMITTED: {JobState.QUEUED, JobState.FINISHED},
    JobState.FINISHED: set(),
}


# The members the request path compares against, as module names: reading a member off its Enum
# class goes through EnumType's __getattr__ hook (about 80 ns on CPython 3.11; a module name: 5),
# and every request reads dozens.
JOB_QUEUED, JOB_SUBMITTED, JOB_FINISHED = JobState.QUEUED, JobState.SUBMITTED, JobState.FINISHED
REPLICA_READY, REPLICA_FATAL = ReplicaState.READY, ReplicaState.FATAL
MODEL_UNLOADED, MODEL_UNLOADING, MODEL_FAILED = ModelState.UNLOADED, ModelState.UNLOADING, ModelState.FAILED
MODEL_AUTO_UNLOADING = ModelState.AUTO_UNLOADING


class IllegalTransition(RuntimeError):
    pass


def transition(table: dict[S, set[S]], current: S, new: S) -> S:
    if new != current and new not in table[current]:
        raise IllegalTransition(f"{current} -> {new}")
    return new
