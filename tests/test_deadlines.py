"""Deadlines, predictions and fallbacks (supervisor/scheduling/deadlines.py, latency_predictor.py,
fallback_chains.py): the predictor on recorded request-log rows with an injected clock,
admission with an injected prediction, the config's loop check, then real pools on
synthetic workers (known speeds): a saturated model spills to its fallback, a crash
before the first byte is never seen by the client, a queued request whose deadline
passes leaves the queue, and a waiting stream says so (with the openai and anthropic SDKs)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from protocol.errors import ErrorCode, PoolError
from supervisor.admission.admit import Admission
from supervisor.config import ConfigError, parse_config
from supervisor.scheduling.deadlines import Prediction, Slo, request_slo, unmeetable
from supervisor.scheduling.fair_queue import FairQueue, Share
from supervisor.admission.fallback_chains import Chain
from supervisor.scheduling.jobs import Job
from supervisor.scheduling.latency_predictor import ModelPredictor
from supervisor.admission.tenants import Tenants
from tests.conftest import llama, synthetic
from tests.pool import wait_for

CHAT = {"messages": [{"role": "user", "content": "hello there"}]}


# -- the predictor, on recorded rows ----------------------------------------------------------------------

# rows as the request log holds them (ms, tokens, the runtime's speeds where it timed them)
ROWS = [
    {"queued_ms": 0.0, "ttft_ms": 100.0, "duration_ms": 1100.0, "tokens_in": 50, "tokens_out": 11},
    {"queued_ms": 900.0, "ttft_ms": 1000.0, "duration_ms": 2000.0, "tokens_in": 50, "tokens_out": 11},
    {"queued_ms": 0.0, "ttft_ms": 40.0, "duration_ms": 1040.0, "tokens_in": 200, "tokens_out": 11,
     "runtime_prefill_tps": 5000.0, "runtime_decode_tps": 10.0, "predicted_wait_ms": 300.0,
     "predicted_ttft_ms": 100.0},
]


def test_the_predictor_learns_from_recorded_rows():
    clock = iter([10.0, 11.0, 12.0, 15.5])
    p = ModelPredictor(clock=lambda: next(clock))
    for row in ROWS:
        p.observe("m/0", row, frame_bytes=400)
    assert p.last_at == 12.0 and p.observed == 3
    # service (hand-over to end): 1.1 s, 1.1 s, 1.04 s as EWMAs with weight 0.2
    assert p.service_s.value == pytest.approx(1.1 + 0.2 * (1.04 - 1.1))
    speeds = p.replicas["m/0"]
    # prefill: 50 tokens in 0.1 s twice (500/s), then the runtime's own 5000/s
    assert speeds.prefill_tps.value == pytest.approx(500 + 0.2 * (5000 - 500))
    assert speeds.tpot_s.value == pytest.approx(0.1)  # 10 tokens in 1 s, twice; then 1/10 s
    # tokens per frame byte: 50/400, 50/400, 200/400
    assert p.prompt_tokens(400) == int(400 * (0.125 + 0.2 * (0.5 - 0.125)))
    view = p.view()
    assert view["last_observed_s_ago"] == 3.5  # the clock read at the view, 15.5, against 12.0
    assert view["queue_wait_error_ms"] == {"p50": 300.0, "p90": 300.0, "samples": 1}
    assert view["ttft_error_ms"] == {"p50": 60.0, "p90": 60.0, "samples": 1}
    # 3 ahead, 1 free of 2 slots: 3 must end first, at 2 per service time
    assert p.wait_s(ahead=3, slots=2, free=1) == pytest.approx(3 * p.service_s.value / 2)
    assert p.wait_s(ahead=0, slots=2, free=1) == 0
    assert p.wait_s(ahead=0, slots=2, free=2, load_left_s=4.0) == 4.0  # a cold model waits for its load
    # hand-over to first token against prompt tokens: 0.1 s at 50 tokens twice, then 0.04 s at 200
    # (a cached prompt): the fitted line never falls with more tokens (its slope is clamped at 0)
    assert p.fastest(["m/0"], 50)[0] == pytest.approx(speeds.first_token.y)
    assert p.fastest(["m/1"], 1000) == p.fastest(["m/0"], 1000)  # a replica with no history: as the others
    assert p.fastest(["m/0", "m/1"], 50) == (p.fastest(["m/0"], 50)[0], speeds.tpot_s.value)


def test_the_first_token_line_learns_a_fixed_and_a_per_token_cost():
    p = ModelPredictor(clock=lambda: 0.0)
    for tokens in (100, 300, 500, 100, 300, 500, 100, 300, 500) * 3:  # 20 ms + 1 ms a token
        p.observe("r", {"queued_ms": 5.0, "ttft_ms": 5.0 + 20 + tokens, "duration_ms": 1000.0, "tokens_in": tokens,
                        "tokens_out": 1})
    assert p.fastest(["r"], 1000)[0] == pytest.approx(1.020, rel=1e-6)
    assert p.fastest(["r"], 0)[0] == pytest.approx(0.020, rel=1e-6)


def test_a_predictor_with_no_history_predicts_no_wait():
    p = ModelPredictor(clock=lambda: 0.0)
    assert p.wait_s(ahead=10, slots=1, free=0) == 0 and p.fastest([""], 10_000) == (0.0, None)


def test_the_queue_place_puts_higher_bands_first_and_takes_turns_within_one():
    shares = {"gold": Share(priority=1), "a": Share(), "b": Share()}
    q = FairQueue(lambda t: shares.get(t, Share()))
    for tenant, count in (("a", 4), ("b", 1), ("gold", 2)):
        for _ in range(count):
            q.push(Job("m", dict(CHAT), 60, tenant=tenant))
    assert q.ahead("gold") == 2  # only its own band's two
    assert q.ahead("b") == 2 + 1 + 2  # gold's, its own one, two turns of a's (a ties and came first)
    assert q.ahead("c") == 2 + 1 + 1  # a new tenant: gold's, then a turn of each (its counter is not higher)
    jobs = list(q)
    assert q.position(jobs[0]) == 2 and q.position(Job("m", dict(CHAT), 60)) is None


# -- deadlines at admission, with an injected prediction ------------------------------------------------

def test_a_request_s_deadline_comes_from_its_header_then_its_tenant_then_its_model():
    model = SimpleNamespace(slo_ttft_ms=5000.0, slo_tpot_ms=None)
    tenant = SimpleNamespace(slo_ttft_ms=None, slo_tpot_ms=80.0)
    assert request_slo({}, tenant, model) == Slo(5000.0, 80.0)
    assert request_slo({"x-slo-ttft-ms": "250"}, tenant, model) == Slo(250.0, 80.0)
    for bad in ("soon", "0", "-5", "nan", "1e12"):
        with pytest.raises(PoolError) as refused:
            request_slo({"x-slo-ttft-ms": bad}, tenant, model)
        assert refused.value.code is ErrorCode.INVALID_REQUEST and refused.value.param == "x-slo-ttft-ms"


class PredictedEngine:
    """The engine seam admission calls, with a prediction injected."""

    def __init__(self, prediction: Prediction) -> None:
        self.prediction = prediction
        self.model = SimpleNamespace(cfg=SimpleNamespace(name="m", aliases=(), slo_ttft_ms=None, slo_tpot_ms=None),
                                     executor=None)
        self.queued: list[Job] = []

    def entry(self, name):
        return self.model

    def make_job(self, entry, request, endpoint, tenant, headers=None):
        return Job("m", request, 60, tenant=tenant)

    async def prompt_tokens(self, entry, request, endpoint):
        return None

    def predict(self, entry, tenant, frame_bytes):
        return self.prediction

    def enqueue(self, entry, job, tokens=None):
        self.queued.append(job)


def test_admission_refuses_an_unmeetable_deadline_before_the_queue_and_gives_back_what_it_counted():
    cfg = parse_config({"tenants": [{"name": "a", "keys": ["k"], "rpm": 10, "tpm": 100_000}]})
    engine = PredictedEngine(Prediction(position=4, wait_s=2.0, ttft_s=2.2, tpot_s=0.05))
    pool = Admission(engine, Tenants(cfg))
    tenant = pool.tenants.by_name["a"]

    async def admit(headers):
        return await pool.admit(tenant, "m", dict(CHAT), "chat", headers)
    with pytest.raises(PoolError) as refused:
        asyncio.run(admit({"x-slo-ttft-ms": "1000"}))
    err = refused.value
    assert err.code is ErrorCode.DEADLINE_UNMEETABLE and err.status == 503 and err.retry_after_s == 2  # 1.2 s late
    assert engine.queued == [] and tenant.inflight == 0 and tenant.tokens.level == pytest.approx(100_000, abs=1)
    assert tenant.requests.level == pytest.approx(10, abs=0.1)  # its rpm given back too
    with pytest.raises(PoolError) as slow:
        asyncio.run(admit({"x-slo-tpot-ms": "20"}))
    assert slow.value.code is ErrorCode.DEADLINE_UNMEETABLE and "tpot" in slow.value.message
    job = asyncio.run(admit({"x-slo-ttft-ms": "3000", "x-slo-tpot-ms": "60"}))  # fits: queued, its deadline set
    assert engine.queued == [job] and job.admitted.prediction is engine.prediction
    assert job.admitted.slo_deadline == pytest.approx(job.created_at + 3.0)
    assert job.queue_deadline == job.admitted.slo_deadline
    assert not job.expired(job.created_at + 2.9) and job.expired(job.created_at + 3.0)
    plain = asyncio.run(admit({}))  # no deadline: no refusal, no expiry
    assert plain.admitted.slo_deadline is None and engine.queued[-1] is plain


def test_admission_with_a_learned_predictor_queues_until_the_next_would_be_late():
    """The real prediction (deadlines.predict) over a fair queue and a predictor taught by
    recorded rows (1 s a request): one slot, busy; each admitted request waits 1 s more."""
    from supervisor.scheduling.deadlines import predict
    from supervisor.states import ModelState, ReplicaState
    p = ModelPredictor(clock=lambda: 0.0)
    for _ in range(3):
        p.observe("m/0", {"queued_ms": 0.0, "ttft_ms": 0.0, "duration_ms": 1000.0, "tokens_in": 10, "tokens_out": 5})
    engine = PredictedEngine(None)
    tenants = Tenants(parse_config({"tenants": [{"name": "std", "keys": ["k1"]},
                                                {"name": "gold", "keys": ["k2"], "priority": 1}]}))
    queue = FairQueue(tenants.share)
    engine.model.executor = SimpleNamespace(queue=queue, replicas=[
        SimpleNamespace(state=ReplicaState.READY, capacity=1, free_slots=0, name="m/0", info={})])
    engine.model.predictor, engine.model.waiting, engine.model.state = p, [], ModelState.LOADED
    engine.predict = lambda entry, tenant, frame_bytes: predict(entry, tenant, frame_bytes, now=0.0)
    engine.enqueue = lambda entry, job, tokens=None: queue.push(job)
    pool = Admission(engine, tenants)
    tenant = tenants.by_name["std"]
    admitted = [asyncio.run(pool.admit(tenant, "m", dict(CHAT), "chat", {"x-slo-ttft-ms": "2500"}))
                for _ in range(2)]
    assert [job.admitted.prediction.wait_s for job in admitted] == [pytest.approx(1.0), pytest.approx(2.0)]
    with pytest.raises(PoolError) as late:  # a third would wait 3 s
        asyncio.run(pool.admit(tenant, "m", dict(CHAT), "chat", {"x-slo-ttft-ms": "2500"}))
    assert late.value.code is ErrorCode.DEADLINE_UNMEETABLE and late.value.retry_after_s == 1 and len(queue) == 2
    high = asyncio.run(pool.admit(tenant, "m", dict(CHAT), "chat", {"x-slo-ttft-ms": "5000"}))
    assert high.admitted.prediction.position == 2 and len(queue) == 3  # a longer deadline still fits
    gold = asyncio.run(pool.admit(tenants.by_name["gold"], "m", dict(CHAT), "chat", {"x-slo-ttft-ms": "2500"}))
    assert gold.admitted.prediction.position == 0 and gold.admitted.prediction.wait_s == pytest.approx(1.0)  # its band goes first


def test_unmeetable_says_when_it_would_fit():
    late = unmeetable("m", Slo(ttft_ms=500), Prediction(2, 3.1, 3.4, None))
    assert late.retry_after_s == 3 and "3400 ms" in late.message
    assert unmeetable("m", Slo(ttft_ms=500, tpot_ms=10), Prediction(0, 0.0, 0.2, None)) is None  # tpot unknown
    # a predictor that has run short lately adds its margin: 0.4 s predicted + 0.2 s is late for 500 ms
    assert unmeetable("m", Slo(ttft_ms=500), Prediction(0, 0.0, 0.4, None, 0.2)).retry_after_s == 1
    assert unmeetable("m", Slo(ttft_ms=500), Prediction(0, 0.0, 0.4, None, 0.05)) is None


def test_the_deadline_margin_is_the_recent_under_prediction():
    p = ModelPredictor(clock=lambda: 0.0)
    for late_ms in [0.0] * 5 + [200.0] * 5:  # half on time, half 200 ms later than predicted
        p.observe("r", {"queued_ms": 0.0, "ttft_ms": 100.0 + late_ms, "duration_ms": 500.0, "tokens_in": 10,
                        "tokens_out": 2, "predicted_ttft_ms": 100.0})
    assert p.margin_s == pytest.approx(0.2) and p.view()["deadline_margin_ms"] == 200.0
    for _ in range(256):  # then a window of predictions that run long: no margin (never below 0)
        p.observe("r", {"queued_ms": 0.0, "ttft_ms": 50.0, "duration_ms": 500.0, "tokens_in": 10, "tokens_out": 2,
                        "predicted_ttft_ms": 100.0})
    assert p.margin_s == 0.0


# -- the chains ------------------------------------------------------------------------------------------

def models(**fallbacks) -> list[dict]:
    return [synthetic(name, fallbacks=list(chain)) for name, chain in fallbacks.items()]


def test_a_loop_in_the_fallback_chains_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"a loop: a -> b -> c -> a"):
        parse_config({"models": models(a=["b"], b=["c"], c=["a"])})
    with pytest.raises(ConfigError, match=r"a loop: a -> a"):
        parse_config({"models": models(a=["a"])})
    with pytest.raises(ConfigError, match=r"'nope' is not a model"):
        parse_config({"models": models(a=["nope"])})
    looped = models(a=[], big=["a"])
    looped[0]["context_fallback"] = "big"
    with pytest.raises(ConfigError, match=r"a loop: a -> big -> a"):
        parse_config({"models": looped})
    parse_config({"models": models(a=["b", "c"], b=["c"], c=[])})  # a diamond is no loop


def test_a_reload_applies_deadlines_and_fallbacks_in_place():
    from supervisor.models.reload import diff
    old = parse_config({"models": models(a=[], b=[])})
    new = parse_config({"models": [{**synthetic("a"), "fallbacks": ["b"], "slo_ttft_ms": 500.0,
                                    "context_fallback": "b"}, synthetic("b")]})
    change = diff(old, new)
    assert sorted(change.kept) == ["a", "b"]
    assert change.changed == []


def test_a_chain_tries_fallbacks_depth_first_once_each_and_only_for_errors_another_model_helps():
    cfg = parse_config({"models": [*models(a=["b", "c"], b=["c", "d"], c=[], d=[]),
                                   {**synthetic("e"), "context_fallback": "big"}, synthetic("big")]})
    by_name = {m.name: m for m in cfg.models}
    chain = Chain("a", by_name.get)
    order = []
    err = None
    while (name := chain.next_after(err)) is not None:
        chain.attempt(name)
        order.append(name)
        err = PoolError(ErrorCode.QUEUE_FULL, "full")
        chain.failed(err)
    assert order == ["a", "b", "c", "d"] and chain.text().startswith("a (queue_full) -> b (queue_full)")
    chain = Chain("a", by_name.get)
    chain.attempt(chain.next_after(None))
    assert chain.next_after(PoolError(ErrorCode.INVALID_REQUEST, "bad")) is None  # the model's own 400 stands
    chain = Chain("e", by_name.get)
    chain.attempt(chain.next_after(None))
    assert chain.next_after(PoolError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "long")) == "big"
    chain = Chain("a", by_name.get)  # a fallback out of the tenant's scope (its 404) is skipped
    chain.attempt(chain.next_after(None))
    chain.attempt(chain.next_after(PoolError(ErrorCode.NO_HEALTHY_REPLICA, "down")))
    assert chain.next_after(PoolError(ErrorCode.MODEL_NOT_FOUND, "no such model")) == "c"


# -- end to end on synthetic workers -----------------------------------------------------------------------

def slow(name: str, **extra) -> dict:
    """One slot, about 1 s a request (10 tokens at 10/s)."""
    return synthetic(name, tps=10, tokens=10, **extra)


def row_of(pool, **match) -> dict:
    def found():
        rows = pool.http.get("/admin/requests", params={"limit": 50}).json()["requests"]
        return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)
    return wait_for(found, 10, what=f"a request-log row with {match}")


def occupy(pool, model: str, count: int) -> list[threading.Thread]:
    """`count` requests for `model` in threads; returns once they are all running or queued."""
    threads = [threading.Thread(target=pool.http.post, args=("/v1/chat/completions",),
                                kwargs={"json": {"model": model, **CHAT}}, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(m["queue_depth"] + m["runtime_inflight"] for m in pool.http.get("/admin/models").json()[
        "models"] if m["name"] == model) >= count, 10, what=f"{count} requests on {model}")
    return threads


def test_a_saturated_model_spills_deadline_requests_to_its_fallback(make_pool):
    pool = make_pool([slow("busy", fallbacks=["spare"]), synthetic("spare"), slow("lonely")])
    for model in ("busy", "busy", "lonely"):  # the predictors learn each model's service time (~1 s)
        assert pool.http.post("/v1/chat/completions", json={"model": model, **CHAT}).status_code == 200
    prediction = next(m for m in pool.http.get("/admin/models").json()["models"] if m["name"] == "busy")["prediction"]
    assert prediction["requests_observed"] >= 2 and 800 <= prediction["service_ms"] <= 3000, prediction
    workers = pool.http.get("/admin/workers").json()["workers"]
    assert next(w for w in workers if w["model"] == "busy")["prediction"]["predicted_tpot_ms"] > 50
    threads = occupy(pool, "busy", 2) + occupy(pool, "lonely", 3)  # one running, the rest queued: 2-3 s of wait
    r = pool.http.post("/v1/chat/completions", json={"model": "busy", **CHAT}, headers={"x-slo-ttft-ms": "800"})
    assert r.status_code == 200 and r.json()["model"] == "spare", r.text
    assert r.headers["x-llm-pool-served-by"] == "spare" and "x-queue-wait-predicted-ms" in r.headers
    row = row_of(pool, model="spare", status=200)
    assert row["fallback_chain"] == "busy (deadline_unmeetable) -> spare" and row["ttft_ms"] < 800, row
    # a model with no fallback: refused at once, with when it would fit; 529 on the Messages surface
    started = time.monotonic()
    r = pool.http.post("/v1/chat/completions", json={"model": "lonely", **CHAT}, headers={"x-slo-ttft-ms": "300"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_unmeetable", r.text
    assert int(r.headers["retry-after"]) >= 1 and time.monotonic() - started < 1.0
    client = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0,
                                 default_headers={"x-slo-ttft-ms": "300"})
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        client.messages.create(model="lonely", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert overloaded.value.status_code == 529 and overloaded.value.body["error"]["type"] == "overloaded_error"
    for t in threads:
        t.join(30)


def test_a_queued_request_whose_deadline_passes_leaves_the_queue_unserved(make_pool):
    pool = make_pool([slow("one")])
    threads = occupy(pool, "one", 1)  # the predictor has no history yet: the deadline looks meetable
    r = pool.http.post("/v1/chat/completions", json={"model": "one", **CHAT}, headers={"x-slo-ttft-ms": "300"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_unmeetable", r.text
    assert "passed while it waited" in r.json()["error"]["message"]
    for t in threads:
        t.join(30)
    row = row_of(pool, model="one", status=503)
    # it never left the queue: no slot was taken for it (the log's queued time is then its whole time)
    assert row["error_code"] == "deadline_unmeetable" and row["ttft_ms"] is None
    assert row["queued_ms"] == row["duration_ms"] and 250 <= row["duration_ms"] < 1000, row


def kill_when_running(pool, model: str) -> None:
    pid = wait_for(lambda: next((w["pid"] for w in pool.http.get("/admin/workers").json()["workers"]
                                 if w["model"] == model and w["inflight"] == 1), None), 10,
                   what=f"a request running on {model}")
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("stream", [False, True])
def test_a_runtime_killed_before_its_first_byte_is_never_seen_by_the_client(make_pool, stream):
    pool = make_pool([synthetic("fragile", ttft_ms=60_000, retry_unstarted_on_crash=False, fallbacks=["spare"]),
                      synthetic("spare", tokens=5)], server={"stream_head_hold_s": 30})
    killer = threading.Thread(target=kill_when_running, args=(pool, "fragile"))
    killer.start()
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)
    if stream:
        with client.chat.completions.with_streaming_response.create(model="fragile", stream=True,
                                                                    **CHAT) as response:
            served_by = response.headers["x-llm-pool-served-by"]
            chunks = list(response.parse())
        assert {c.model for c in chunks} == {"spare"} and "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        raw = client.chat.completions.with_raw_response.create(model="fragile", **CHAT)
        served_by, answer = raw.headers["x-llm-pool-served-by"], raw.parse()
        assert answer.model == "spare" and answer.choices[0].message.content
    killer.join(30)
    assert served_by == "spare"
    row = row_of(pool, model="spare", status=200)
    assert row["fallback_chain"] == "fragile (runtime_crashed) -> spare", row


def test_a_waiting_stream_says_where_it_is_and_fails_with_its_family_s_error_event(make_pool):
    pool = make_pool([synthetic("one", tps=10, tokens=30), synthetic("cold", tps=10, tokens=60)],
                     server={"sse_ping_s": 0.3, "stream_head_hold_s": 0.2})
    threads = occupy(pool, "one", 1)  # ~3 s of work ahead of every stream below
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=30,
                      json={"model": "one", "stream": True, **CHAT}) as r:
        assert r.status_code == 200
        lines = iter(r.iter_lines())  # the client's read timeout bounds each wait
        queued = next(line for line in lines if line.startswith(": "))
        assert queued.startswith(": queued position=0 predicted_start_ms="), queued
        rest = list(lines)
    assert any('"content"' in line for line in rest) and "data: [DONE]" in rest, rest
    for t in threads:
        t.join(30)
    threads = occupy(pool, "one", 1)
    with httpx.stream("POST", pool.url + "/v1/messages", timeout=30, json={
            "model": "one", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}) as r:
        events = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "event: message_start" and events[1] == "event: ping" and events[-1] == "event: message_stop"
    for t in threads:
        t.join(30)
    # the SDKs: a stream that waits is served; one whose deadline passes after the head gets the error event
    threads = occupy(pool, "one", 1)
    client = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0)
    with client.messages.stream(model="one", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
    assert text and s.get_final_message().stop_reason in ("end_turn", "max_tokens")
    for t in threads:
        t.join(30)
    # a model with no history: its deadline looks meetable at admission, passes after the head went out
    threads = occupy(pool, "cold", 1)
    with pytest.raises(anthropic.APIStatusError, match="deadline") as late:
        with client.messages.stream(model="cold", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                    extra_headers={"x-slo-ttft-ms": "800"}) as s:
            list(s.text_stream)
    assert late.value.status_code == 200  # the stream had started: the error came as its event
    oai = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="deadline"):
        list(oai.chat.completions.create(model="cold", stream=True, extra_headers={"x-slo-ttft-ms": "800"}, **CHAT))
    for t in threads:
        t.join(30)


@pytest.mark.llama
def test_a_prompt_too_long_for_its_model_goes_to_its_context_fallback(llama_server_bin, tiny_gguf, make_pool):
    """llama-server refuses the prompt before its first byte (context_length_exceeded): the
    model's context_fallback serves it, on both API families."""
    pool = make_pool([llama("small", tiny_gguf, llama_server_bin, ctx=256, context_fallback="roomy"),
                      synthetic("roomy", tokens=4)])
    long = "hello " * 300
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="small", max_tokens=5, messages=[{"role": "user", "content": long}])
    assert raw.headers["x-llm-pool-served-by"] == "roomy" and raw.parse().model == "roomy"
    row = row_of(pool, model="roomy", status=200)
    assert row["fallback_chain"] == "small (context_length_exceeded) -> roomy", row
    message = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0).messages.create(
        model="small", max_tokens=5, messages=[{"role": "user", "content": long}])
    assert message.model == "roomy" and message.content[0].text
    short = client.chat.completions.create(model="small", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert short.model == "small"  # a prompt that fits stays on its model


def test_a_stream_waiting_for_a_cold_load_says_so_until_its_first_token(make_pool):
    pool = make_pool([{**synthetic("cold", tokens=3), "load_on_start": False,
                       "options": {"capacity": 1, "output_tokens": 3, "load_ms": 1500}}],
                     server={"sse_ping_s": 0.3, "stream_head_hold_s": 0.2})
    started = time.monotonic()
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=30,
                      json={"model": "cold", "stream": True, **CHAT}) as r:
        assert r.status_code == 200 and r.headers["x-llm-pool-served-by"] == "cold"
        lines = [line for line in r.iter_lines() if line]
    waiting = [line for line in lines if line.startswith(": queued position=0 predicted_start_ms=")]
    # the opening (the role chunk), pings while it loaded, then the text
    first_text = next(i for i, line in enumerate(lines) if '"content":"' in line and '"content":""' not in line)
    assert lines[0].startswith("data: ") and '"role":"assistant"' in lines[0], lines[0]
    last_wait = max(i for i, line in enumerate(lines) if line.startswith(": "))
    assert len(waiting) >= 2 and last_wait < first_text, lines
    assert lines[-1] == "data: [DONE]" and time.monotonic() - started >= 1.5
