"""What the pool has been doing, for the operator's page and `llm-pool requests`:
finished requests go to the request log (SQLite), and once a second a sample
of every model's queue depth, in-flight count and tokens/s goes into a ring
buffer of the last ten minutes, pushed to whoever is watching."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path

from protocol import Done
from protocol.errors import PoolError
from supervisor.engine import default_state_dir
from supervisor.jobs import Job
from supervisor.request_log import RequestLog, truncate

log = logging.getLogger("llm_pool.live")

SAMPLE_PERIOD_S = 1.0
SAMPLES_KEPT = 600  # ten minutes, one a second


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round((end - start) * 1000, 1)


class Activity:
    def __init__(self, engine) -> None:
        self.engine = engine
        server = engine.config.server
        state_dir = Path(server.state_dir or default_state_dir())
        self.requests = RequestLog(state_dir / "requests.sqlite3", server.request_log_max_rows,
                                   server.request_log_days)
        self.samples: deque[dict] = deque(maxlen=SAMPLES_KEPT)
        self._tokens: dict[str, int] = {}  # output tokens of finished requests, per model, since start
        self._watchers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.requests.start()
        self._start_sampler()

    def _start_sampler(self) -> None:
        self._task = asyncio.create_task(self._sample_loop(), name="live-samples")
        self._task.add_done_callback(self._sampler_ended)

    def _sampler_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: say so, and sample on
            log.error("live samples failed; restarting them", exc_info=task.exception())
            self._start_sampler()

    async def close(self) -> None:
        if self._task:
            task, self._task = self._task, None
            task.remove_done_callback(self._sampler_ended)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(self.requests.close)

    # -- finished requests (from Metrics, on the event loop) ---------------------------------------
    def finished(self, model: str | None, endpoint: str, status: int, job: Job | None = None,
                 done: Done | None = None, error: PoolError | None = None) -> None:
        now = time.monotonic()
        usage = done.usage if done else {}
        tokens_out = int(usage.get("output_tokens", 0)) if done else None
        if tokens_out:
            self._tokens[model] = self._tokens.get(model, 0) + tokens_out
        row = {"ts": time.time(), "model": model or "", "endpoint": endpoint, "status": status,
               "error_code": error.code.value if error else None,
               "error_message": error.message if error else None,
               "tokens_in": int(usage.get("input_tokens", 0)) if done else None, "tokens_out": tokens_out}
        if job is not None:
            row.update(queued_ms=_ms(job.created_at, job.submitted_at or (now if error else None)),
                       ttft_ms=_ms(job.created_at, job.first_token_at), duration_ms=_ms(job.created_at, now))
            if job.transcript is not None:  # the model has log_bodies = true
                row.update(prompt=truncate(json.dumps(job.request.get("messages"), ensure_ascii=False)),
                           output=truncate("".join(job.transcript)))
        self.requests.record(**row)

    # -- live samples ----------------------------------------------------------------------------
    def sample(self) -> dict:
        models = {}
        for name, entry in self.engine.models.items():
            ex = entry.executor
            models[name] = {"state": entry.state.value, "queue": ex.queue_depth if ex else 0,
                            "inflight": ex.runtime_inflight if ex else 0, "tokens": self._tokens.get(name, 0)}
        return {"t": round(time.time(), 3), "models": models}

    async def _sample_loop(self) -> None:
        previous = None
        next_at = time.monotonic()
        while True:
            next_at += SAMPLE_PERIOD_S
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            current = self.sample()
            for name, m in current["models"].items():  # tokens/s over the last period
                before = previous["models"].get(name) if previous else None
                elapsed = current["t"] - previous["t"] if previous else 0
                m["tps"] = round((m["tokens"] - before["tokens"]) / elapsed, 1) if before and elapsed > 0 else 0.0
            previous = current
            self.samples.append(current)
            for q in self._watchers:
                if q.full():  # a watcher that fell behind skips samples, never holds the loop
                    q.get_nowait()
                q.put_nowait(current)

    def watch(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=SAMPLES_KEPT)
        self._watchers.add(q)
        return q

    def unwatch(self, q: asyncio.Queue) -> None:
        self._watchers.discard(q)

