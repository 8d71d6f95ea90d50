"""Model and replica states, each with its one transition function."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

S = TypeVar("S", bound=StrEnum)


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    BACKOFF = "backoff"
    FATAL = "fatal"


MODEL_TRANSITIONS: dict[ModelState, set[ModelState]] = {
    ModelState.UNLOADED: {ModelState.LOADING},
    ModelState.LOADING: {ModelState.LOADED, ModelState.FAILED, ModelState.UNLOADING},
    ModelState.LOADED: {ModelState.UNLOADING, ModelState.FAILED},
    ModelState.UNLOADING: {ModelState.UNLOADED},
    ModelState.FAILED: {ModelState.LOADING, ModelState.UNLOADING},
}

REPLICA_TRANSITIONS: dict[ReplicaState, set[ReplicaState]] = {
    ReplicaState.STARTING: {ReplicaState.READY, ReplicaState.STOPPING, ReplicaState.STOPPED,
                            ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.READY: {ReplicaState.DRAINING, ReplicaState.STOPPING, ReplicaState.STOPPED,
                         ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.DRAINING: {ReplicaState.STOPPING, ReplicaState.STOPPED},
    # a crash kill (hung or corrupt worker) passes through STOPPING, then backs off
    ReplicaState.STOPPING: {ReplicaState.STOPPED, ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.STOPPED: {ReplicaState.STARTING, ReplicaState.BACKOFF, ReplicaState.FATAL},
    ReplicaState.BACKOFF: {ReplicaState.STARTING, ReplicaState.STOPPED},
    ReplicaState.FATAL: {ReplicaState.STARTING, ReplicaState.STOPPED},
}


class IllegalTransition(RuntimeError):
    pass


def transition(table: dict[S, set[S]], current: S, new: S) -> S:
    if new != current and new not in table[current]:
        raise IllegalTransition(f"{current} -> {new}")
    return new
