"""The event timeline's store and the derived model state: pure units (no pool)."""

from __future__ import annotations

import logging
import signal
from types import SimpleNamespace

from protocol.errors import exit_text
from supervisor.events import MESSAGE_CHARS, EventKind, EventLog, emit
from supervisor.models.health import derived_state, model_health, reason_text
from supervisor.states import ModelState, ReplicaState
from tests.pool import wait_for


def test_events_are_kept_bounded_clipped_and_paged(tmp_path, caplog):
    store = EventLog(tmp_path / "events.sqlite3", max_rows=5, flush_s=0.01)
    store.start()
    try:
        with caplog.at_level(logging.INFO, logger="llm_pool.events"):
            for i in range(8):
                emit(EventKind.CRASHED, f"crash {i}", model="m", replica=0)
            emit(EventKind.RESTARTING, "x" * (MESSAGE_CHARS + 50), model="other", by="cli")
        rows = wait_for(lambda: (r := store.query(limit=100)) and r[-1]["kind"] == "restarting" and r, 5,
                        what="the rows written")
        assert len(rows) == 5  # the newest max_rows
        assert [r["message"] for r in rows[:4]] == ["crash 4", "crash 5", "crash 6", "crash 7"]
        last = rows[-1]
        assert last["by"] == "cli" and last["message"].endswith("... [50 more characters]")
        assert len(last["message"]) < MESSAGE_CHARS + 40
        # after_id pages forward, oldest first; a model filter
        after = store.query(after_id=rows[1]["id"], limit=2)
        assert [r["id"] for r in after] == [rows[2]["id"], rows[3]["id"]]
        assert [r["model"] for r in store.query(model="other")] == ["other"]
        # the log says the same, with who asked
        assert any(r.getMessage() == "x" * (MESSAGE_CHARS + 50) + " (asked by cli)" for r in caplog.records)
    finally:
        store.close()


def entry(state: ModelState, replicas: list[ReplicaState] | None, configured: int = 2, error=None):
    reps = [SimpleNamespace(index=i, name=f"m/{i}", state=s, last_error=None if s is ReplicaState.READY else "boom",
                            last_exit_code=-9, restarting=False, in_operator_restart=False,
                            restart_drain_left_s=None,
                            live=s in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING,
                                       ReplicaState.BACKOFF))
            for i, s in enumerate(replicas or [])]
    return SimpleNamespace(state=state, executor=SimpleNamespace(replicas=reps) if replicas is not None else None,
                           cfg=SimpleNamespace(replicas=configured), error=error, failed_replicas=[])


def test_derived_state_and_reasons():
    """The shown state is the model machine's public name; the health part adds the
    ready/configured counts and each non-ready replica's reason."""
    R = ReplicaState
    assert derived_state(entry(ModelState.LOADED, [R.READY, R.READY])) == "loaded"
    assert derived_state(entry(ModelState.DEGRADED, [R.READY, R.FATAL])) == "degraded"
    assert derived_state(entry(ModelState.DOWN, [R.FATAL, R.FATAL])) == "failed"
    assert derived_state(entry(ModelState.UNLOADED, None)) == "unloaded"
    health = model_health(entry(ModelState.DEGRADED, [R.READY, R.FATAL]))
    assert (health["state"], health["ready"], health["configured"]) == ("degraded", 1, 2)
    assert health["replica_errors"] == [{"replica": 1, "name": "m/1", "state": "fatal", "reason": "boom"}]
    assert reason_text(health) == "m/1 fatal: boom"
    assert model_health(entry(ModelState.LOADED, [R.READY, R.READY]))["replica_errors"] == []


def test_exit_text_names_signals():
    assert exit_text(-signal.SIGKILL) == "SIGKILL"
    assert exit_text(-signal.SIGTERM) == "SIGTERM"
    assert exit_text(1) == "code 1"
    assert exit_text(None) == "an unknown code"
    assert exit_text(-200) == "signal 200"
