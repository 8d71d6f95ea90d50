"""The CLI's side of the HTTP admin API: one call (`call`), an SSE feed followed
across restarts (`sse_events`), Ctrl-C for a follow, and `Failure`, what went wrong
in one line for the operator.

`call` speaks HTTP/1.1 through the standard library's http.client: each command is
one short process, and importing httpx (with the rich and click of its own CLI) cost
more than the whole command; a follow (`sse_events`) imports httpx when it starts."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import sys
import time
from urllib.parse import urlencode, urlsplit

CONNECT_TIMEOUT_S = 10.0  # reaching the pool fails fast; reading may be long (load and unload answer when done)


class Failure(Exception):
    """What went wrong, in one line for the operator (never a traceback)."""


def base_url(url: str) -> str:
    """The pool's base URL from --url: an OpenAI client's base URL (`.../v1`) is taken as
    the pool's (the admin API is beside /v1, not under it)."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base


def _why(exc: OSError) -> str:
    reason = exc.strerror or str(exc) or type(exc).__name__
    return reason[:1].lower() + reason[1:]


def call(url: str, method: str, path: str, *, params: dict | None = None,
         timeout: float | None = 30.0, accept: tuple[int, ...] = ()) -> dict:
    """One admin API call; returns its JSON body. Statuses in `accept` count as answers;
    anything else that goes wrong (unreachable, 401, an error envelope) is a Failure."""
    base = base_url(url)
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Failure(f"--url {url!r} is not an http:// or https:// URL of the pool (e.g. http://127.0.0.1:8000)")
    try:
        port = parts.port
    except ValueError:
        raise Failure(f"--url {url!r} has an invalid port") from None
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, port, timeout=CONNECT_TIMEOUT_S)
    target = parts.path + path + (f"?{urlencode(params)}" if params else "")
    try:
        try:
            conn.connect()
        except TimeoutError:
            raise Failure(f"cannot reach {base} (timed out)") from None
        except OSError as exc:  # refused, no such host, unreachable
            raise Failure(f"cannot reach {base} ({_why(exc)})") from None
        conn.sock.settimeout(timeout)
        try:
            conn.putrequest(method, target)
            for name, value in {**admin_headers(), "Content-Length": "0"}.items():  # no body, ever
                try:
                    conn.putheader(name, value)
                except (UnicodeEncodeError, ValueError):  # a newline or a non-Latin-1 character
                    raise Failure("LLM_POOL_ADMIN_KEY cannot travel in an HTTP header (a line break or a "
                                  "character outside Latin-1)") from None
            conn.endheaders()
            r = conn.getresponse()
            status, text = r.status, r.read().decode(errors="replace")
        except TimeoutError:
            raise Failure(f"{base} did not answer within {timeout:g}s") from None
        except (OSError, http.client.HTTPException) as exc:  # reset, or not HTTP at all
            raise Failure(f"cannot reach {base} ({_why(exc) if isinstance(exc, OSError) else 'not HTTP'})") from None
    finally:
        conn.close()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    message = error_message(body)
    if status == 401:
        if "admin_key" in text:  # the server has no admin key: a key here cannot help
            raise Failure(f"unauthorized: {message or 'the server has no admin_key'}")
        refused = " (the one given was refused)" if os.environ.get("LLM_POOL_ADMIN_KEY") else ""
        raise Failure(f"unauthorized: set LLM_POOL_ADMIN_KEY{refused}")
    if body is None:
        raise Failure(f"{base}{path} answered HTTP {status} without JSON; is it llm-pool?")
    if 200 <= status < 300 or status in accept:
        return body
    if message:
        raise Failure(message)
    raise Failure(f"{base}{path} answered HTTP {status}")


def admin_headers() -> dict[str, str]:
    key = os.environ.get("LLM_POOL_ADMIN_KEY")
    # who asks, for the pool's event timeline ("restart ... asked by cli")
    return {"X-LLM-Pool-Client": "cli", **({"Authorization": f"Bearer {key}"} if key else {})}


def error_message(body) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    return str(error["message"]) if isinstance(error, dict) and error.get("message") else None


@contextlib.contextmanager
def until_ctrl_c():
    """A follow (`-f`) runs until Ctrl-C, which ends the command at once with status 0, as
    `tail -f` does. Not by KeyboardInterrupt, which lands wherever the HTTP client happens to
    be and unwinds it from there (a follow in CI once hung after Ctrl-C). A follow holds
    nothing to save: what it printed is flushed, and the process exits."""
    def stop(signum, frame) -> None:
        try:
            sys.stdout.flush()
        except Exception:  # interrupted inside a write of stdout: that line is lost
            pass
        os._exit(0)

    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sse_events(url: str, path: str, params: dict):
    """Yield (event, data) from an SSE feed of the admin API until it ends; a dropped
    connection is opened again after a second (the pool may be restarting)."""
    import httpx  # here: a follow runs long; the one-shot commands need none of it

    base = base_url(url)
    first = True
    while True:
        try:
            with httpx.stream("GET", base + path, params=params if first else {**params, "lines": 0},
                              headers=admin_headers(), timeout=httpx.Timeout(None, connect=10.0)) as r:
                if r.status_code != 200:
                    raise Failure(f"{base}{path} answered HTTP {r.status_code}")
                first = False
                name, data = "message", []
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
                    elif not line and data:
                        yield name, json.loads("\n".join(data))
                        name, data = "message", []
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
