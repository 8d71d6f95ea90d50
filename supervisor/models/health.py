"""How healthy each model is, as ops sees it: the one place a model's shown
state is derived from its lifecycle state and its replicas (loaded, degraded,
failed), with the reason of every replica that is not ready. /admin/models,
/health, /metrics, the page and the CLI all read it from here."""

from __future__ import annotations

from protocol.errors import exit_text
from supervisor.states import ModelState, ReplicaState

DEGRADED = "degraded"  # loaded, with fewer ready replicas than configured (it still serves)
UNHEALTHY = frozenset({DEGRADED, ModelState.FAILED.value})


def derived_state(entry) -> str:
    """The state ops see: the model state machine's public name (degraded: fewer
    ready replicas than configured; a loaded model with no live replica: failed)."""
    return entry.state.public.value


def replica_reasons(entry) -> list[dict]:
    """Each replica that is not ready, with its state and why (its last error or exit)."""
    out = []
    for r in shown_replicas(entry):
        if r.state is ReplicaState.READY:
            continue
        out.append({"replica": r.index, "name": r.name, "state": r.state.value, "reason": replica_reason(r)})
    return out


def replica_reason(r) -> str:
    why = _reason(r)
    if r.state is ReplicaState.BACKOFF and r.restart_in_s is not None:  # its back-off's countdown
        return f"{why}; restarting in {r.restart_in_s:.0f}s"
    return why


def _reason(r) -> str:
    if r.last_error:
        return r.last_error
    if r.state is ReplicaState.RESTARTING:
        left = r.restart_drain_left_s
        return "restarting (asked by the operator" + (f"; its drain ends within {left:.0f}s)" if left else ")")
    if r.last_exit_code is not None and r.state is not ReplicaState.STARTING:
        return r.last_exit_why or f"exited with {exit_text(r.last_exit_code)}"
    return {ReplicaState.STARTING: "starting", ReplicaState.DRAINING: "draining",
            ReplicaState.STOPPING: "stopping", ReplicaState.KILLING: "being killed (not responding)",
            ReplicaState.BACKOFF: "waiting to restart after a crash",
            ReplicaState.STOPPED: "stopped", ReplicaState.FATAL: "gave up restarting"}.get(r.state, r.state.value)


def shown_replicas(entry) -> list:
    """The replicas ops should see: the running ones, or those of the last load that failed."""
    if entry.executor is not None:
        return list(entry.executor.replicas)
    return list(getattr(entry, "failed_replicas", None) or [])


def model_health(entry) -> dict:
    """The health part of a model's view."""
    state = derived_state(entry)
    ex = entry.executor
    ready = sum(r.state is ReplicaState.READY for r in ex.replicas) if ex else 0
    reasons = replica_reasons(entry) if state in UNHEALTHY or entry.state is ModelState.LOADING else []
    # planned work, shown apart from faults: each replica in an operator's restart, and its drain's countdown
    restarting = [{"replica": r.index, "name": r.name, "state": r.state.value, "drain_left_s": tenth(
        r.restart_drain_left_s)} for r in (ex.replicas if ex else ()) if r.in_operator_restart]
    return {"state": state, "ready": ready, "configured": entry.cfg.replicas, "replica_errors": reasons,
            "restarting": restarting, "unloading": unloading(entry)}


def tenth(value: float | None) -> float | None:
    """A figure in seconds (or ms) as shown: to a tenth."""
    return None if value is None else round(value, 1)


def unloading(entry) -> dict | None:
    """Planned work too: an unload under way (an operator's, a reload's, an idle or eviction
    unload), why, what it still waits for, and when its drain stops waiting."""
    if entry.state not in (ModelState.UNLOADING, ModelState.AUTO_UNLOADING):
        return None
    ex = entry.executor
    return {"why": entry.unload_why or "unloaded", "draining": ex.runtime_inflight if ex else 0,
            "drain_left_s": tenth(ex.drain_left_s) if ex else None}


def reason_text(view: dict) -> str | None:
    """One line: why a model is degraded or failed."""
    error = view.get("error")
    parts = [f"{e['name']} {e['state']}: {e['reason']}" for e in view.get("replica_errors") or []
             if not (error and e["reason"] in error)]  # a failed load's error names them already
    if error:
        parts.insert(0, error)
    return "; ".join(dict.fromkeys(parts)) or None


def last_load_failed(entry) -> bool:
    """Unloaded, and its last load failed (unloaded while failed, or refused by the memory
    budget): the error stays until a load succeeds. A request would try again, but nothing says
    that it would work."""
    return entry.state is ModelState.UNLOADED and bool(entry.error)


def can_serve(entry) -> bool:
    """Whether a request for this model is served now or soon: a loaded model with a ready
    replica (or one in an operator's restart: planned work, its queue waits for it), or a
    load_on_demand model that a request loads. A failed or down model does not, nor an
    unloaded one whose last load failed (a failed model's unload does not mend it)."""
    state = entry.state
    if state in (ModelState.LOADED, ModelState.DEGRADED):
        return any(r.state is ReplicaState.READY or r.in_operator_restart for r in entry.executor.replicas)
    return entry.cfg.load_on_demand and not entry.held_by and not last_load_failed(entry) and state in (
        ModelState.UNLOADED, ModelState.LOADING, ModelState.AUTO_UNLOADING)


def readiness(engine) -> dict:
    """GET /ready's answer: `ready` once the start-up loads have settled (each loaded or
    failed) and while at least one model can serve; not ready while starting or stopping.
    `status`: ready, starting (with `waiting_for`), shutting_down or no_model_serves."""
    if engine.shutting_down:
        return {"ready": False, "status": "shutting_down"}
    if engine.starting:
        return {"ready": False, "status": "starting", "waiting_for": sorted(engine.starting)}
    entries = engine.registry.configured()
    serving = [e.cfg.name for e in entries if can_serve(e)]
    not_serving = [e.cfg.name for e in entries if not can_serve(e)]
    return {"ready": bool(serving), "status": "ready" if serving else "no_model_serves",
            "serving": serving, "not_serving": not_serving}


def pool_health(engine) -> dict:
    """GET /health: the whole picture in one JSON object (200 while the process lives)."""
    models = {}
    for entry in engine.registry.configured():  # a removed model still draining is not the pool's
        name = entry.cfg.name
        h = model_health(entry)
        h["error"] = entry.error
        failed_before = last_load_failed(entry)
        models[name] = {"state": h["state"], "ready": h["ready"], "configured": h["configured"],
                        "reason": f"its last load failed: {entry.error}" if failed_before else reason_text(h),
                        "restarting": [r["name"] for r in h["restarting"]], "unloading": h["unloading"],
                        "last_load_failed": failed_before}
    bad = sorted(n for n, m in models.items() if m["state"] in UNHEALTHY or m["last_load_failed"])
    status = ("shutting_down" if engine.shutting_down else "failed" if any(
        models[n]["state"] == ModelState.FAILED.value or models[n]["last_load_failed"] for n in bad)
        else DEGRADED if bad else "ok")
    return {"status": status, "ready": engine.ready(), "unhealthy": bad, "models": models}
