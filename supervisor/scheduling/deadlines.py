"""Deadlines a request carries, and the predictions admission holds them against.

A request's deadlines: `x-slo-ttft-ms` (time to its first token, from admission)
and `x-slo-tpot-ms` (time per output token), llm-d's names; else its tenant's
`slo_ttft_ms` / `slo_tpot_ms`, else its model's. Admission predicts, per ready
replica, the queue wait, the TTFT and the time per output token
(latency_predictor.ModelPredictor); a request whose prediction misses a
deadline on every replica is refused before it is queued (503
`deadline_unmeetable`, Retry-After when it would fit), and a fallback may take
it (fallback_chains). A queued one whose TTFT deadline passes leaves the queue
with that error, its slot never taken (Admitted.slo_deadline)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

from protocol import Done, runtime_timings
from protocol.errors import ErrorCode, PoolError
from supervisor.scheduling.latency_predictor import retry_after_s
from supervisor.states import ModelState, ReplicaState

SLO_HEADERS = ("x-slo-ttft-ms", "x-slo-tpot-ms")
READY = ReplicaState.READY
MAX_SLO_MS = 86_400_000  # a day: a longer deadline is none


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None


NO_SLO = Slo()


def _header_ms(headers, name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= MAX_SLO_MS:  # NaN fails too
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{name}: expected milliseconds, a number above 0 and at "
                        f"most {MAX_SLO_MS}", param=name)
    return ms


def request_slo(headers, tenant_spec, model_cfg) -> Slo:
    """The request's deadlines: its headers, else its tenant's defaults, else its model's."""
    raw = getattr(headers, "raw", None)
    if raw is not None:  # Starlette's Headers: one pass over its list (a get of an absent name raises, caught)
        for name, _ in raw:
            if name[:6] == b"x-slo-":
                break
        else:
            headers = {}
    ttft, tpot = _header_ms(headers, SLO_HEADERS[0]), _header_ms(headers, SLO_HEADERS[1])
    ttft = ttft or getattr(tenant_spec, "slo_ttft_ms", None) or model_cfg.slo_ttft_ms
    tpot = tpot or getattr(tenant_spec, "slo_tpot_ms", None) or model_cfg.slo_tpot_ms
    return NO_SLO if ttft is None and tpot is None else Slo(ttft, tpot)


class Prediction(NamedTuple):
    """For a new request: its place, its queue wait, and the best TTFT and time per output
    token over the model's replicas (seconds; tpot None while unknown); margin_s: what the
    deadline check adds to the TTFT (the predictor's recent under-prediction, p90)."""
    position: int
    wait_s: float
    ttft_s: float
    tpot_s: float | None
    margin_s: float = 0.0


def predict(entry, tenant: str, frame_bytes: int, now: float | None = None, ahead: int | None = None) -> Prediction:
    """What `entry`'s predictor expects for a new request of `tenant` whose Submit frame
    is `frame_bytes` long, with the model as it is now (`ahead`: a queued one's place)."""
    now = time.monotonic() if now is None else now
    predictor, ex = entry.predictor, entry.executor
    names, slots, free = [], 0, 0  # the ready replicas
    if ex is not None:
        for r in ex.replicas:
            if r.state is READY:
                names.append(r.name)
                slots += r.capacity
                free += r.free_slots
    if ahead is None:
        queue = ex.queue if ex is not None else ()
        ahead = (queue.ahead(tenant) if queue else 0) + len(entry.waiting)
    load_left = 0.0
    if not names:  # a cold model: its load first, then every configured slot is free
        names = [""]
        slots = free = entry.cfg.target_inflight * entry.cfg.replicas
        started = entry.load_started if entry.state is ModelState.LOADING and entry.load_started else now
        load_left = max(0.0, (entry.load_seconds or 0.0) - (now - started))
    wait = predictor.wait_s(ahead, slots, free, load_left)
    first, tpot = predictor.fastest(names, predictor.prompt_tokens(frame_bytes))
    return Prediction(ahead, wait, wait + first, tpot, predictor.margin_s)


def unmeetable(model: str, slo: Slo, prediction: Prediction) -> PoolError | None:
    """The error of a request whose prediction misses its deadline on every replica; None if it fits."""
    late_s = prediction.ttft_s + prediction.margin_s - (slo.ttft_ms or 0) / 1000
    if slo.ttft_ms is not None and late_s > 0:
        return PoolError(ErrorCode.DEADLINE_UNMEETABLE, f"model {model!r} cannot meet x-slo-ttft-ms "
                         f"{slo.ttft_ms:g}: its predicted time to first token is {prediction.ttft_s * 1000:.0f} ms "
                         f"(+{prediction.margin_s * 1000:.0f} ms margin; {prediction.position} requests ahead)",
                         retry_after_s=retry_after_s(late_s))
    if slo.tpot_ms is not None and prediction.tpot_s is not None and prediction.tpot_s * 1000 > slo.tpot_ms:
        return PoolError(ErrorCode.DEADLINE_UNMEETABLE, f"model {model!r} cannot meet x-slo-tpot-ms "
                         f"{slo.tpot_ms:g}: its predicted time per output token is {prediction.tpot_s * 1000:.1f} ms",
                         retry_after_s=retry_after_s(prediction.wait_s))
    return None


def expired(model: str, slo_ttft_ms: float) -> PoolError:
    """A queued request whose TTFT deadline passed: it leaves the queue with this."""
    return PoolError(ErrorCode.DEADLINE_UNMEETABLE, f"the request's x-slo-ttft-ms deadline ({slo_ttft_ms:g} ms) "
                     f"passed while it waited in model {model!r}'s queue", retry_after_s=1)


def learn(predictor, job, done: Done, now: float) -> None:
    """A finished job, learned by its model's predictor (ModelPredictor.learn): its request-log
    figures (ms, tokens, the runtime's own speeds) and what was predicted for it at admission."""
    start, usage = job.created_at, done.usage
    prefill = decode = None
    if done.timings:
        timings = runtime_timings(done.timings)
        if timings.get("prompt_n") and timings.get("prompt_per_second"):
            prefill = float(timings["prompt_per_second"])
        if timings.get("predicted_n") and timings.get("predicted_per_second"):
            decode = float(timings["predicted_per_second"])
    run, prediction = job.run, job.admitted.prediction
    predictor.learn(run.replica.name if run.replica is not None else None,
                    (run.submitted_at - start) * 1000 if run.submitted_at is not None else None,
                    (job.first_token_at - start) * 1000 if job.first_token_at is not None else None,
                    (now - start) * 1000, int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0),
                    usage.get("cached_tokens"), prefill, decode,
                    prediction.wait_s * 1000 if prediction is not None else None,
                    prediction.ttft_s * 1000 if prediction is not None else None, len(job.frame))
