"""Tenants: keys, scopes, limits and fair shares. The table and its windows
as pure unit tests; then real pools (synthetic workers): identity and scope,
rpm with the openai SDK's own retry, tpm, max_inflight, a flood by one key
while another key is served at the next free slot, and a reload that changes
a weight without touching a worker."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
import tomli_w

from protocol.errors import ErrorCode, PoolError
from supervisor.admission.admit import DEFAULT_OUTPUT_RESERVE, output_reserve
from supervisor.config import ConfigError, parse_config
from supervisor.shapes.openai import MAX_OUTPUT_TOKENS
from supervisor.admission.tenants import Tenants, Window, duration
from tests.conftest import synthetic
from tests.test_cli import cli, table_rows
from tests.procs import wait_for

ADMIN = "admin-secret"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def key(k: str) -> dict:
    return {"Authorization": f"Bearer {k}"}


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


# -- the table, pure ---------------------------------------------------------------------------------------
def test_config_refuses_what_it_cannot_honour(monkeypatch):
    monkeypatch.delenv("TEAM_X_KEY", raising=False)
    cases = [
        ({"tenants": [{"name": "a b", "keys": ["k"]}]}, "tenant 'a b': key 'name'"),
        ({"tenants": [{"name": "a", "keys": ["k"], "colour": 1}]}, "tenant 'a': key 'colour'"),
        ({"tenants": [{"name": "a"}]}, "tenant 'a': key 'keys': a tenant needs at least one key"),
        ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "a", "keys": ["j"]}]}, "duplicate tenant name"),
        ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]}]}, "a key names one tenant"),
        ({"server": {"admin_key": "k"}, "tenants": [{"name": "a", "keys": ["k"]}]}, "the admin key is not"),
        ({"tenants": [{"name": "a", "key_env": ["TEAM_X_KEY"]}]}, "TEAM_X_KEY is not set"),
        ({"tenants": [{"name": "a", "keys": ["k"], "weight": 0}]}, "tenant 'a': key 'weight'"),
        ({"tenants": [{"name": "a", "keys": ["k"], "rpm": -1}]}, "tenant 'a': key 'rpm'"),
    ]
    for raw, message in cases:
        with pytest.raises(ConfigError) as refused:
            parse_config(raw, source="pool.toml")
        assert str(refused.value).startswith("pool.toml: ") and message in str(refused.value), str(refused.value)
        assert "'k'" not in str(refused.value)  # a key is never shown


def test_keys_name_their_tenant_and_the_admin_key_is_not_one(monkeypatch):
    monkeypatch.setenv("TEAM_B_KEY", "sk-b")
    cfg = parse_config({"server": {"api_key": "sk-d", "admin_key": ADMIN},
                        "tenants": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "key_env": ["TEAM_B_KEY"]}]})
    tenants = Tenants(cfg)
    assert tenants.for_key(b"sk-a").name == "a"
    assert tenants.for_key(b"sk-b").name == "b"
    assert tenants.for_key(b"sk-d").name == "default"
    assert tenants.for_key(ADMIN.encode()) is None
    assert tenants.for_key(b"sk-") is None and tenants.for_key(b"") is None
    assert "sk-a" not in repr(cfg.tenants[0])
    # without [[tenants]], the admin key may still call /v1/ as the default tenant (as before)
    legacy = Tenants(parse_config({"server": {"api_key": "sk-d", "admin_key": ADMIN}}))
    assert legacy.for_key(ADMIN.encode()).name == "default" and not legacy.configured


def test_a_refused_tenant_config_withholds_nothing_and_a_valid_one_withholds_its_key_env(monkeypatch):
    """Tenants.apply changes nothing on a config error, the environment workers are denied
    included (it once withheld a tenant's key_env before a later tenant's key was refused)."""
    from supervisor.replicas.process import withheld_env

    monkeypatch.setenv("TEAM_SET_KEY", "sk-set")
    # the admin key from the command line or the environment: the config cannot check it
    tenants = Tenants(parse_config({"tenants": [{"name": "a", "keys": ["sk-a"]}]}), admin_key=ADMIN)
    bad = parse_config({"tenants": [{"name": "b", "key_env": ["TEAM_SET_KEY"]},
                                    {"name": "c", "keys": [ADMIN]}]})
    with pytest.raises(ConfigError, match="the admin key is not a tenant key"):
        tenants.apply(bad)
    assert "TEAM_SET_KEY" not in withheld_env() and set(tenants.by_name) == {"a", "default"}
    tenants.apply(parse_config({"tenants": [{"name": "b", "key_env": ["TEAM_SET_KEY"]}]}))
    assert "TEAM_SET_KEY" in withheld_env() and tenants.for_key(b"sk-set").name == "b"
    # a model's own api_key_env reaches its worker; another model's, or the pool's keys, never
    assert withheld_env({"KEY_A", "KEY_B"}, "KEY_A") >= {"KEY_B", "TEAM_SET_KEY", "LLM_POOL_API_KEY"}
    assert "KEY_A" not in withheld_env({"KEY_A", "KEY_B"}, "KEY_A")


def test_scope_globs_names_and_aliases():
    tenants = Tenants(parse_config({"tenants": [{"name": "a", "keys": ["k"], "models": ["small-*", "gpt-4o"]}]}))
    spec = tenants.by_name["a"].spec
    assert spec.may_use(("small-1",))
    assert spec.may_use(("llama", "gpt-4o"))  # allowed by an alias
    assert not spec.may_use(("big",))
    assert tenants.by_name["default"].spec.may_use(("anything",))


def test_window_refills_over_a_minute_and_is_charged_after_the_fact():
    w = Window(60, now=0.0)
    for _ in range(60):
        assert w.wait_s(1, now=0.0) == 0
        w.level -= 1
    assert w.wait_s(1, now=0.0) == pytest.approx(1.0)
    assert w.wait_s(1, now=0.5) == pytest.approx(0.5)
    assert w.wait_s(1, now=1.0) == 0
    w = Window(60, now=0.0)
    w.charge(30, now=0.0)  # tokens counted after the fact
    assert w.wait_s(40, now=0.0) == pytest.approx(10.0)
    w.charge(-10, now=0.0)  # given back
    assert w.reset_s(now=0.0) == pytest.approx(20.0)  # full again: 60 - 40
    assert [duration(s) for s in (0.12, 1.5, 360)] == ["120ms", "1.5s", "6m0s"]


def test_what_can_be_owed_is_one_window_so_no_wait_is_longer_than_a_minute():
    """Usage counted after the fact far past a reserve empties the window, no further: the
    waits (Retry-After, x-ratelimit-reset-*) stay within its 60 s (issue 33: 11999999999999938 s)."""
    w = Window(5000, now=0.0)
    w.charge(10**18, now=0.0)
    assert w.level == 0
    assert w.wait_s(5000, now=0.0) == pytest.approx(60.0) and w.reset_s(now=0.0) == pytest.approx(60.0)
    assert w.wait_s(1, now=30.0) == 0  # half a minute on: half the window back
    # through a tenant: a runaway request's usage, then a reload that lowers tpm below what was used
    tenants = Tenants(parse_config({"tenants": [{"name": "a", "keys": ["k"], "tpm": 5000, "rpm": 10}]}))
    a = tenants.by_name["a"]
    held = a.reserve_tokens(100)
    a.charge_tokens(10**18 - held)
    with pytest.raises(PoolError) as refused:
        a.reserve_tokens(5000)
    assert refused.value.retry_after_s == 60
    assert dict(a.limit_headers())[b"x-ratelimit-reset-tokens"] in (b"1m0s", b"60s")
    a.charge_tokens(-5000)  # given back: full again
    a.reserve_tokens(4000)
    tenants.apply(parse_config({"tenants": [{"name": "a", "keys": ["k"], "tpm": 100, "rpm": 10}]}))
    assert 59 < a.tokens.reset_s(time.monotonic()) <= 60  # 4000 used of 100 a minute: owes the 100


def test_a_reserve_never_exceeds_the_window():
    """tpm 5000 and max_tokens 10**18: the reserve holds the whole window, not 10**18 of it, and
    settles against what it held."""
    a = Tenants(parse_config({"tenants": [{"name": "a", "keys": ["k"], "tpm": 5000}]})).by_name["a"]
    assert a.reserve_tokens(10**18) == 5000
    headers = dict(a.limit_headers())
    assert headers[b"x-ratelimit-remaining-tokens"] == b"0"
    assert headers[b"x-ratelimit-reset-tokens"] in (b"1m0s", b"60s")
    with pytest.raises(PoolError) as refused:
        a.reserve_tokens(10)
    assert refused.value.retry_after_s == 1  # 10 tokens at 5000 a minute
    a.charge_tokens(12 - 5000)  # it used 12: the rest of what it held comes back
    assert a.reserve_tokens(4900) == 4900
    assert Tenants(parse_config({})).default().reserve_tokens(10**18) == 0  # no tpm: nothing held


def test_limits_refuse_with_retry_after_and_a_reload_keeps_what_was_used():
    cfg = parse_config({"tenants": [{"name": "a", "keys": ["k"], "rpm": 2, "max_inflight": 5}]})
    tenants = Tenants(cfg)
    a = tenants.by_name["a"]
    a.admit()
    a.admit()
    with pytest.raises(PoolError) as refused:
        a.admit()
    assert refused.value.code is ErrorCode.RATE_LIMIT_EXCEEDED and refused.value.status == 429
    assert 1 <= refused.value.retry_after_s <= 30
    tenants.apply(parse_config({"tenants": [{"name": "a", "keys": ["k"], "rpm": 3, "max_inflight": 2}]}))
    assert tenants.by_name["a"] is a and a.inflight == 2  # same state: the requests in flight still count
    with pytest.raises(PoolError, match="max_inflight"):
        a.admit()
    a.release()
    a.admit()  # rpm 3 with 2 used: one more
    headers = dict(a.limit_headers())
    assert headers[b"x-ratelimit-limit-requests"] == b"3" and headers[b"x-ratelimit-remaining-requests"] == b"0"


def test_tpm_reserves_the_most_output_and_settles_to_what_was_used():
    a = Tenants(parse_config({"tenants": [{"name": "a", "keys": ["k"], "tpm": 100}]})).by_name["a"]
    assert output_reserve({"max_tokens": 40}) == 40
    assert output_reserve({"max_completion_tokens": 7}) == 7 and output_reserve({"max_output_tokens": 9}) == 9
    assert output_reserve({}) == output_reserve({"max_tokens": True}) == DEFAULT_OUTPUT_RESERVE
    a.reserve_tokens(60)  # prompt + max output: held at admission
    assert dict(a.limit_headers())[b"x-ratelimit-remaining-tokens"] == b"40"
    with pytest.raises(PoolError) as refused:  # 40 left: a second reserve of 60 does not fit
        a.reserve_tokens(60)
    assert refused.value.code is ErrorCode.RATE_LIMIT_EXCEEDED and "reserves 60 tokens" in refused.value.message
    assert 1 <= refused.value.retry_after_s <= 13  # 20 tokens at 100 a minute: about 12 s
    a.charge_tokens(15 - 60)  # the first request used 15: the rest comes back
    a.reserve_tokens(60)  # 85 left (and a little refill): fits
    # a request larger than the whole window goes in once the window is full, never before
    b = Tenants(parse_config({"tenants": [{"name": "b", "keys": ["k"], "tpm": 100}]})).by_name["b"]
    b.reserve_tokens(500)
    with pytest.raises(PoolError):
        b.reserve_tokens(1)


# -- real pools ---------------------------------------------------------------------------------------------
def tenants_pool(make_pool, models, tenants, env=None, **server):
    return make_pool(models, server={"api_key": "sk-default", "admin_key": ADMIN, **server}, tenants=tenants,
                     env=env)


def test_identity_scope_and_model_list(make_pool):
    pool = tenants_pool(make_pool, [synthetic("syn-a", tokens=2, aliases=["gpt-a"]), synthetic("syn-b", tokens=2)],
                        [{"name": "team-a", "keys": ["sk-a"], "models": ["syn-a*"]},
                         {"name": "team-b", "key_env": ["TEAM_B_KEY"]}],
                        env={"TEAM_B_KEY": "sk-b-from-env"})
    http = pool.http
    for k, model in (("sk-a", "syn-a"), ("sk-a", "gpt-a"), ("sk-b-from-env", "syn-b"), ("sk-default", "syn-b")):
        r = http.post("/v1/chat/completions", json=chat(model), headers=key(k))
        assert r.status_code == 200, (k, model, r.text)
    # out of scope: exactly the answer for a model that does not exist
    hidden = http.post("/v1/chat/completions", json=chat("syn-b"), headers=key("sk-a"))
    absent = http.post("/v1/chat/completions", json=chat("syn-c"), headers=key("sk-a"))
    assert hidden.status_code == absent.status_code == 404
    assert hidden.json()["error"] == {**absent.json()["error"], "message": absent.json()["error"]["message"]
                                      .replace("syn-c", "syn-b")}
    assert hidden.json()["error"]["code"] == "model_not_found"
    listed = {m["id"] for m in http.get("/v1/models", headers=key("sk-a")).json()["data"]}
    assert listed == {"syn-a", "gpt-a"}
    listed = {m["id"] for m in http.get("/v1/models", headers=key("sk-b-from-env")).json()["data"]}
    assert listed == {"syn-a", "gpt-a", "syn-b"}
    # keys: unknown -> invalid_api_key; none -> unauthorized; the admin key is not a tenant key
    for given, code in ((key("sk-nope"), "invalid_api_key"), ({}, "unauthorized"), (ADMIN_H, "invalid_api_key")):
        r = http.post("/v1/chat/completions", json=chat("syn-a"), headers=given)
        assert r.status_code == 401 and r.json()["error"]["code"] == code, r.text
    # the key_env value is in no argv and no worker's environment
    procs = [psutil.Process(pool.proc.pid), *pool.descendants()]
    assert procs[1:], "the workers should be running"
    for proc in procs:
        assert not any("sk-b-from-env" in arg for arg in proc.cmdline())
    for proc in procs[1:]:
        assert "TEAM_B_KEY" not in proc.environ() and "sk-b-from-env" not in proc.environ().values()
    assert "sk-b-from-env" not in pool.log()
    # attribution: the request log and the metrics name the tenant
    def team_a_rows():
        return http.get("/admin/requests", params={"tenant": "team-a"}, headers=ADMIN_H).json()["requests"]
    wait_for(lambda: len(team_a_rows()) == 4, 5, what="team-a's rows (2 served, 2 not found)")
    assert {r["tenant"] for r in team_a_rows()} == {"team-a"}
    done = cli("requests", "-o", "wide", "--tenant", "team-b", url=pool.url, env={"LLM_POOL_ADMIN_KEY": ADMIN})
    assert done.returncode == 0, done.stderr
    assert [(r["TENANT"], r["MODEL"]) for r in table_rows(done.stdout)] == [("team-b", "syn-b")]
    metrics = http.get("/metrics").text
    assert 'llm_pool_tenant_requests_total{model="syn-a",status="200",tenant="team-a"} 2.0' in metrics
    # the 401s are logged: an unknown key (the admin key is one here) shows as such, never as the key
    unknown = http.get("/admin/requests", params={"tenant": "(unknown key)"}, headers=ADMIN_H)
    assert [(r["status"], r["error_code"]) for r in unknown.json()["requests"]] == [(401, "invalid_api_key")] * 2
    keyless = [r for r in http.get("/admin/requests", params={"status": "error"}, headers=ADMIN_H).json()["requests"]
               if r["error_code"] == "unauthorized"]
    assert [r["tenant"] for r in keyless] == [None]
    assert "sk-nope" not in unknown.text and ADMIN not in unknown.text
    labels = set(re.findall(r'tenant="([^"]*)"', metrics))
    assert labels and labels <= {"team-a", "team-b", "default"}, labels  # configured names only
    assert 'llm_pool_tenant_requests_total{model="syn-b",status="404",tenant="team-a"} 1.0' in metrics
    assert 'llm_pool_tenant_tokens_total{kind="output",model="syn-b",tenant="team-b"}' in metrics
    assert 'llm_pool_tenant_queue_wait_seconds_count{model="syn-a",tenant="team-a"} 2.0' in metrics


def test_rpm_429_with_headers_and_the_openai_sdks_retry_succeeds(make_pool):
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=1)],
                        [{"name": "metered", "keys": ["sk-m"], "rpm": 60}])
    first = pool.http.post("/v1/chat/completions", json=chat("syn"), headers=key("sk-m"))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "60"
    assert first.headers["x-ratelimit-remaining-requests"] == "59"
    assert first.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
    refused = None
    for _ in range(70):
        r = pool.http.post("/v1/chat/completions", json=chat("syn"), headers=key("sk-m"))
        if r.status_code == 429:
            refused = r
            break
        assert r.status_code == 200, r.text
    assert refused is not None, "60 requests per minute should run out within 70 requests"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # the real SDK: its own retry waits Retry-After and then gets through
    # (the window refills a request a second: calls go on until one of them meets the limit)
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="sk-m", max_retries=3)
    for _ in range(10):
        answer = client.chat.completions.with_raw_response.create(model="syn",
                                                                  messages=[{"role": "user", "content": "x"}])
        assert answer.parse().choices[0].message.content  # every call succeeds...
        if answer.retries_taken:
            break
    assert answer.retries_taken >= 1  # ...one of them after a 429 and the SDK's own retry


def test_tpm_and_max_inflight(make_pool):
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=200, target_inflight=4, capacity=4, tps=100)],
                        [{"name": "tokens", "keys": ["sk-t"], "tpm": 120},
                         {"name": "narrow", "keys": ["sk-n"], "max_inflight": 1}])
    # tpm: each answer is 50 tokens; the window runs dry within a few requests
    statuses = []
    for _ in range(6):
        r = pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=50), headers=key("sk-t"))
        statuses.append(r.status_code)
        assert r.headers["x-ratelimit-limit-tokens"] == "120"
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "tpm" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
            break
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    # max_inflight: one streaming request holds the tenant's only place; the next is refused
    with httpx.stream("POST", pool.url + "/v1/chat/completions", json=chat("syn", stream=True),
                      headers=key("sk-n"), timeout=30) as running:
        assert running.status_code == 200
        r = pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=1), headers=key("sk-n"))
        assert r.status_code == 429 and "max_inflight" in r.json()["error"]["message"], r.text
        for _ in running.iter_bytes():
            pass
    wait_for(lambda: pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=1),
                                    headers=key("sk-n")).status_code == 200, 10, what="the place freed")


def reset_seconds(text: str) -> float:
    """x-ratelimit-reset-* ('120ms', '1.5s', '6m0s') in seconds."""
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    minutes, _, rest = text.rpartition("m")
    return int(minutes or 0) * 60 + float(rest[:-1])


def test_absurd_output_limits_are_refused_and_a_huge_reserve_waits_a_minute_at_most(make_pool):
    """Issue 33: tpm 5000 and max_tokens 10**18 was admitted, and the next request was told to
    retry in 11999999999999938 s. Now it is a 400 naming the field; a huge max_tokens under the cap
    holds the whole window, no more, and the next request waits a minute at most."""
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=2000, tps=100)],
                        [{"name": "t", "keys": ["sk-t"], "tpm": 5000}])
    r = pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=10**18), headers=key("sk-t"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    assert r.json()["error"]["param"] == "max_tokens", r.text
    assert r.headers["x-ratelimit-remaining-tokens"] == "5000"  # refused before it reserved anything
    with httpx.stream("POST", pool.url + "/v1/chat/completions", headers=key("sk-t"), timeout=30,
                      json=chat("syn", max_tokens=MAX_OUTPUT_TOKENS, stream=True)) as running:
        assert running.status_code == 200  # admitted: it holds the whole window while it runs
        r = pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=10), headers=key("sk-t"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
        assert reset_seconds(r.headers["x-ratelimit-reset-tokens"]) <= 60, r.headers


HOLD_TOKENS = 100_000  # a synthetic answer this long (500 s at 200 tokens/s) holds its slot until its client leaves


@contextlib.contextmanager
def holding(pool, k: str):
    """A streamed request of `k`'s that holds the one slot of "syn" (a HOLD_TOKENS answer) while
    the block runs: the condition a test builds a backlog behind, however slow the machine.
    Its client leaves at the end of the block, which frees the slot."""
    with httpx.stream("POST", pool.url + "/v1/chat/completions", json=chat("syn", stream=True),
                      headers=key(k), timeout=120) as held:
        assert held.status_code == 200  # headers come with the first token: it runs
        yield


def flood(pool, k: str, count: int, max_tokens: int) -> list[threading.Thread]:
    def one():
        with httpx.Client(base_url=pool.url, timeout=120) as c:
            c.post("/v1/chat/completions", json=chat("syn", max_tokens=max_tokens), headers=key(k))
    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def queue_depth(pool) -> int:
    return next(m for m in pool.http.get("/admin/models", headers=ADMIN_H).json()["models"]
                if m["name"] == "syn")["queue_depth"]


def served_order(pool, count: int) -> list[str]:
    """The tenants of the last `count` finished requests, in the order they finished."""
    rows = pool.http.get("/admin/requests", params={"limit": count}, headers=ADMIN_H).json()["requests"]
    return [r["tenant"] for r in reversed(rows)]


def test_a_flood_by_one_key_and_another_keys_request_is_served_at_the_next_free_slot(make_pool):
    """Heavy holds the one slot and floods the queue; light asks behind the flood. At the next
    free slot light runs, before all of heavy's backlog (FIFO would serve it last). The slot is
    held until the backlog and light are in the queue, so no machine is too slow to build it."""
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=HOLD_TOKENS, tps=200)],
                        [{"name": "heavy", "keys": ["sk-h"]}, {"name": "light", "keys": ["sk-l"]}])
    with ThreadPoolExecutor(1) as ex, holding(pool, "sk-h"):
        threads = flood(pool, "sk-h", 9, max_tokens=40)
        wait_for(lambda: queue_depth(pool) == 9, 60, what="heavy's backlog")
        light = ex.submit(pool.http.post, "/v1/chat/completions", json=chat("syn", max_tokens=4),
                          headers=key("sk-l"), timeout=120)
        wait_for(lambda: queue_depth(pool) == 10, 60, what="light behind heavy's backlog")
    assert light.result().status_code == 200
    for t in threads:
        t.join(120)
    order = wait_for(lambda: len(o := served_order(pool, 20)) == 11 and o, 30, what="every request in the log")
    # the held one (its client left), then light at the next free slot, then heavy's backlog
    assert order == ["heavy", "light"] + ["heavy"] * 9, order


def test_one_tenant_cannot_fill_the_queue_for_the_others(make_pool):
    """Issue 53: heavy holds the one slot and fills max_queue (4) and more: its fifth queued
    request gets 429 queue_full; light's requests still get in (under its share of the queue),
    up to its own share, and are served."""
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=HOLD_TOKENS, tps=200, max_queue=4)],
                        [{"name": "heavy", "keys": ["sk-h"]}, {"name": "light", "keys": ["sk-l"]}])
    with ThreadPoolExecutor(4) as ex, holding(pool, "sk-h"):
        threads = flood(pool, "sk-h", 4, max_tokens=4)
        wait_for(lambda: queue_depth(pool) == 4, 60, what="heavy's backlog filling the queue")
        over = pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=4), headers=key("sk-h"))
        assert over.status_code == 429 and over.json()["error"]["code"] == "queue_full", over.text
        light = [ex.submit(pool.http.post, "/v1/chat/completions", json=chat("syn", max_tokens=4),
                           headers=key("sk-l"), timeout=120) for _ in range(2)]
        wait_for(lambda: queue_depth(pool) == 6, 60, what="light's two queued beside the full queue")
        # light's share of 4 with heavy waiting too is 2: a third is refused
        third = pool.http.post("/v1/chat/completions", json=chat("syn", max_tokens=4), headers=key("sk-l"))
        assert third.status_code == 429 and "share" in third.json()["error"]["message"], third.text
    assert [f.result().status_code for f in light] == [200, 200]
    for t in threads:
        t.join(120)


def test_a_newcomer_slot_starts_a_light_tenant_beside_a_flood(make_pool):
    """target_inflight 1 on a runtime that runs 2, with newcomer_slots = 1: heavy's backlog
    never takes the second slot (heavy has a job running), light's request starts in it at once,
    while heavy's job still runs and heavy's backlog still waits. Heavy's job holds its slot
    until the test is done looking, so no machine is too slow to see it."""
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=HOLD_TOKENS, tps=200, capacity=2, newcomer_slots=1)],
                        [{"name": "heavy", "keys": ["sk-h"]}, {"name": "light", "keys": ["sk-l"]}])
    workers = lambda: pool.http.get("/admin/workers", headers=ADMIN_H).json()["workers"]  # noqa: E731
    assert workers()[0]["newcomer_slots"] == 1 and workers()[0]["capacity"] == 1
    with holding(pool, "sk-h"):  # heavy's job in the one regular slot
        threads = flood(pool, "sk-h", 3, max_tokens=40)
        wait_for(lambda: queue_depth(pool) == 3, 60, what="heavy's backlog")
        assert workers()[0]["inflight"] == 1  # the newcomer slot is not heavy's: it has a job running
        with httpx.stream("POST", pool.url + "/v1/chat/completions", json=chat("syn", max_tokens=400, stream=True),
                          headers=key("sk-l"), timeout=120) as light:
            assert light.status_code == 200
            lines = light.iter_lines()
            next(lines)  # light's first chunk: it runs now...
            # ...beside heavy's job, without waiting for it, and heavy's backlog still waits
            assert workers()[0]["inflight"] == 2 and queue_depth(pool) == 3
            assert any(line == "data: [DONE]" for line in lines)
    for t in threads:
        t.join(120)
    order = wait_for(lambda: len(o := served_order(pool, 10)) == 5 and o, 30, what="every request in the log")
    assert order == ["light"] + ["heavy"] * 4, order  # light's, done while heavy's held one ran; then heavy's


def test_reload_changes_a_weight_without_touching_a_worker(make_pool):
    tenants = [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}, {"name": "c", "keys": ["sk-c"]}]
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=HOLD_TOKENS, tps=200)], tenants)
    pids = {w["pid"] for w in pool.http.get("/admin/workers", headers=ADMIN_H).json()["workers"]}
    raw = __import__("tomllib").loads(pool.config_path.read_text())
    raw["tenants"][0]["weight"] = 3.0
    pool.config_path.write_text(tomli_w.dumps(raw))
    r = pool.http.post("/admin/reload", headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["kept"] == ["syn"], r.text
    assert {w["pid"] for w in pool.http.get("/admin/workers", headers=ADMIN_H).json()["workers"]} == pids
    # c holds the one slot while a and b queue 8 each; then the slot goes round by weight
    with holding(pool, "sk-c"):  # until both backlogs wait, however long they take to build
        threads = flood(pool, "sk-b", 8, max_tokens=4)  # b first: FIFO would serve b's eight first
        wait_for(lambda: queue_depth(pool) == 8, 60, what="b's backlog")
        threads += flood(pool, "sk-a", 8, max_tokens=4)
        wait_for(lambda: queue_depth(pool) == 16, 60, what="both backlogs")
    for t in threads:  # the blocker's client left: its slot freed
        t.join(120)
    wait_for(lambda: served_order(pool, 16).count("b") == 8, 30, what="every request in the log")
    first_half = served_order(pool, 16)[:8]
    assert first_half.count("a") >= 5, first_half  # 3:1 gives six of the first eight; 1:1 four; FIFO none


def test_request_log_gains_the_tenant_column_and_filters_by_it(tmp_path):
    """A log written before tenants existed gets the column on open; rows filter by tenant."""
    import sqlite3

    from supervisor.telemetry.request_log import RequestLog
    path = tmp_path / "r.sqlite3"
    with sqlite3.connect(path) as db:  # the schema before tenants
        db.execute("CREATE TABLE requests (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, model TEXT "
                   "NOT NULL, endpoint TEXT NOT NULL, status INTEGER NOT NULL, error_code TEXT, error_message "
                   "TEXT, queued_ms REAL, ttft_ms REAL, duration_ms REAL, tokens_in INTEGER, tokens_out INTEGER, "
                   "prompt TEXT, output TEXT)")
        db.execute("INSERT INTO requests (ts, model, endpoint, status) VALUES (?, 'old', 'chat_completions', 200)",
                   (time.time() - 60,))
    store = RequestLog(path, max_rows=100, days=1, flush_s=0.01)
    store.start()
    store.record(ts=time.time(), model="m", endpoint="chat_completions", status=200, tenant="team-a")
    store.record(ts=time.time(), model="m", endpoint="chat_completions", status=429, tenant="team-b")
    store.close()
    assert [r["tenant"] for r in store.query()] == ["team-b", "team-a", None]
    assert [r["status"] for r in store.query(tenant="team-a")] == [200]


def test_the_timeline_names_the_tenant_whose_request_loaded_a_model_and_never_a_key(make_pool):
    """Who asked, by name: a load on demand says which tenant's request caused it; an
    admin call without the CLI's or the page's header says `admin key`; no key anywhere."""
    pool = tenants_pool(make_pool, [synthetic("lazy", tokens=2, load_on_start=False)],
                        [{"name": "team-a", "keys": ["sk-team-a-secret"]}])
    http = pool.http
    r = http.post("/v1/chat/completions", json=chat("lazy"), headers=key("sk-team-a-secret"))
    assert r.status_code == 200, r.text
    unloaded = http.post("/admin/models/lazy/unload", headers=ADMIN_H)
    assert unloaded.status_code == 200, unloaded.text

    def timeline() -> list[dict]:
        return http.get("/admin/events", params={"model": "lazy"}, headers=ADMIN_H).json()["events"]
    events = wait_for(lambda: (e := timeline()) and any(x["kind"] == "unloading" for x in e) and e, 5,
                      what="the load and the unload in the timeline")
    by = {e["kind"]: e["by"] for e in events}
    assert by["loading"] == by["loaded"] == "tenant team-a", events
    assert by["unloading"] == "admin key", events
    assert "sk-team-a-secret" not in str(events) and ADMIN not in str(events)
    # the page's tenant filter lists the configured tenants (never their keys)
    tenants = http.get("/admin/tenants", headers=ADMIN_H).json()["tenants"]
    assert {t["name"] for t in tenants} == {"team-a", "default"}
    assert "sk-team-a-secret" not in str(tenants) and "sk-default" not in str(tenants)


def test_a_deadline_that_passes_at_once_gives_back_its_tenants_place(make_pool):
    """B1: a request whose TTFT deadline has passed when it is queued leaves with 503 at once.
    It was counted in flight for its tenant; that count comes back, so six of them in a row
    get six 503s (never a 429 for `max_inflight`), and the tenant is served afterwards."""
    pool = tenants_pool(make_pool, [synthetic("syn", tokens=2)],
                        [{"name": "team-a", "keys": ["sk-a"], "max_inflight": 2, "tpm": 100_000}])
    http = pool.http
    codes = []
    for _ in range(6):
        r = http.post("/v1/chat/completions", json=chat("syn"), headers={**key("sk-a"), "x-slo-ttft-ms": "0.001"})
        codes.append((r.status_code, r.json()["error"]["code"]))
    assert {status for status, _ in codes} == {503}, codes  # its deadline passed: never 429 for max_inflight

    def team_a() -> dict:
        return next(t for t in http.get("/admin/tenants", headers=ADMIN_H).json()["tenants"] if t["name"] == "team-a")
    assert team_a()["inflight"] == 0, team_a()
    r = http.post("/v1/chat/completions", json=chat("syn"), headers=key("sk-a"))
    assert r.status_code == 200, r.text
