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

from protocol import Done, runtime_timings
from protocol.errors import PoolError
from supervisor.telemetry.request_context import REQUEST_ID, SKIPPED_TOOLS
from supervisor.events import EventKind, EventLog, emit
from supervisor.state_dir import make_private_dir
from supervisor.scheduling.jobs import Job
from supervisor.telemetry.latency_window import LatencyWindow
from supervisor.models.health import UNHEALTHY, model_health, reason_text
from supervisor.telemetry.request_log import RequestLog, tasks_text, truncate
from supervisor.tasks import spawn

log = logging.getLogger("llm_pool.live")

SAMPLE_PERIOD_S = 1.0
SAMPLES_KEPT = 600  # ten minutes, one a second
SUPERVISOR_LINES = 2000  # the supervisor's own log lines kept for the page
LINE_CHARS = 2000


class LogTail(logging.Handler):
    """The supervisor's own log (the `llm_pool` loggers), its last lines kept in
    memory for the page and `llm-pool logs supervisor`; each line is numbered so
    a follower asks for what came after the last one it saw."""

    def __init__(self, keep: int = SUPERVISOR_LINES) -> None:
        super().__init__(level=logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self.lines: deque[tuple[int, str]] = deque(maxlen=keep)
        self.serial = 0

    def emit(self, record: logging.LogRecord) -> None:  # logging.Handler's hook: in memory, no I/O
        try:
            text = self.format(record)
        except Exception:  # a bad format argument must not lose the others
            text = f"{record.name} {record.levelname} {record.msg!r}"
        self.serial += 1
        for line in text.splitlines()[:20] or [""]:
            self.lines.append((self.serial, line[:LINE_CHARS]))

    def after(self, serial: int, limit: int) -> list[tuple[int, str]]:
        return [item for item in self.lines if item[0] > serial][-limit:]


def runtime_speeds(timings: dict) -> tuple[float | None, float | None]:
    """(prefill, decode) tokens/s from a runtime's own timings (checked again here:
    a worker is no more trusted than its runtime); None for a phase it did not time."""
    t = runtime_timings(timings)
    prefill, decode = t.get("prompt_per_second"), t.get("predicted_per_second")
    return (round(prefill, 1) if prefill and t.get("prompt_n") else None,
            round(decode, 1) if decode and t.get("predicted_n") else None)


class Activity:
    def __init__(self, engine) -> None:
        self.engine = engine
        server = engine.config.server
        state_dir = make_private_dir(engine.state_dir)  # before anything is written there
        self.requests = RequestLog(state_dir / "requests.sqlite3", server.request_log_max_rows,
                                   server.request_log_days, max_bytes=server.request_log_max_bytes)
        self.events = EventLog(state_dir / "events.sqlite3")
        self.supervisor_log = LogTail()
        self.samples: deque[dict] = deque(maxlen=SAMPLES_KEPT)
        self._tokens: dict[str, int] = {}  # output tokens streamed, per model, since start
        self._streamed: dict[str, int] = {}  # per model: the replicas' streamed_tokens at the last sample
        self._shown: dict[str, str] = {}  # per model: the state shown at the last sample (state events)
        # prompt + output tokens of finished requests per model and tenant, since start (the page's shares)
        self._tenant_tokens: dict[str, dict[str, int]] = {}
        self._errors = {"4xx": 0, "5xx": 0}  # finished requests with an error status, since start (the page's chart)
        self.latency = LatencyWindow()  # TTFT, duration and queue wait p50/p95 per model, per sample
        self._watchers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.requests.start()
        self.events.start()
        logging.getLogger("llm_pool").addHandler(self.supervisor_log)
        self._start_sampler()

    def _start_sampler(self) -> None:
        # a failure is a bug: said (tasks.watch), and the sampling goes on
        self._task = spawn(self._sample_loop(), "live-samples", what="the live samples",
                           on_failure=self._sampler_ended)

    def _sampler_ended(self, task: asyncio.Future) -> None:
        if task is self._task:  # not closed meanwhile
            self._start_sampler()

    async def close(self) -> None:
        if self._task:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        logging.getLogger("llm_pool").removeHandler(self.supervisor_log)
        await asyncio.to_thread(self.requests.close)
        await asyncio.to_thread(self.events.close)

    # -- finished requests (from Metrics, on the event loop) ---------------------------------------
    def finished(self, model: str | None, endpoint: str, status: int, job: Job | None = None,
                 done: Done | None = None, error: PoolError | None = None, tenant: str | None = None,
                 fallback_chain: str | None = None) -> None:
        """One row for the request log (in COLUMNS order). On every request's path: kept cheap.
        `fallback_chain`: what a request tried that no model served (else the job's chain says)."""
        if status >= 400:
            self._errors["5xx" if status >= 500 else "4xx"] += 1
        queued = ttft = duration = tokens_in = tokens_out = prompt = output = cached = prefill = decode = None
        if done is not None:
            usage = done.usage
            tokens_in, tokens_out = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
            cached = usage.get("cached_tokens")  # absent: the runtime did not say (never a made-up 0)
            cached = cached if type(cached) is int and cached >= 0 else None
            if done.timings:
                prefill, decode = runtime_speeds(done.timings)
            if job is not None and model in self.engine.models:
                by_tenant = self._tenant_tokens.setdefault(model, {})
                by_tenant[job.tenant] = by_tenant.get(job.tenant, 0) + tokens_in + tokens_out
        elif job is not None and job.meter is not None and job.meter.output:
            tokens_out = job.meter.output  # ended without its Done (a crash, a cut): the tokens it streamed
        if job is not None:
            now = time.monotonic()
            start = job.created_at
            duration = round((now - start) * 1000, 1)
            if job.run.submitted_at is not None:
                queued = round((job.run.submitted_at - start) * 1000, 1)
            elif error is not None:  # it never left the queue
                queued = duration
            if job.first_token_at is not None:
                ttft = round((job.first_token_at - start) * 1000, 1)
            if model in self.engine.models:  # the chart's TTFT is of streams, as the histogram's (metrics.py)
                self.latency.add(model, ttft if job.request.get("stream") is not False else None, duration, queued)
            if job.transcript is not None:  # the model has log_bodies = true
                asked = next((job.request[k] for k in ("messages", "prompt", "input") if k in job.request), None)
                prompt = truncate(json.dumps(asked, ensure_ascii=False))
                output = truncate("".join(job.transcript))
        self.requests.append((time.time(), (model or "")[:200], endpoint, status, error and error.code.value,
                              error and error.message, queued, ttft, duration, tokens_in, tokens_out, prompt, output,
                              job.tenant if job is not None else tenant, cached, prefill, decode,
                              REQUEST_ID.get(), job.run.replica.name if job is not None and job.run.replica else None,
                              job.admitted.chain.text() if job is not None and job.admitted.chain
                              and job.admitted.chain.fell_back else fallback_chain, SKIPPED_TOOLS.get(),
                              tasks_text(job.run.runtime_tasks) if job is not None else None))

    # -- live samples ----------------------------------------------------------------------------
    def sample(self) -> dict:
        models = {}
        for name, entry in self.engine.models.items():
            ex = entry.executor
            # tokens as they stream: what the replicas received since the last sample (a
            # replica set that was replaced by a new load counts from zero)
            streamed = sum(r.link.streamed_tokens for r in ex.replicas) if ex else 0
            self._tokens[name] = self._tokens.get(name, 0) + max(0, streamed - self._streamed.get(name, 0))
            self._streamed[name] = streamed
            health = model_health(entry)
            self._state_event(name, entry, health)
            models[name] = {"state": health["state"], "queue": ex.queue_depth if ex else 0,
                            "inflight": ex.runtime_inflight if ex else 0, "tokens": self._tokens[name],
                            "tenants": dict(self._tenant_tokens.get(name, {})),
                            "latency": self.latency.figures(name)}
        self.latency.forget(set(self.engine.models))
        return {"t": round(time.time(), 3), "models": models, "errors": dict(self._errors)}

    def _state_event(self, name: str, entry, health: dict) -> None:
        """A move to degraded or failed (or back) goes to the timeline and the log."""
        state, before = health["state"], self._shown.get(name)
        self._shown[name] = state
        if before == state or (before is None and state not in UNHEALTHY):
            return
        if state in UNHEALTHY:
            health["error"] = entry.error
            emit(EventKind.STATE, f"model {name} is {state}: {reason_text(health) or 'no reason recorded'}",
                 model=name, level=logging.WARNING)
        elif before in UNHEALTHY and state == "loaded":
            emit(EventKind.STATE, f"model {name} is loaded again ({health['ready']}/{health['configured']} "
                 "replicas ready)", model=name)

    def in_flight(self) -> list[dict]:
        """The requests running or queued now, oldest first, with their age."""
        now = time.monotonic()
        out = []
        for name, entry in self.engine.models.items():
            ex = entry.executor
            if ex is None:
                continue
            running = [(j, r.name) for r in ex.replicas for j in list(r.inflight.values())]
            queued = [(j, None) for j in list(ex.queue)]
            for job, replica in running + queued:
                out.append({"id": job.id, "request_id": job.request_id, "tenant": job.tenant,
                            "model": name, "endpoint": job.endpoint, "replica": replica,
                            "state": "running" if replica else "queued", "age_s": round(now - job.created_at, 1),
                            "streaming": job.first_token_at is not None})
        return sorted(out, key=lambda j: -j["age_s"])

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

