"""The official openai SDK against the pool (synthetic backend, real workers)."""

import openai
import pytest

from tests.conftest import synthetic
from runtime_worker.backends.synthetic import synthetic_tokens


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from tests.pool import Pool
    p = Pool(tmp_path_factory.mktemp("sdk"), [synthetic("syn", capacity=2, target_inflight=2, tokens=12)])
    p.start()
    yield p
    p.stop()


@pytest.fixture
def client(pool):
    return openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)


def expected(prompt: str, n: int = 12) -> str:
    return "".join(synthetic_tokens(prompt, n))


def test_responses_create(client):
    r = client.responses.create(model="syn", input="hello there")
    assert r.status == "completed"
    assert r.output_text == expected("hello there")
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == 2
    assert r.id.startswith("resp_")


def test_responses_create_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="syn", input="hi", max_output_tokens=5)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == expected("hi", 5)


def test_responses_stream_final_response(client):
    deltas = []
    with client.responses.stream(model="syn", input=[{"role": "user", "content": "stream me"}],
                                 instructions="be brief") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert deltas  # instant tokens may arrive merged (see runtime_worker/outbox.py)
    assert "".join(deltas) == final.output_text == expected("stream me")
    assert final.usage.output_tokens == 12


def test_chat_completions(client):
    r = client.chat.completions.create(model="syn", messages=[{"role": "user", "content": "abc"}])
    assert r.choices[0].message.content == expected("abc")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 12


def test_chat_completions_stream(client):
    chunks = list(client.chat.completions.create(
        model="syn", messages=[{"role": "user", "content": "abc"}], stream=True, max_tokens=4,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected("abc", 4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["syn"]


def test_errors_map_to_sdk_exceptions(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="nope", input="x")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="syn", input="x", max_output_tokens="many")
    assert exc.value.code == "invalid_request"
