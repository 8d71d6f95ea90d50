"""An unmodified agent framework (the OpenAI Agents SDK) runs an agent with one
function tool to its final answer through the pool, over Chat Completions and
over the Responses API. The runtime behind the pool (openai_remote) is a
scripted OpenAI server that acts as a tool-calling model would: it calls the
tool until the conversation holds the tool's result, then answers with it."""

from __future__ import annotations

import asyncio
import json

import pytest
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from tests.pool import Pool
from tests.scripted_openai import ScriptedHandler, serve, sse_chunks


class ToolCallingRuntime(ScriptedHandler):
    """Chat Completions, streamed: a call to get_weather first, then the answer."""
    bodies: list[dict] = []

    def answer(self, body: dict) -> tuple[int, str, str]:
        results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        if results:
            deltas = [{"role": "assistant", "content": "In Paris it is "}, {"content": results[-1]}]
            finish = "stop"
        else:
            call = {"index": 0, "id": "call_w1", "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}
            deltas = [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
            finish = "tool_calls"
        choices = [{"index": 0, "delta": d} for d in deltas] + [{"index": 0, "delta": {}, "finish_reason": finish}]
        return 200, "text/event-stream", sse_chunks(
            choices, {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13})


@pytest.fixture(scope="module")
def runtime():
    with serve(ToolCallingRuntime) as server:
        yield server


@pytest.fixture(scope="module")
def pool(runtime, tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("agents"), [{
        "name": "agentic", "backend": "openai_remote", "target_inflight": 2,
        "options": {"base_url": runtime.url + "/v1", "model": "upstream"}}])
    p.start()
    yield p
    p.stop()


def run_agent(pool, model_class) -> tuple[str, list[str]]:
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return "sunny, 21 C"

    async def go():
        client = AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=model_class(model="agentic", openai_client=client))
        result = await Runner.run(agent, "What is the weather in Paris?")
        await client.close()
        return result.final_output
    set_tracing_disabled(True)  # the SDK would otherwise try to upload traces
    return asyncio.run(asyncio.wait_for(go(), 60)), called


@pytest.mark.parametrize("model_class", [OpenAIChatCompletionsModel, OpenAIResponsesModel])
def test_an_agent_calls_its_tool_and_answers_through_the_pool(pool, runtime, model_class):
    runtime.bodies.clear()
    answer, called = run_agent(pool, model_class)
    assert called == ["Paris"]
    assert answer == "In Paris it is sunny, 21 C"
    # two model turns; the second carried the tool call and its result back to the runtime
    first, second = runtime.bodies
    assert [t["function"]["name"] for t in first["tools"]] == ["get_weather"]
    call = next(m for m in second["messages"] if m.get("tool_calls"))["tool_calls"][0]
    assert call["id"] == "call_w1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert next(m for m in second["messages"] if m["role"] == "tool") == {
        "role": "tool", "tool_call_id": "call_w1", "content": "sunny, 21 C"}
