"""The CLI's side of the HTTP admin API: one call (`call`), an SSE feed followed
across restarts (`sse_events`), Ctrl-C for a follow, and `Failure`, what went wrong
in one line for the operator."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time

import httpx


class Failure(Exception):
    """What went wrong, in one line for the operator (never a traceback)."""


def call(url: str, method: str, path: str, *, params: dict | None = None,
          timeout: float | None = 30.0, accept: tuple[int, ...] = ()) -> dict:
    """One admin API call; returns its JSON body. Statuses in `accept` count as answers;
    anything else that goes wrong (unreachable, 401, an error envelope) is a Failure."""
    base = url.rstrip("/")
    headers = admin_headers()
    key = os.environ.get("LLM_POOL_ADMIN_KEY")
    try:
        # connect fails fast; reading may be long (load and unload answer when done)
        r = httpx.request(method, base + path, params=params, headers=headers,
                          timeout=httpx.Timeout(timeout, connect=10.0))
    except httpx.ConnectTimeout:
        raise Failure(f"cannot reach {base} (timed out)") from None
    except httpx.TimeoutException:
        raise Failure(f"{base} did not answer within {timeout:g}s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # refused, no such host, bad URL, reset
        reason = re.sub(r"^\[Errno -?\d+\] ", "", str(exc)) or type(exc).__name__
        raise Failure(f"cannot reach {base} ({reason[:1].lower() + reason[1:]})") from None
    if r.status_code == 401:
        if "admin_key" in r.text:  # the server has no admin key: a key here cannot help
            raise Failure(f"unauthorized: {error_message(r) or 'the server has no admin_key'}")
        refused = " (the one given was refused)" if key else ""
        raise Failure(f"unauthorized: set LLM_POOL_ADMIN_KEY{refused}")
    try:
        body = r.json()
    except ValueError:
        raise Failure(f"{base}{path} answered HTTP {r.status_code} without JSON; is it llm-pool?") from None
    if r.is_success or r.status_code in accept:
        return body
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        raise Failure(str(error["message"]))
    raise Failure(f"{base}{path} answered HTTP {r.status_code}")


def admin_headers() -> dict[str, str]:
    key = os.environ.get("LLM_POOL_ADMIN_KEY")
    # who asks, for the pool's event timeline ("restart ... asked by cli")
    return {"X-LLM-Pool-Client": "cli", **({"Authorization": f"Bearer {key}"} if key else {})}


def error_message(r: httpx.Response) -> str | None:
    try:
        error = r.json().get("error")
    except (ValueError, AttributeError):
        return None
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
    base = url.rstrip("/")
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
