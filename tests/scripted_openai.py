"""A scripted OpenAI-compatible server for tests: it stands in for a runtime
that does what the tiny real ones cannot (tool calls, reasoning, several
choices). A subclass answers each POST with `answer(body)` (a stream, which
a request with stream off gets whole: `whole_answer`); every body it got is
kept in `bodies`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace


def sse_chunks(choices: list[dict], usage: dict | None = None) -> str:
    """A streamed chat completion: one chunk per choice delta, then usage, then [DONE]."""
    frames = [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [c]}
              for c in choices]
    if usage is not None:
        frames.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                       "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"


def whole_answer(sse: str) -> str:
    """A streamed chat completion (sse_chunks) folded into the whole answer a
    server gives a request with stream off: per choice, its texts joined, its
    tool calls assembled, its logprobs in one list; the usage, if any."""
    choices: dict[int, dict] = {}
    usage = None
    for line in sse.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            out = choices.setdefault(c["index"], {"index": c["index"], "message": {"role": "assistant",
                                                                                  "content": None}})
            message, delta = out["message"], c.get("delta") or {}
            for key in ("content", "reasoning_content"):
                if delta.get(key):
                    message[key] = (message.get(key) or "") + delta[key]
            for call in delta.get("tool_calls") or ():
                calls = message.setdefault("tool_calls", [])
                if call["index"] == len(calls):
                    calls.append({"id": call.get("id"), "type": "function",
                                  "function": {"name": call["function"].get("name"), "arguments": ""}})
                calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments") or ""
            if (c.get("logprobs") or {}).get("content"):
                out.setdefault("logprobs", {"content": []})["content"] += c["logprobs"]["content"]
            if c.get("finish_reason"):
                out["finish_reason"] = c["finish_reason"]
    answer = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [choices[i] for i in sorted(choices)]}
    if usage:
        answer["usage"] = usage
    return json.dumps(answer)


class ScriptedHandler(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def answer(self, body: dict) -> tuple[int, str, str]:
        """(status, content type, text) for one request body."""
        raise NotImplementedError

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        status, kind, text = self.answer(body)
        if kind == "text/event-stream" and not body.get("stream"):  # asked with stream off: answered whole
            kind, text = "application/json", whole_answer(text)
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def serve(handler: type[ScriptedHandler]) -> Iterator[SimpleNamespace]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}", bodies=handler.bodies)
    finally:
        server.shutdown()
        server.server_close()
