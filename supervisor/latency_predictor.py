"""Latency predictions per model and replica, learned online from the pool's own requests.

Method (stdlib only, O(1) per request): exponentially weighted moving averages
(EWMA, weight ALPHA for the newest request) of what each finished request shows,
in the request log's terms (`observe` takes a request-log row):

- service time: hand-over to the end (duration_ms - queued_ms), per model;
- prefill speed: prompt tokens per second (the runtime's own timing where it
  gives one, llama-server; else tokens_in over hand-over to first token), per replica;
- time per output token: 1 / the decode speed, per replica;
- prompt tokens per byte of the job's Submit frame, per model (a prompt's tokens
  are predicted from its size at admission, before any tokenizer runs).

A new request's queue wait: the jobs that go before it (the fair queue's
estimate of its place: higher priority bands first, `FairQueue.ahead`), less
the free slots, times the service time over the ready slots (the queue drains
at slots / service-time jobs a second). A cold model adds its expected load
time (the mean of its loads, less what the current load has taken). TTFT on a
replica: that wait plus the prompt's tokens over the replica's prefill speed.

Error: every request whose prediction was made is compared with what happened
(`errors`): the absolute error of queue wait and TTFT, p50 and p90 over the
last ERROR_WINDOW requests, in /admin/models. With no history a part is
predicted as 0 (optimistic): a model admits until it has learned."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

ALPHA = 0.2  # weight of the newest request in each average: about the last 10 requests count
ERROR_WINDOW = 256  # requests whose prediction errors are kept for the quantiles
DEFAULT_BYTES_PER_TOKEN = 4.0  # before a model has served anything


class Ewma:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + ALPHA * (x - self.value)


class ReplicaSpeeds:
    """What one replica showed: prefill tokens/s, seconds per output token."""
    __slots__ = ("prefill_tps", "tpot_s")

    def __init__(self) -> None:
        self.prefill_tps = Ewma()
        self.tpot_s = Ewma()


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ModelPredictor:
    """One model's learned speeds and its predictions (`clock`: injected by tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.service_s = Ewma()  # hand-over to end, one request
        self.tokens_per_byte = Ewma()
        self.replicas: dict[str, ReplicaSpeeds] = {}
        self.observed = 0
        self.wait_errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # |predicted - measured| queue wait, s
        self.ttft_errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # the same for TTFT
        self.last_at: float | None = None

    # -- learning --------------------------------------------------------------------------------
    def observe(self, replica: str | None, row: dict, frame_bytes: int | None = None) -> None:
        """One finished request, as its request-log row (queued_ms, ttft_ms, duration_ms,
        tokens_in, tokens_out, cached_tokens, runtime_prefill_tps, runtime_decode_tps) and
        optionally predicted_wait_ms / predicted_ttft_ms, what was predicted for it."""
        self.observed += 1
        self.last_at = self.clock()
        queued, ttft, duration = row.get("queued_ms"), row.get("ttft_ms"), row.get("duration_ms")
        tokens_in, tokens_out = row.get("tokens_in") or 0, row.get("tokens_out") or 0
        if queued is not None and duration is not None and duration >= queued:
            self.service_s.add((duration - queued) / 1000)
        if frame_bytes and tokens_in:
            self.tokens_per_byte.add(tokens_in / frame_bytes)
        speeds = self.replicas.setdefault(replica or "", ReplicaSpeeds())
        prefill = row.get("runtime_prefill_tps")
        computed = tokens_in - (row.get("cached_tokens") or 0)
        if prefill is None and computed > 0 and ttft is not None and queued is not None and ttft > queued:
            prefill = computed / ((ttft - queued) / 1000)
        if prefill:
            speeds.prefill_tps.add(prefill)
        decode = row.get("runtime_decode_tps")
        if decode is None and tokens_out > 1 and ttft is not None and duration is not None and duration > ttft:
            decode = (tokens_out - 1) / ((duration - ttft) / 1000)
        if decode:
            speeds.tpot_s.add(1 / decode)
        if row.get("predicted_wait_ms") is not None and queued is not None:
            self.wait_errors.append(abs(row["predicted_wait_ms"] - queued) / 1000)
        if row.get("predicted_ttft_ms") is not None and ttft is not None:
            self.ttft_errors.append(abs(row["predicted_ttft_ms"] - ttft) / 1000)

    # -- predicting ------------------------------------------------------------------------------
    def prompt_tokens(self, frame_bytes: int) -> int:
        per_byte = self.tokens_per_byte.value or 1 / DEFAULT_BYTES_PER_TOKEN
        return int(frame_bytes * per_byte)

    def wait_s(self, ahead: int, slots: int, free: int, load_left_s: float = 0.0) -> float:
        """Queue wait of a request with `ahead` jobs before it, on `slots` ready slots of
        which `free` are free, the model's load `load_left_s` away."""
        service = self.service_s.value or 0.0
        if slots <= 0:  # nothing ready yet (a cold load): its slots will be the configured ones
            return load_left_s + (ahead + 1) * service
        behind = ahead + 1 - free  # requests that must end before a slot is ours
        return load_left_s + (max(0, behind) * service / slots)

    def prefill_s(self, replica: str, prompt_tokens: int) -> float:
        speeds = self.replicas.get(replica) or self._pooled()
        tps = speeds.prefill_tps.value if speeds else None
        return prompt_tokens / tps if tps else 0.0

    def tpot_s(self, replica: str) -> float | None:
        speeds = self.replicas.get(replica) or self._pooled()
        return speeds.tpot_s.value if speeds else None

    def _pooled(self) -> ReplicaSpeeds | None:
        """A replica with no history yet: predicted as the model's most recent others."""
        return next((s for s in reversed(self.replicas.values()) if s.prefill_tps.value or s.tpot_s.value), None)

    def view(self) -> dict:
        """What /admin/models shows of it: the learned figures and the errors (ms)."""
        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1000, 1)
        waits, ttfts = list(self.wait_errors), list(self.ttft_errors)
        return {"method": "ewma", "requests_observed": self.observed,
                "service_ms": ms(self.service_s.value),
                "prompt_tokens_per_byte": None if self.tokens_per_byte.value is None
                else round(self.tokens_per_byte.value, 3),
                "queue_wait_error_ms": {"p50": ms(_quantile(waits, 0.5)), "p90": ms(_quantile(waits, 0.9)),
                                        "samples": len(waits)},
                "ttft_error_ms": {"p50": ms(_quantile(ttfts, 0.5)), "p90": ms(_quantile(ttfts, 0.9)),
                                  "samples": len(ttfts)}}

    def replica_view(self, replica: str) -> dict:
        speeds = self.replicas.get(replica)
        tps = speeds.prefill_tps.value if speeds else None
        tpot = speeds.tpot_s.value if speeds else None
        return {"predicted_prefill_tokens_per_s": None if tps is None else round(tps, 1),
                "predicted_tpot_ms": None if tpot is None else round(tpot * 1000, 2)}


def retry_after_s(excess_s: float) -> int:
    """Retry-After for a request that would miss its deadline by `excess_s`: when it would fit."""
    return max(1, math.ceil(excess_s))
