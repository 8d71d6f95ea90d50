"""Prometheus metrics. Request outcomes, latencies and tokens are recorded as
they happen; queue, capacity, worker and memory gauges are read from the
engine at scrape time, so they can never drift from the admin view; process
figures from the engine's ProcessSampler (observe.py), never read on the loop."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from protocol import Done
from protocol.errors import ErrorCode, PoolError
from supervisor.models.health import last_load_failed
from supervisor.models.lifecycle import LOAD_BUCKETS
from supervisor.scheduling.jobs import Job
from supervisor.replicas.observe import replica_view
from supervisor.telemetry.request_log import REFUSED_ROWS_PER_S, RowRate
from supervisor.telemetry.tallies import CounterTally, HistogramTally, Tallies
from supervisor.states import ModelState, ReplicaState
from supervisor.config.tenants import UNKNOWN_KEY

LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Label values come only from these and from the configured model names: never from what a
# client sent, or /metrics would grow with every new name or path.
ENDPOINTS = {"/v1/responses": "responses", "/v1/chat/completions": "chat_completions",
             "/v1/completions": "completions", "/v1/embeddings": "embeddings", "/v1/messages": "messages",
             "/v1/messages/count_tokens": "count_tokens", "/tokenize": "tokenize", "/detokenize": "detokenize",
             "/apply-template": "apply_template", "/v1/rerank": "rerank", "/rerank": "rerank",
             "/v1/reranking": "rerank", "/reranking": "rerank", "/v1/chat/completions/input_tokens": "input_tokens",
             "/chat/completions/input_tokens": "input_tokens", "/api/chat": "ollama_chat",
             "/api/generate": "ollama_generate"}
OTHER_ENDPOINT = "other"  # a request refused before it reached an inference route
CLIENT_CLOSED = 499  # status counted for a request whose client left before its answer was complete
UNKNOWN_MODEL = "unknown"  # a model name that is not configured
OTHER_TENANT = "other"  # a tenant removed from the config by a reload while its request ran
REFUSED_REASONS = ("no_key", "unknown_key")  # llm_pool_refused_keys' label values
_ENDPOINT_LABELS = frozenset(ENDPOINTS.values())
SHOWN_STATES = tuple(dict.fromkeys(s.public.value for s in ModelState))  # the names ops see


# What planned work ended (an unload's drain, a shutdown, an operator's restart): the operator's
# own doing, counted apart too (llm_pool_requests_planned_total) so that alerts and charts can
# leave it out of the 5xx rate, which is then the pool's faults
PLANNED_CODES = frozenset({ErrorCode.MODEL_UNLOADING, ErrorCode.RUNTIME_RESTARTED})


class Metrics:
    def __init__(self, engine, on_finished=None) -> None:
        self.engine = engine
        self.on_finished = on_finished  # called with each finished request too (the request log)
        self.registry = CollectorRegistry(auto_describe=True)
        # what every request adds: plain numbers, made Prometheus families when scraped (tallies.py)
        self.requests = CounterTally("llm_pool_requests", "Inference requests by model, endpoint and HTTP status",
                                     ["model", "endpoint", "status"])
        self.ttft = HistogramTally("llm_pool_time_to_first_token_seconds",
                                   "Admission to first token, of streamed answers (a whole answer has none)",
                                   ["model"], LATENCY_BUCKETS)
        self.latency = HistogramTally("llm_pool_request_duration_seconds", "Admission to last token",
                                      ["model"], LATENCY_BUCKETS)
        self.tokens = CounterTally("llm_pool_generated_tokens", "Tokens generated", ["model"])
        self.planned = CounterTally("llm_pool_requests_planned", "Of llm_pool_requests, those that planned work "
                                    "ended (an unload's drain, a shutdown, an operator's restart)",
                                    ["model", "endpoint", "status"])
        # by tenant (label values: configured tenant names only)
        self.tenant_requests = CounterTally("llm_pool_tenant_requests", "Inference requests by tenant, model and "
                                            "HTTP status", ["tenant", "model", "status"])
        self.tenant_tokens = CounterTally("llm_pool_tenant_tokens", "Tokens served by tenant, model and kind "
                                          "(prompt, output)", ["tenant", "model", "kind"])
        self.tenant_queue_wait = HistogramTally("llm_pool_tenant_queue_wait_seconds", "Admission to hand-over to "
                                                "a worker, by tenant", ["tenant", "model"], LATENCY_BUCKETS)
        self.refused_keys = CounterTally("llm_pool_refused_keys", "/v1/ requests refused for their API key (401), "
                                         "by reason (no_key, unknown_key); the request log holds at most "
                                         f"{REFUSED_ROWS_PER_S} of them a second", ["reason"])
        for reason in REFUSED_REASONS:  # both shown from the start, at 0
            self.refused_keys.inc((reason,), 0)
        self.registry.register(Tallies(self.requests, self.ttft, self.latency, self.tokens, self.planned,
                                       self.tenant_requests, self.tenant_tokens, self.tenant_queue_wait,
                                       self.refused_keys))
        self.loop_lag = Gauge("llm_pool_event_loop_lag_seconds", "How late the supervisor's event loop woke, "
                              "last measure (supervisor/telemetry/loop_lag.py)", registry=self.registry)
        self.loop_lags = Histogram("llm_pool_event_loop_lag_distribution_seconds", "How late the supervisor's "
                                   "event loop woke, every measure", buckets=LAG_BUCKETS, registry=self.registry)
        self._refused_rows = RowRate(REFUSED_ROWS_PER_S)
        self._refused_unlogged = 0  # refusals left out of the request log since the last one in it
        self.registry.register(_EngineCollector(engine))

    def lag(self, seconds: float) -> None:
        """One measure of the event loop's lag."""
        self.loop_lag.set(seconds)
        self.loop_lags.observe(seconds)

    def key_refused(self, path: str, error: PoolError, tenant: str | None) -> None:
        """A /v1/ request refused for its key (the HTTP edge's on_key_refused; `tenant` is
        UNKNOWN_KEY for a key no tenant holds, None with no key): counted, every one, and
        logged at most REFUSED_ROWS_PER_S a second. The next row logged says how many
        were left out before it."""
        self.refused_keys.inc(("no_key" if tenant is None else "unknown_key",))
        logged = self._refused_rows.take()
        if logged and self._refused_unlogged:
            error = PoolError(error.code, f"{error.message} (and {self._refused_unlogged} more refused for their "
                              "key since the last such row, not logged: see llm_pool_refused_keys_total)")
            self._refused_unlogged = 0
        elif not logged:
            self._refused_unlogged += 1
        self.request(None, path, error.status, error=error, tenant=tenant, logged=logged)

    def request(self, model: str | None, endpoint: str, status: int, job: Job | None = None,
                done: Done | None = None, error: PoolError | None = None, tenant: str | None = None,
                logged: bool = True, fallback_chain: str | None = None) -> None:
        """Count one request; `endpoint` is a label from ENDPOINTS or an inference path.
        `tenant`: who asked, when the request was refused before it had a job. `logged`:
        whether it goes to the request log too (on_finished). `fallback_chain`: the models a
        request tried that every one failed (Chain.text)."""
        if endpoint not in _ENDPOINT_LABELS:
            endpoint = ENDPOINTS.get(endpoint, OTHER_ENDPOINT)
        model = self.engine.aliases.get(model, model)  # an alias counts, and is logged, as its model
        label = self._model(model)
        status_text = str(status)
        self.requests.inc((label, endpoint, status_text))
        if error is not None and error.code in PLANNED_CODES:
            self.planned.inc((label, endpoint, status_text))
        if job is not None:
            job.counted = True
            tenant = job.tenant
            if job.run.submitted_at is not None:
                self.tenant_queue_wait.observe((self._tenant(tenant), label), job.run.submitted_at - job.created_at)
        if tenant is not None and tenant != UNKNOWN_KEY:  # labels: configured names only
            self.tenant_requests.inc((self._tenant(tenant), label, status_text))
        if logged and self.on_finished is not None:
            self.on_finished(model, endpoint, status, job, done, error, tenant, fallback_chain)

    def client_gone(self, job: Job, endpoint: str) -> None:
        """The client left before its answer was complete: counted, and logged, as
        499 (the usual "client closed request"), unless an outcome was counted first."""
        if not job.counted:
            self.request(job.model, endpoint, CLIENT_CLOSED, job)

    def job_done(self, job: Job, done: Done, endpoint: str) -> None:
        self.request(job.model, endpoint, 200, job, done)
        self.engine.learn(job, done)  # the model's latency predictor
        now = time.monotonic()
        model = (self._model(job.model),)
        # a whole answer's first token is its last on a runtime that answers whole (llama-server):
        # only a stream has a first token for the client, so only streams make the TTFT histogram
        if job.first_token_at is not None and job.request.get("stream") is not False:
            self.ttft.observe(model, job.first_token_at - job.created_at)
        self.latency.observe(model, now - job.created_at)
        output = int(done.usage.get("output_tokens", 0))
        self.tokens.inc(model, output)
        tenant = self._tenant(job.tenant)
        self.tenant_tokens.inc((tenant, model[0], "prompt"), int(done.usage.get("input_tokens", 0)))
        self.tenant_tokens.inc((tenant, model[0], "output"), output)

    def _tenant(self, name: str) -> str:
        return name if name in self.engine.tenants.by_name else OTHER_TENANT

    def _model(self, name: str | None) -> str:
        return name if name in self.engine.models else UNKNOWN_MODEL

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        labels = ["model"]
        queue = GaugeMetricFamily("llm_pool_queue_depth", "Jobs waiting in the model's queue", labels=labels)
        inflight = GaugeMetricFamily("llm_pool_inflight", "Jobs handed to workers", labels=labels)
        configured = GaugeMetricFamily("llm_pool_configured_capacity", "Configured target_inflight over replicas",
                                       labels=labels)
        effective = GaugeMetricFamily("llm_pool_effective_capacity",
                                      "min(configured, runtime capability) over ready replicas", labels=labels)
        loaded = GaugeMetricFamily("llm_pool_model_loaded", "1 when the model is loaded (degraded too)",
                                   labels=labels)
        # one series per (model, state) that can be shown, 1 for the current one (model_health.derived_state)
        shown = GaugeMetricFamily("llm_pool_model_state", "1 for the model's current state", labels=["model", "state"])
        ready = GaugeMetricFamily("llm_pool_model_replicas_ready", "Ready replicas of the model", labels=labels)
        # an unload does not mend a failed load: the alert on it holds until a load succeeds
        load_failed = GaugeMetricFamily("llm_pool_model_last_load_failed", "1 when the model is unloaded and its "
                                        "last load failed (until a load succeeds)", labels=labels)
        rlabels = ["model", "replica"]
        up = GaugeMetricFamily("llm_pool_worker_up", "1 when the replica is ready", labels=rlabels)
        restarts = CounterMetricFamily("llm_pool_worker_restarts", "Replica restarts, by reason: crash (a fault), "
                                       "planned (an operator's restart)", labels=[*rlabels, "reason"])
        crashes = CounterMetricFamily("llm_pool_worker_crashes", "Unplanned worker exits, by who ended it: pool "
                                      "(killed by the pool: malformed frames, no heartbeat, a cancel not honoured), "
                                      "outside (a signal from outside the pool), self (it exited with a code)",
                                      labels=[*rlabels, "by"])
        bad = CounterMetricFamily("llm_pool_protocol_errors", "Malformed frames from the replica", labels=rlabels)
        rss = GaugeMetricFamily("llm_pool_process_rss_bytes", "Resident memory per process",
                                labels=["model", "replica", "process"])
        sampler = self.engine.sampler  # process figures: its last sample (or a Ray actor's last view)
        if sampler.sample.supervisor_rss is not None:
            rss.add_metric(["", "", "supervisor"], sampler.sample.supervisor_rss)
        routed = CounterMetricFamily("llm_pool_routing_decisions", "Replica choices by the decision that made "
                                     "them (prefix_hit, session, balance_fallback, least_inflight)",
                                     labels=[*rlabels, "decision"])
        prompt = CounterMetricFamily("llm_pool_prompt_tokens", "Prompt tokens the replica's runtime reported",
                                     labels=rlabels)
        cached = CounterMetricFamily("llm_pool_cached_prompt_tokens", "Of those, served from its prompt cache",
                                     labels=rlabels)
        hit_ratio = GaugeMetricFamily("llm_pool_prompt_cache_hit_ratio", "cached / prompt tokens, since the "
                                      "model was loaded", labels=rlabels)
        matched = CounterMetricFamily("llm_pool_prefix_matches", "Prefix-routing matches per replica, by the "
                                      "index that judged them (exact: the engine's KV events; approximate; "
                                      "approximate_fallback: exact wanted, no token ids)", labels=[*rlabels, "index"])
        kv_blocks = GaugeMetricFamily("llm_pool_kv_index_blocks", "Engine blocks the exact prefix index holds",
                                      labels=rlabels)
        kv_resets = CounterMetricFamily("llm_pool_kv_index_resets", "Gaps in the engine's KV events (the exact "
                                        "index started over)", labels=rlabels)
        tokenizer = self.engine.tokenizer
        tok_calls = CounterMetricFamily("llm_pool_tokenize_calls", "Prompts tokenized for the exact prefix index")
        tok_calls.add_metric([], tokenizer.calls)
        tok_failed = CounterMetricFamily("llm_pool_tokenize_failures", "Of those, failed or timed out (routed by "
                                         "the approximate index)")
        tok_failed.add_metric([], tokenizer.failures)
        tok_seconds = CounterMetricFamily("llm_pool_tokenize_seconds", "Time spent tokenizing prompts")
        tok_seconds.add_metric([], tokenizer.seconds)
        for name, entry in self.engine.models.items():
            view = self.engine.model_view(entry)
            queue.add_metric([name], view["queue_depth"])
            inflight.add_metric([name], view["runtime_inflight"])
            configured.add_metric([name], view["configured_target_inflight"])
            effective.add_metric([name], view["effective_target_inflight"])
            loaded.add_metric([name], 1 if view["state"] in ("loaded", "degraded") else 0)
            for state in SHOWN_STATES:
                shown.add_metric([name, state], 1 if view["state"] == state else 0)
            ready.add_metric([name], view["ready"])
            load_failed.add_metric([name], 1 if last_load_failed(entry) else 0)
            for r in entry.executor.replicas if entry.executor else []:
                key = [name, str(r.index)]
                up.add_metric(key, 1 if r.state is ReplicaState.READY else 0)
                restarts.add_metric([*key, "crash"], r.restarts - r.planned_restarts)
                restarts.add_metric([*key, "planned"], r.planned_restarts)
                for by in ("pool", "outside", "self"):
                    crashes.add_metric([*key, by], r.crashes.get(by, 0))
                bad.add_metric(key, r.link.protocol_errors)
                routing = entry.executor.choice.replica_view(r)
                for decision, count in routing["decisions"].items():
                    routed.add_metric([*key, decision], count)
                prompt.add_metric(key, routing["prompt_tokens"])
                cached.add_metric(key, routing["cached_tokens"])
                if routing["cache_hit_ratio"] is not None:
                    hit_ratio.add_metric(key, routing["cache_hit_ratio"])
                for index, count in (routing.get("prefix_matches") or {}).items():
                    matched.add_metric([*key, index], count)
                if kv := routing.get("kv_index"):
                    kv_blocks.add_metric(key, kv["blocks"])
                    kv_resets.add_metric(key, kv["resets"])
                by_process: dict[str, int] = {}  # summed per process name: one series each
                view = replica_view(sampler, r)
                if view and view.get("rss_bytes") is not None:
                    by_process["worker"] = view["rss_bytes"]
                    for child in view["children"]:
                        by_process[child["name"]] = by_process.get(child["name"], 0) + child["rss_bytes"]
                for process, value in by_process.items():
                    rss.add_metric([*key, process], value)
        yield from (queue, inflight, configured, effective, loaded, shown, ready, load_failed, up, restarts, crashes,
                    bad, rss, routed, prompt, cached, hit_ratio, matched, kv_blocks, kv_resets, tok_calls, tok_failed, tok_seconds)
        yield from self._lifecycle()

    def _lifecycle(self):
        engine = self.engine
        loads = CounterMetricFamily("llm_pool_model_loads", "Model loads by reason", labels=["reason"])
        for reason, count in engine.loads.items():
            loads.add_metric([reason], count)
        evictions = CounterMetricFamily("llm_pool_model_evictions", "Idle models unloaded to make room")
        evictions.add_metric([], engine.evictions)
        swaps = CounterMetricFamily("llm_pool_model_swaps", "Loads that evicted another model first")
        swaps.add_metric([], engine.swaps)
        durations = engine.load_durations
        buckets = [(str(b), n) for b, n in zip(LOAD_BUCKETS, durations.bucket_counts)]
        load_time = HistogramMetricFamily("llm_pool_model_load_duration_seconds", "Load start to ready",
                                          buckets=[*buckets, ("+Inf", durations.count)], sum_value=durations.total_s)
        yield from (loads, evictions, swaps, load_time)
