"""Latency predictions per model and replica, learned online from the pool's own requests.

Method (stdlib only, O(1) per request): exponentially weighted moving averages
(EWMA, weight ALPHA for the newest request) of what each finished request shows,
in the request log's terms (`observe` takes a request-log row):

- service time: hand-over to the end (duration_ms - queued_ms), per model;
- hand-over to first token against the prompt's tokens, a line fitted by
  exponentially weighted least squares (a fixed cost and a cost per token), per
  replica; and the prefill speed (the runtime's own timing where it gives one,
  llama-server; else the computed tokens over that time), shown per replica;
- time per output token: 1 / the decode speed, per replica;
- prompt tokens per byte of the job's Submit frame, per model (a prompt's tokens
  are predicted from its size at admission, before any tokenizer runs).

A new request's queue wait: the jobs that go before it (the fair queue's
estimate of its place: higher priority bands first, `FairQueue.ahead`), less
the free slots, times the service time over the ready slots (the queue drains
at slots / service-time jobs a second). A cold model adds its expected load
time (the mean of its loads, less what the current load has taken). TTFT on a
replica: that wait plus the replica's line at the prompt's tokens.

Error: every request whose prediction was made is compared with what happened:
the absolute error of queue wait and TTFT, p50 and p90 over the last
ERROR_WINDOW requests, in /admin/models. A deadline is checked against the
predicted TTFT plus the p90 of how much it was under-predicted lately
(`margin_s`), so that a model whose predictions run short does not admit
requests that then miss. With no history a part is
predicted as 0 (optimistic): a model admits until it has learned."""

from __future__ import annotations

import math
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable

ALPHA = 0.2  # weight of the newest request in each average: about the last 10 requests count
ERROR_WINDOW = 256  # requests whose prediction errors are kept for the quantiles
DEFAULT_BYTES_PER_TOKEN = 4.0  # before a model has served anything
# a deadline is checked against the predicted TTFT plus this quantile of how much the TTFT was
# under-predicted lately (so that ~90% of admitted requests meet it)
MARGIN_QUANTILE = 0.9


class Ewma:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + ALPHA * (x - self.value)


class EwmaLine:
    """y = a + b x by exponentially weighted least squares (the same weights as Ewma): the
    time from hand-over to first token against the prompt's tokens, so that a fixed cost
    (template, HTTP, a cached prefix) and a per-token cost are both learned. With prompts
    all of one size it is the mean. The slope is solved when a point is added (once per
    finished request), so that `at` (once per admission) is one multiply-add."""
    __slots__ = ("x", "y", "xx", "xy", "slope")

    def __init__(self) -> None:
        self.x = self.y = self.xx = self.xy = None
        self.slope = 0.0

    def add(self, x: float, y: float) -> None:
        if self.x is None:
            self.x, self.y, self.xx, self.xy = x, y, x * x, x * y
            return
        self.x += ALPHA * (x - self.x)
        self.y += ALPHA * (y - self.y)
        self.xx += ALPHA * (x * x - self.xx)
        self.xy += ALPHA * (x * y - self.xy)
        spread = self.xx - self.x * self.x
        slope = (self.xy - self.x * self.y) / spread if spread > 1e-9 * max(1.0, self.xx) else 0.0
        self.slope = max(0.0, slope)  # more prompt never takes less time

    def at(self, x: float) -> float | None:
        if self.x is None:
            return None
        return max(0.0, self.y + self.slope * (x - self.x))


class ReplicaSpeeds:
    """What one replica showed: hand-over to first token against prompt tokens, prefill
    tokens/s (shown), seconds per output token."""
    __slots__ = ("first_token", "prefill_tps", "tpot_s")

    def __init__(self) -> None:
        self.first_token = EwmaLine()
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
        self.ttft_under: deque[float] = deque(maxlen=ERROR_WINDOW)  # measured - predicted TTFT, s (signed)
        self._under_sorted: list[float] = []  # ttft_under's values in order (_under)
        self.margin_s = 0.0  # p90 of ttft_under, at least 0: what a deadline check adds
        self.last_at: float | None = None

    # -- learning --------------------------------------------------------------------------------
    def observe(self, replica: str | None, row: dict, frame_bytes: int | None = None) -> None:
        """One finished request, as its request-log row (queued_ms, ttft_ms, duration_ms,
        tokens_in, tokens_out, cached_tokens, runtime_prefill_tps, runtime_decode_tps) and
        optionally predicted_wait_ms / predicted_ttft_ms, what was predicted for it."""
        get = row.get
        self.learn(replica, get("queued_ms"), get("ttft_ms"), get("duration_ms"), get("tokens_in") or 0,
                   get("tokens_out") or 0, get("cached_tokens"), get("runtime_prefill_tps"),
                   get("runtime_decode_tps"), get("predicted_wait_ms"), get("predicted_ttft_ms"), frame_bytes)

    def learn(self, replica: str | None, queued: float | None, ttft: float | None, duration: float | None,
              tokens_in: int, tokens_out: int, cached: int | None = None, prefill: float | None = None,
              decode: float | None = None, predicted_wait: float | None = None,
              predicted_ttft: float | None = None, frame_bytes: int | None = None) -> None:
        """`observe` with the row's figures as arguments (ms, tokens, tokens/s): what the
        engine calls for every request served, with no row built."""
        self.observed += 1
        self.last_at = self.clock()
        if queued is not None and duration is not None and duration >= queued:
            self.service_s.add((duration - queued) / 1000)
        if frame_bytes and tokens_in:
            self.tokens_per_byte.add(tokens_in / frame_bytes)
        speeds = self.replicas.get(replica or "")
        if speeds is None:
            speeds = self.replicas[replica or ""] = ReplicaSpeeds()
        if ttft is not None and queued is not None and ttft >= queued:
            speeds.first_token.add(tokens_in, (ttft - queued) / 1000)
        computed = tokens_in - (cached or 0)
        if prefill is None and computed > 0 and ttft is not None and queued is not None and ttft > queued:
            prefill = computed / ((ttft - queued) / 1000)
        if prefill:
            speeds.prefill_tps.add(prefill)
        if decode is None and tokens_out > 1 and ttft is not None and duration is not None and duration > ttft:
            decode = (tokens_out - 1) / ((duration - ttft) / 1000)
        if decode:
            speeds.tpot_s.add(1 / decode)
        if predicted_wait is not None and queued is not None:
            self.wait_errors.append(abs(predicted_wait - queued) / 1000)
        if predicted_ttft is not None and ttft is not None:
            self.ttft_errors.append(abs(predicted_ttft - ttft) / 1000)
            self._under((ttft - predicted_ttft) / 1000)

    def _under(self, seconds: float) -> None:
        """One more TTFT under-prediction: the window and its sorted copy move on together, so
        that the margin (their p90) is current after every request at O(log n) plus a shift."""
        window, ordered = self.ttft_under, self._under_sorted
        if len(window) == window.maxlen:
            del ordered[bisect_left(ordered, window[0])]
        window.append(seconds)
        insort(ordered, seconds)
        self.margin_s = max(0.0, ordered[min(len(ordered) - 1, int(MARGIN_QUANTILE * len(ordered)))])

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

    def fastest(self, replicas: list[str], prompt_tokens: int) -> tuple[float, float | None]:
        """(hand-over to first token, seconds per output token) on the best of these
        replicas, each figure on its own; replicas with no history yet: as the model's
        others; 0.0 / None while nothing is known. One pass."""
        first = tpot = None
        known = self.replicas
        for name in replicas:
            speeds = known.get(name)
            if speeds is None:
                continue
            at, per_token = speeds.first_token.at(prompt_tokens), speeds.tpot_s.value
            if at is not None and (first is None or at < first):
                first = at
            if per_token is not None and (tpot is None or per_token < tpot):
                tpot = per_token
        if (first is None or tpot is None) and known:
            pooled = self._pooled()
            if pooled is not None:
                first = first if first is not None else pooled.first_token.at(prompt_tokens)
                tpot = tpot if tpot is not None else pooled.tpot_s.value
        return first or 0.0, tpot

    def _pooled(self) -> ReplicaSpeeds | None:
        """A replica with no history yet: predicted as the last replica with figures, in the
        order replicas were first seen (not the one that learned most recently)."""
        return next((s for s in reversed(self.replicas.values()) if s.first_token.x is not None or s.tpot_s.value),
                    None)

    def view(self) -> dict:
        """What /admin/models shows of it: the learned figures and the errors (ms)."""
        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1000, 1)
        waits, ttfts = list(self.wait_errors), list(self.ttft_errors)
        age = None if self.last_at is None else round(self.clock() - self.last_at, 1)
        return {"method": "ewma", "requests_observed": self.observed, "last_observed_s_ago": age,
                "deadline_margin_ms": ms(self.margin_s),
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
        first = speeds.first_token.at(100) if speeds else None
        return {"predicted_prefill_tokens_per_s": None if tps is None else round(tps, 1),
                "predicted_first_token_ms_at_100_tokens": None if first is None else round(first * 1000, 1),
                "predicted_tpot_ms": None if tpot is None else round(tpot * 1000, 2)}


def retry_after_s(excess_s: float) -> int:
    """Retry-After for a request that would miss its deadline by `excess_s`: when it would fit."""
    return max(1, math.ceil(excess_s))
