"""ExLlamaV3 backend: everything that needs no CUDA, for real; the generator
itself (CUDA only) is replaced by FakeGenerator in the threading test, and the
real path runs in the GPU tier (tests/test_gpu.py, scripts/gpu-check)."""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime_worker.backends.base import BackendLoadError, Finished, JobError, TextDelta
from runtime_worker.backends.exllamav3 import (
    SAMPLER_FIELDS,
    ExLlamaV3Backend,
    GeneratorThread,
    events_from_result,
    job_settings,
    load_chat_template,
    render_chat,
)
from tests.conftest import synthetic


def test_job_settings_map_the_request():
    s = job_settings({"max_tokens": 7, "temperature": 0.2, "top_p": 0.9, "stop": ["\n\n"]}, [2, 9], 100)
    assert s == {"max_new_tokens": 7, "stop_conditions": [2, 9, "\n\n"], "seed": None,
                 "sampler": {"temperature": 0.2, "top_p": 0.9}}
    s = job_settings({"max_tokens": None, "temperature": None}, [2], 100)
    assert s["max_new_tokens"] == 100 and s["sampler"]["temperature"] == 1.0 and s["stop_conditions"] == [2]
    s = job_settings({"max_completion_tokens": 5, "stop": "END", "seed": 42, "top_k": 40, "min_p": 0.05,
                      "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                      "logit_bias": {"17": -100}}, [2], 100)
    assert s == {"max_new_tokens": 5, "stop_conditions": [2, "END"], "seed": 42, "sampler": {
        "temperature": 1.0, "top_p": 1.0, "top_k": 40, "min_p": 0.05, "rep_p": 1.1, "pres_p": 0.5, "freq_p": 0.25,
        "logit_bias": {17: -100.0}}}
    for bad, param in [({"seed": "x"}, "seed"), ({"top_k": 1.5}, "top_k"), ({"stop": [1]}, "stop"),
                       ({"logit_bias": {"a": 1}}, "logit_bias"), ({"temperature": True}, "temperature")]:
        with pytest.raises(JobError) as err:
            job_settings(bad, [2], 100)
        assert err.value.param == param


def test_the_sampler_arguments_are_exllamav3s():
    """Every argument job_settings makes is one ComboSampler and Job take (read from the
    installed exllamav3 where there is one: its import needs CUDA)."""
    import inspect
    try:
        from exllamav3 import ComboSampler, Job
    except Exception:
        pytest.skip("exllamav3 is not importable here (CUDA only)")
    assert set(SAMPLER_FIELDS.values()) | {"logit_bias"} <= set(inspect.signature(ComboSampler).parameters)
    assert {"seed", "stop_conditions", "max_new_tokens"} <= set(inspect.signature(Job).parameters)


def test_fields_it_cannot_honour_are_refused_by_name():
    backend = ExLlamaV3Backend({}, 1, None)
    backend.check("chat", {"messages": [], "seed": 1, "stop": ["x"], "top_k": 5, "n": 1, "logprobs": False})
    for field, value in [("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"}),
                         ("logprobs", True), ("n", 2)]:
        with pytest.raises(JobError) as err:
            backend.check("chat", {"messages": [], field: value})
        assert err.value.code == "unsupported_parameter" and err.value.param == field
        assert "exllamav3" in err.value.message
    with pytest.raises(JobError) as err:
        backend.check("embeddings", {"input": "x"})
    assert err.value.code == "unsupported_endpoint"


def test_results_map_to_events():
    assert events_from_result({"stage": "prefill", "curr_progress": 3}) == []
    assert events_from_result({"stage": "streaming", "text": "ab", "eos": False}) == [TextDelta("ab")]
    assert events_from_result({"stage": "streaming", "text": "", "eos": True, "eos_reason": "max_new_tokens",
                               "prompt_tokens": 5, "new_tokens": 9}) == [Finished("length", 5, 9)]
    assert events_from_result({"stage": "streaming", "text": "z", "eos": True, "eos_reason": "stop_token",
                               "prompt_tokens": 1, "new_tokens": 2}) == [TextDelta("z"), Finished("stop", 1, 2)]
    with pytest.raises(JobError):
        events_from_result({"stage": "error", "error": RuntimeError("boom")})


def test_chat_template_lookup_and_render(tmp_path):
    with pytest.raises(BackendLoadError, match="has no chat template"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(BackendLoadError, match="has no chat template"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"},
                           {"name": "default", "template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                                                           "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}]}))
    template = load_chat_template(tmp_path)
    assert render_chat(template, [{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert render_chat(load_chat_template(tmp_path), [{"role": "user", "content": "q"}], bos_token="<s>") == "<s>q"


class FakeGenerator:
    """Stands in for exllamav3's Generator (CUDA only): same calls, plain data.
    Each job yields its `script` of results, one per iterate()."""

    def __init__(self, capacity_tokens: int = 100) -> None:
        self.active: dict[str, list[dict]] = {}
        self.capacity_tokens = capacity_tokens
        self.cancelled: list[str] = []

    def enqueue(self, job) -> None:
        assert job["tokens"] <= self.capacity_tokens, f"Job requires {job['tokens']} tokens"
        self.active[job["id"]] = list(job["script"])

    def cancel(self, job) -> None:
        self.active.pop(job["id"], None)
        self.cancelled.append(job["id"])

    def clear_queue(self) -> None:
        self.active.clear()

    def num_remaining_jobs(self) -> int:
        return len(self.active)

    def iterate(self) -> list[dict]:
        out = []
        for job_id, script in list(self.active.items()):
            out.append({**script.pop(0), "identifier": job_id})
            if not script:
                del self.active[job_id]
        return out


def streaming(text, eos=False):
    return {"stage": "streaming", "text": text, "eos": eos, "eos_reason": "stop_token",
            "prompt_tokens": 1, "new_tokens": 2}


def test_generator_thread_runs_jobs_together_and_cancels():
    async def scenario():
        fake = FakeGenerator()
        thread = GeneratorThread(fake, asyncio.get_running_loop())
        thread.start()
        a, b, c = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
        thread.submit("a", {"id": "a", "tokens": 5, "script": [streaming("x"), streaming("y", eos=True)]}, a)
        thread.submit("b", {"id": "b", "tokens": 5, "script": [streaming("1")] * 1000}, b)
        thread.submit("c", {"id": "c", "tokens": 500, "script": []}, c)  # too long for the cache
        got_a = [await asyncio.wait_for(a.get(), 5) for _ in range(3)]
        assert got_a == [TextDelta("x"), TextDelta("y"), Finished("stop", 1, 2)]
        assert (await asyncio.wait_for(b.get(), 5)) == TextDelta("1")
        err = await asyncio.wait_for(c.get(), 5)
        assert isinstance(err, JobError) and err.code == "invalid_request"
        thread.cancel("b")
        await asyncio.to_thread(thread.stop)
        assert fake.cancelled == ["b"]
    asyncio.run(scenario())


def test_a_dying_generator_thread_ends_the_worker():
    """A CUDA error inside iterate() must not leave a worker that heartbeats while
    every job waits for its deadline: wait_dead() returns, so the worker exits 1."""
    class Failing(FakeGenerator):
        def iterate(self) -> list[dict]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def scenario():
        thread = GeneratorThread(Failing(), asyncio.get_running_loop())
        thread.start()
        thread.submit("a", {"id": "a", "tokens": 5, "script": [streaming("x")]}, asyncio.Queue())
        reason = await asyncio.wait_for(thread.died, 5)
        assert "RuntimeError: CUDA error" in reason
        thread.thread.join(5)
        assert not thread.thread.is_alive()
    asyncio.run(scenario())


def test_exllamav3_without_cuda_fails_to_load_cleanly(make_pool, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    pool = make_pool([{"name": "exl", "backend": "exllamav3", "load_on_start": False,
                       "options": {"model": str(tmp_path)}}, synthetic("ok")])
    r = pool.http.post("/admin/models/exl/load")
    assert r.status_code == 503 and "exllamav3 is not usable here" in r.json()["error"]["message"]
    assert pool.http.post("/v1/responses", json={"model": "ok", "input": "x"}).status_code == 200


def test_replica_devices_pin_each_replica(make_pool):
    import psutil
    pool = make_pool([synthetic("gpu", replicas=2, replica_devices=["0", "1,2"])])
    devices = {w["replica"]: psutil.Process(w["pid"]).environ().get("CUDA_VISIBLE_DEVICES")
               for w in pool.workers("gpu")}
    assert devices == {0: "0", 1: "1,2"}
