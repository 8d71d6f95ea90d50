"""Admission (supervisor/admission/admit.py): key -> tenant -> model scope -> limits -> queue.

The order is checked against a real pool: a wrong key is refused before the
body is read or the model looked up; with the right key, an unknown model is
the engine's 404 and a known one is served. The key logic is pure and gets
unit tests of its own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from protocol.errors import ErrorCode, PoolError
from supervisor.admission.admit import Admission, key_matches, output_reserve, presented_key
from supervisor.config import PoolConfig, parse_config
from supervisor.shapes.openai import MAX_OUTPUT_TOKENS
from supervisor.admission.tenants import Tenants
from tests.conftest import synthetic


def headers(**given: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in given.items()]


def test_the_key_is_read_from_bearer_first_then_x_api_key():
    assert presented_key(headers(authorization="Bearer abc")) == b"abc"
    assert presented_key(headers(authorization="bearer abc")) == b"abc"
    assert presented_key(headers(x_api_key="xyz")) == b"xyz"
    assert presented_key(headers(x_api_key="xyz", authorization="Bearer abc")) == b"abc"
    assert presented_key(headers(authorization="Basic abc")) == b""
    assert presented_key([]) == b""


def test_key_matching():
    assert key_matches(b"a", [b"b", b"a"])
    assert not key_matches(b"", [b"a"])
    assert not key_matches(b"ab", [b"a"])
    assert not key_matches(b"a", [])


class NoEngine:
    """Admission with no key in the way must not reach the engine in these tests."""

    def make_job(self, *args, **kwargs):
        raise AssertionError(f"the request reached the engine: {args}")


def admission(api_key: str | None, admin_key: str | None) -> Admission:
    tenants = Tenants(PoolConfig(), api_key, admin_key)
    return Admission(NoEngine(), tenants)


def test_without_keys_every_request_is_the_default_tenant():
    open_pool = admission(None, None)
    default = open_pool.tenants.default()
    assert default.name == "default"
    assert open_pool.tenant([]) is default
    assert open_pool.tenant(headers(authorization="Bearer anything")) is default
    # an admin key alone guards the admin surface only
    admin_only = admission(None, "admin")
    assert admin_only.tenant([]) is admin_only.tenants.default()


@pytest.mark.parametrize("given, admitted", [
    ({}, False), ({"authorization": "Bearer wrong"}, False), ({"x_api_key": "infe"}, False),
    ({"authorization": "Bearer infer"}, True), ({"x_api_key": "infer"}, True),
    ({"authorization": "Bearer admin"}, True),  # the admin key may call the inference routes too
])
def test_with_an_inference_key_it_or_the_admin_key_is_needed(given, admitted):
    keyed = admission("infer", "admin")
    if admitted:
        assert keyed.tenant(headers(**given)) is keyed.tenants.default()
    else:
        with pytest.raises(PoolError) as refused:
            keyed.tenant(headers(**given))
        assert refused.value.code is ErrorCode.UNAUTHORIZED and refused.value.status == 401


def test_an_output_limit_over_the_cap_is_a_400_naming_it_and_the_context_bounds_the_reserve():
    """max_tokens and its kin, those a body passes through too: over MAX_OUTPUT_TOKENS is the
    client's 400 (issue 33: 10**18 was a tpm reserve). Over the model's context it is no error (the
    runtime stops there; agents ask 32,000 of an 8,192 window), but the reserve is the context."""
    assert output_reserve({"max_tokens": MAX_OUTPUT_TOKENS}) == MAX_OUTPUT_TOKENS
    assert output_reserve({"max_tokens": 4096}, context=4096) == 4096
    assert output_reserve({"max_completion_tokens": 32000}, context=8192) == 8192
    assert output_reserve({}, context=512) == 512  # the default reserve, within a small context too
    for request in ({"max_tokens": 10**18}, {"max_output_tokens": MAX_OUTPUT_TOKENS + 1},
                    {"max_tokens": 100, "max_completion_tokens": 10**30}):
        with pytest.raises(PoolError) as refused:
            output_reserve(request, context=4096)
        field = next(k for k, v in request.items() if v > MAX_OUTPUT_TOKENS)
        assert refused.value.code is ErrorCode.INVALID_REQUEST and refused.value.param == field
        assert refused.value.message.startswith(f"{field}: ") and len(refused.value.message) < 200


class ContextEngine:
    """A model whose replicas report their context (llama-server's n_ctx per slot); what it
    queues is kept."""

    def __init__(self, *contexts) -> None:
        replicas = [SimpleNamespace(info={"n_ctx_per_slot": n}) for n in contexts] + [SimpleNamespace(info={})]
        self.model = SimpleNamespace(cfg=SimpleNamespace(name="m", aliases=(), slo_ttft_ms=None, slo_tpot_ms=None),
                                     executor=SimpleNamespace(replicas=replicas))
        self.queued = []

    def entry(self, name):
        return self.model

    def make_job(self, entry, request, endpoint, tenant, headers=None):
        return SimpleNamespace(frame=b"x" * 400, request=request)  # 100 tokens by admission's estimate

    async def prompt_tokens(self, entry, request, endpoint):
        return None

    def predict(self, entry, tenant, frame_bytes):
        return None  # no deadline asked: admission only records it

    def enqueue(self, entry, job, tokens=None):
        self.queued.append(job)


def test_admit_reserves_at_most_the_smallest_replica_context():
    cfg = parse_config({"tenants": [{"name": "a", "keys": ["k"], "tpm": 100_000}]})
    engine = ContextEngine(8192, 4096)
    pool = Admission(engine, Tenants(cfg))
    tenant = pool.tenants.by_name["a"]
    job = asyncio.run(pool.admit(tenant, "m", {"messages": [], "max_tokens": 32000}, "chat"))
    assert engine.queued == [job] and tenant.inflight == 1
    assert 100_000 - tenant.tokens.level == pytest.approx(100 + 4096, abs=1)  # not 100 + 32,000
    with pytest.raises(PoolError) as refused:  # over the cap: refused before it counts against any limit
        asyncio.run(pool.admit(tenant, "m", {"messages": [], "max_tokens": 10**18}, "chat"))
    assert refused.value.param == "max_tokens" and tenant.inflight == 1 and len(engine.queued) == 1


def test_the_order_on_a_real_pool(make_pool):
    """Key before body and model: a wrong key with an unknown model, or with a body that is
    not JSON, is a 401; the right key gets the body's 400, the unknown model's 404, and a
    known model's answer."""
    pool = make_pool([synthetic("syn", tokens=2)], server={"api_key": "infer"})
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    wrong = {"Authorization": "Bearer wrong"}
    right = {"Authorization": "Bearer infer"}
    for given in ({}, wrong):
        r = pool.http.post("/v1/chat/completions", json=chat, headers=given)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
        r = pool.http.post("/v1/chat/completions", content=b"{not json", headers=given)
        assert r.status_code == 401, r.text
    r = pool.http.post("/v1/chat/completions", content=b"{not json",
                       headers={**right, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    r = pool.http.post("/v1/chat/completions", json=chat, headers=right)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = pool.http.post("/v1/chat/completions", json={**chat, "model": "syn"}, headers=right)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
