"""A hostile (or broken) OpenAI-compatible runtime: a small HTTP handler that answers
each request by its last message's text (a line with no end, a gzip bomb, a choice
index of twenty million, an answer too big for one frame, an HTML page, a redirect, a
stream cut short, ...); and a llama-server's GET /slots of 64 MiB, with no length (each
slot's prompt text in it). Used by tests/test_hostile_upstream.py, scripts/soak and
tests/test_request_story.py."""

from __future__ import annotations

import json
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHAT = "/v1/chat/completions"
MiB = 2**20


def chunk(choice: dict) -> bytes:
    return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [choice]}).encode() + b"\n\n"


def finish(reason: str = "stop", index: int = 0) -> bytes:
    return chunk({"index": index, "delta": {}, "finish_reason": reason})


def bomb() -> bytes:
    """256 MiB of blank SSE lines, gzip-compressed to a few hundred KB."""
    z = zlib.compressobj(1, wbits=31)
    block = b"\n" * MiB
    return b"".join(z.compress(block) for _ in range(256)) + z.flush()


class Hostile(BaseHTTPRequestHandler):
    """Answers by the request's last message. HTTP/1.0: a body without a length ends when the connection does."""
    bomb = b""
    slots_written = 0  # bytes of the last GET /slots answer that went out, once it is over

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path != "/slots":
            self.send_error(501)  # as before it answered GET at all
            return
        self.head(kind="application/json")
        one = json.dumps({"id": 0, "id_task": 1, "is_processing": True, "params": {"seed": 1},
                          "prompt": "x" * MiB}).encode()
        type(self).slots_written = written = 0
        try:
            for part in [b"[", *[one + b","] * 63, one + b"]"]:  # valid JSON, once read whole
                self.wfile.write(part)
                written += len(part)
        except (BrokenPipeError, ConnectionResetError):  # the reader stopped at its cap
            pass
        type(self).slots_written = written

    def head(self, status: int = 200, kind: str = "text/event-stream", **headers) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/embeddings"):  # about 10 MiB of JSON; more than the 16 MiB frame cap as msgpack
            data = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0,
                                                           "embedding": [0.5] * 2_000_000}],
                               "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
            self.head(kind="application/json", Content_Length=str(len(data)))
            self.wfile.write(data)
            return
        if self.path.endswith("/done"):  # where the redirect points: an empty success
            self.head()
            self.wfile.write(b"data: [DONE]\n\n")
            return
        prompt = body["messages"][-1]["content"]
        try:
            self.answer(prompt) if body.get("stream") else self.answer_whole(prompt)
        except (BrokenPipeError, ConnectionResetError):  # the pool hung up on it: that is the point
            pass

    def answer_whole(self, prompt: str) -> None:
        """The same faults, for a request that wants its answer whole (JSON)."""
        w = self.wfile

        def whole(choices: list[dict], kind: str = "application/json") -> None:
            self.head(kind=kind)
            w.write(json.dumps({"id": "c", "object": "chat.completion", "choices": choices}).encode())

        def message(text: str, index: int = 0, reason: str | None = "stop") -> dict:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason}

        if prompt == "slow":
            time.sleep(1)
            whole([message("".join(f"t{i} " for i in range(30)))])
        elif prompt in ("endless-line", "flood"):  # 40 MiB of answer: past the job's budget
            whole([message("y" * 40 * MiB)])
        elif prompt == "bomb":
            self.head(kind="application/json", Content_Encoding="gzip", Content_Length=str(len(self.bomb)))
            w.write(self.bomb)
        elif prompt in ("huge-index", "far-choice"):
            whole([message("a"), message("x", 20_000_000)])
        elif prompt == "html":
            whole([message("hi")], kind="text/html")
        elif prompt == "json":  # a good whole answer: for this request, not a fault
            whole([message("hi")])
        elif prompt == "redirect":
            self.head(302, Location="/v1/done")
        elif prompt == "cut":  # half of an answer, then the connection ends
            self.head(kind="application/json")
            w.write(b'{"id": "c", "choices": [{"index": 0, "message": {"content": "The answer is')
        elif prompt == "no-finish":
            whole([message("half", reason=None)])

    def answer(self, prompt: str) -> None:
        w = self.wfile
        if prompt == "slow":  # the honest job sharing the worker with the hostile ones
            self.head()
            for i in range(30):
                w.write(chunk({"index": 0, "delta": {"content": f"t{i} "}}))
                w.flush()
                time.sleep(0.1)
            w.write(finish() + b"data: [DONE]\n\n")
        elif prompt == "endless-line":  # 40 MiB with no newline
            self.head()
            w.write(b"data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"")
            for _ in range(40):
                w.write(b"x" * MiB)
        elif prompt == "bomb":
            self.head(Content_Encoding="gzip", Content_Length=str(len(self.bomb)))
            w.write(self.bomb)
        elif prompt == "flood":  # 1 MiB lines, well under the line cap, past the job's budget
            self.head()
            for _ in range(40):
                w.write(chunk({"index": 0, "delta": {"content": "y" * MiB}}))
            w.write(finish() + b"data: [DONE]\n\n")
        elif prompt == "huge-index":
            self.head()
            w.write(chunk({"index": 0, "delta": {"content": "a"}}) + finish("stop", 20_000_000)
                    + b"data: [DONE]\n\n")
        elif prompt == "far-choice":
            self.head()
            w.write(chunk({"index": 3_000_000, "delta": {"content": "x"}}) + finish() + b"data: [DONE]\n\n")
        elif prompt == "html":
            self.head(kind="text/html")
            w.write(b"<html><body>Welcome to nginx</body></html>")
        elif prompt == "json":  # a whole answer to a streamed request
            self.head(kind="application/json")
            w.write(json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                             "finish_reason": "stop"}]}).encode())
        elif prompt == "redirect":
            self.head(302, Location="/v1/done")
        elif prompt == "cut":  # one delta, then the connection ends: no finish_reason, no [DONE]
            self.head()
            w.write(chunk({"index": 0, "delta": {"content": "The answer is"}}))
        elif prompt == "no-finish":  # [DONE], but choice 0 never finished
            self.head()
            w.write(chunk({"index": 0, "delta": {"content": "half"}}) + b"data: [DONE]\n\n")


def serve_hostile() -> ThreadingHTTPServer:
    """The hostile runtime on a loopback port, served by a daemon thread (shut it down when done)."""
    Hostile.bomb = bomb()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
