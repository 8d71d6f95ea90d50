"""Latency over time, per model: each live sample (live.py) carries, per model, the
TTFT, duration and queue wait p50/p95 of the requests that finished in the last
WINDOW_S seconds, so that the page charts them over its ten minutes. Fed from the
request log's own figures (Activity.finished), the same milliseconds a row shows;
bounded: at most KEPT_PER_MODEL requests per model in the window."""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_S = 10.0  # each sample's figures cover the requests that finished this long before it
KEPT_PER_MODEL = 2000  # past this in one window, the oldest leave early (the figures stay recent)
FIGURES = ("ttft_ms", "duration_ms", "queued_ms")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of non-empty `values`."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class LatencyWindow:
    def __init__(self, window_s: float = WINDOW_S, kept: int = KEPT_PER_MODEL) -> None:
        self.window_s = window_s
        self.kept = kept
        self._done: dict[str, deque[tuple[float, float | None, float | None, float | None]]] = {}

    def add(self, model: str, ttft_ms: float | None, duration_ms: float | None, queued_ms: float | None) -> None:
        """One finished request of a configured model (on the event loop: an append)."""
        done = self._done.get(model)
        if done is None:
            done = self._done[model] = deque(maxlen=self.kept)
        done.append((time.monotonic(), ttft_ms, duration_ms, queued_ms))

    def figures(self, model: str) -> dict | None:
        """The model's figures over the window: `n` requests and, per figure, p50 and p95
        (None where no request in the window had it: a refused one has no TTFT); None
        when no request finished in the window."""
        done = self._done.get(model)
        cutoff = time.monotonic() - self.window_s
        while done and done[0][0] < cutoff:
            done.popleft()
        if not done:
            return None
        out: dict = {"n": len(done), "window_s": self.window_s}
        for i, name in enumerate(FIGURES, start=1):
            values = [d[i] for d in done if d[i] is not None]
            stem = name.removesuffix("_ms")
            out[f"{stem}_p50_ms"] = percentile(values, 50) if values else None
            out[f"{stem}_p95_ms"] = percentile(values, 95) if values else None
        return out

    def forget(self, keep: set[str]) -> None:
        """Drop the models no longer configured."""
        for name in [n for n in self._done if n not in keep]:
            del self._done[name]
