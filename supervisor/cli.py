"""`llm-pool`: run the pool (`serve`) and inspect or control a running one
(a thin client over the HTTP admin API)."""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from supervisor.config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Serve several local LLMs behind one OpenAI-compatible API.")


@app.callback()
def _main() -> None:
    """Serve several local LLMs behind one OpenAI-compatible API."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command()
def serve(config: Path = typer.Option(..., "--config", "-c", help="TOML config file"),
          host: str | None = typer.Option(None, help="bind address (default from config: 127.0.0.1)"),
          port: int | None = typer.Option(None, help="port (default from config: 8000)"),
          log_level: str = typer.Option("info", help="debug | info | warning | error")) -> None:
    """Run the supervisor and its HTTP API in the foreground."""
    import os

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        typer.echo(f"llm-pool: config error: {exc}", err=True)
        raise typer.Exit(2) from None
    if host is not None:
        cfg.server.host = host
    if port is not None:
        cfg.server.port = port
    has_keys = (cfg.server.api_key or os.environ.get("LLM_POOL_API_KEY")) and (
        cfg.server.admin_key or os.environ.get("LLM_POOL_ADMIN_KEY"))
    if not _is_loopback(cfg.server.host) and not has_keys and not os.environ.get("LLM_POOL_ALLOW_INSECURE"):
        typer.echo(f"llm-pool: refusing to bind {cfg.server.host} without api_key and admin_key "
                   "(set them, or LLM_POOL_ALLOW_INSECURE=1 to override)", err=True)
        raise typer.Exit(2)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from supervisor.server import run
    run(cfg, log_level)


# -- the operator client: a thin layer over the HTTP admin API --------------------------------

DEFAULT_URL = "http://127.0.0.1:8000"
Url = Annotated[str, typer.Option("--url", envvar="LLM_POOL_URL", help="the pool's base URL")]
AsJson = Annotated[bool, typer.Option("--json", help="print the server's raw JSON list")]
Target = Annotated[str, typer.Argument(metavar="NAME[/REPLICA]", help="a model, or one of its replicas")]


class Failure(Exception):
    """What went wrong, in one line for the operator (never a traceback)."""


def _client(command):
    """Register a client command; a Failure in it becomes `llm-pool: <message>` and exit 1."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Failure as exc:
            typer.echo(f"llm-pool: {exc}", err=True)
            raise typer.Exit(1) from None
    return app.command()(run)


def _call(url: str, method: str, path: str, *, params: dict | None = None,
          timeout: float | None = 30.0, accept: tuple[int, ...] = ()) -> dict:
    """One admin API call; returns its JSON body. Statuses in `accept` count as answers;
    anything else that goes wrong (unreachable, 401, an error envelope) is a Failure."""
    base = url.rstrip("/")
    key = os.environ.get("LLM_POOL_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
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
            raise Failure(f"unauthorized: {_error_message(r) or 'the server has no admin_key'}")
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


def _error_message(r: httpx.Response) -> str | None:
    try:
        error = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return str(error["message"]) if isinstance(error, dict) and error.get("message") else None


def _model_path(name: str, action: str) -> str:
    return f"/admin/models/{quote(name, safe='')}/{action}"


def _model_view(url: str, name: str) -> dict:
    for view in _call(url, "GET", "/admin/models", timeout=5.0)["models"]:
        if view["name"] == name:
            return view
    raise Failure(f"model {name!r} does not exist")


def _target(text: str) -> tuple[str, int | None]:
    """NAME or NAME/REPLICA (model names cannot contain '/')."""
    name, slash, replica = text.rpartition("/")
    if not slash:
        return text, None
    if not name or not replica.isdigit():
        raise Failure(f"expected NAME or NAME/REPLICA, got {text!r}")
    return name, int(replica)


def _waiting(work, describe) -> dict:
    """Run the blocking admin call `work` in a thread while a spinner shows
    describe(elapsed_s), polled from the server; return work's result or raise its Failure."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except Exception as exc:  # re-raised below, in the main thread
            outcome["error"] = exc

    # daemon: Ctrl-C leaves at once; the server finishes the operation on its own
    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    with Console(stderr=True).status("waiting") as status:  # stderr: stdout stays the result
        while thread.is_alive():
            try:
                status.update(Text(describe(time.monotonic() - started)))
            except Failure:
                pass  # a missed poll only delays the display; the call itself decides
            thread.join(0.25)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _print_json(data) -> None:
    typer.echo(json.dumps(data, indent=2))


def _table(headers: list[str], rows: list[tuple[str, ...]]) -> None:
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 10_000  # piped: one line per row, never wrapped, for grep and awk
    table = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: names and errors are not markup
    console.print(table)


@_client
def ps(url: Url = DEFAULT_URL, as_json: AsJson = False) -> None:
    """One row per replica: process, state, load, memory, CPU, GPU, children."""
    workers = _call(url, "GET", "/admin/workers")["workers"]
    if as_json:
        return _print_json(workers)
    if not workers:
        typer.echo("no replicas running", err=True)
        return
    _table(["MODEL", "REPLICA", "NODE", "PID", "STATE", "UPTIME", "RESTARTS", "INFLIGHT", "RSS", "CPU%",
            "GPU MEM", "CHILDREN"],
           [(w["model"], str(w["replica"]), _node(w), _dash(w["pid"]), w["state"], _duration(w["uptime_s"]),
             str(w["restarts"]), f"{w['inflight']}/{w['capacity']}", _bytes(w["rss_bytes"]),
             "-" if w["cpu_percent"] is None else f"{w['cpu_percent']:.1f}",
             _bytes(w["gpu_memory_bytes"]),  # None (no GPU, no NVML) stays "-"
             ", ".join(f"{c['name']}:{c['pid']}" for c in w["children"]) or "-")
            for w in workers])


def _node(worker: dict) -> str:
    """The host a replica runs on; a Ray node also by its id (several may share a host)."""
    node = worker.get("node") or "-"
    return f"{node} (ray {worker['node_id'][:8]})" if worker.get("node_id") else node


@_client
def models(url: Url = DEFAULT_URL, as_json: AsJson = False) -> None:
    """One row per configured model: state, replicas, queue, inflight, capacity, error."""
    views = _call(url, "GET", "/admin/models")["models"]
    if as_json:
        return _print_json(views)
    with_error = any(m["error"] for m in views)  # the column only when there is something in it
    _table(["NAME", "BACKEND", "STATE", "READY", "QUEUE", "INFLIGHT", "CAPACITY cfg/eff", "MEMORY",
            "LAST USED", "IDLE UNLOAD IN", "PINNED", "ALIASES"] + ["ERROR"] * with_error,
           [(m["name"], m["backend"], m["state"], f"{m['replicas_ready']}/{m['replicas']}",
             str(m["queue_depth"]), str(m["runtime_inflight"]),
             f"{m['configured_target_inflight']}/{m['effective_target_inflight']}",
             "-" if m.get("memory_mb") is None else f"{m['memory_mb']:g} MB ({m['memory_source']})",
             "-" if m.get("last_used_at") is None else f"{_duration(time.time() - m['last_used_at'])} ago",
             _duration(m.get("idle_unload_in_s")), "yes" if m.get("pinned") else "no",
             ", ".join(m.get("aliases") or []) or "-")
            + (m["error"] or "-",) * with_error
            for m in views])


@_client
def load(name: Annotated[str, typer.Argument(help="model name")], url: Url = DEFAULT_URL) -> None:
    """Load a model and wait until it is loaded (exit 1 with the reason if it fails)."""
    def describe(elapsed: float) -> str:
        view = _model_view(url, name)
        return f"{name}: {view['state']}, {view['replicas_ready']}/{view['replicas']} ready, {elapsed:.0f}s"

    view = _waiting(lambda: _call(url, "POST", _model_path(name, "load"), timeout=None), describe)
    took = f" (load took {view['load_seconds']:.1f}s)" if view.get("load_seconds") is not None else ""
    typer.echo(f"{name}: {view['state']}{took}")


@_client
def unload(name: Annotated[str, typer.Argument(help="model name")], url: Url = DEFAULT_URL) -> None:
    """Unload a model: refuse new requests, let running ones finish, stop its workers."""
    def describe(elapsed: float) -> str:
        view = _model_view(url, name)
        return (f"{name}: {view['state']}, draining: {view['queue_depth']} queued, "
                f"{view['runtime_inflight']} running, {elapsed:.0f}s")

    view = _waiting(lambda: _call(url, "POST", _model_path(name, "unload"), timeout=None), describe)
    typer.echo(f"{name}: {view['state']}")


@_client
def restart(target: Target, url: Url = DEFAULT_URL) -> None:
    """Restart a model's replicas, or just one (NAME/REPLICA)."""
    name, replica = _target(target)

    def describe(elapsed: float) -> str:
        view = _model_view(url, name)
        return f"restarting {target}: {view['replicas_ready']}/{view['replicas']} ready, {elapsed:.0f}s"

    params = None if replica is None else {"replica": replica}
    view = _waiting(lambda: _call(url, "POST", _model_path(name, "restart"), params=params,
                                  timeout=None), describe)
    typer.echo(f"{target}: restarted; {name} {view['state']}, "
               f"{view['replicas_ready']}/{view['replicas']} replicas ready")


@_client
def reload(url: Url = DEFAULT_URL, as_json: AsJson = False) -> None:
    """Re-read the config file: add, remove and reload the models that changed; keep the rest running."""
    result = _call(url, "POST", "/admin/reload", timeout=None)
    if as_json:
        return _print_json(result)
    for key in ("added", "removed", "reloaded", "kept"):
        typer.echo(f"{key}: {', '.join(result[key]) or '-'}")


@_client
def check(url: Url = DEFAULT_URL) -> None:
    """Exit 0 only when the pool is ready (every load_on_start model loaded)."""
    body = _call(url, "GET", "/ready", timeout=10.0, accept=(503,))
    if body.get("status") == "ready":
        typer.echo("ready")
        return
    waiting = body.get("waiting_for") or []
    raise Failure("not ready: waiting for " + ", ".join(waiting) if waiting
                  else "not ready (shutting down)")


@_client
def logs(target: Target,
         lines: Annotated[int, typer.Option("-n", "--lines", min=1, help="how many lines")] = 200,
         url: Url = DEFAULT_URL) -> None:
    """The tail of a replica's log (the worker's and its backend's output); replica 0 by default."""
    name, replica = _target(target)
    body = _call(url, "GET", _model_path(name, "logs"), params={"replica": replica or 0, "lines": lines})
    for line in body["lines"]:
        typer.echo(line)


def _since_param(text: str | None) -> str | None:
    """'10m', '2h', '3d', '45s' (before now), or what the server takes (unix seconds, ISO 8601)."""
    if text is None:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        return str(time.time() - float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]])
    return text


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value < 1000 else f"{value / 1000:.2f}s"


def _request_rows(rows: list[dict]) -> list[tuple[str, ...]]:
    return [(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])), r["model"] or "-",
             r.get("tenant") or "-", r["endpoint"],
             str(r["status"]), r["error_code"] or "-", _ms(r["queued_ms"]), _ms(r["ttft_ms"]),
             _ms(r["duration_ms"]), _dash(r["tokens_in"]), _dash(r["tokens_out"]), _dash(r["tokens_per_s"]))
            for r in rows]


REQUEST_HEADERS = ["TIME", "MODEL", "TENANT", "ENDPOINT", "STATUS", "ERROR", "QUEUED", "TTFT", "DURATION", "IN", "OUT",
                   "TOK/S"]


@_client
def requests(url: Url = DEFAULT_URL, as_json: AsJson = False,
             model: Annotated[str | None, typer.Option("--model", "-m", help="only this model")] = None,
             tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="only this tenant's")] = None,
             status: Annotated[str | None, typer.Option(help="an HTTP status, 'ok' or 'error'")] = None,
             since: Annotated[str | None, typer.Option(help="e.g. 10m, 2h, 1d, or an ISO 8601 time")] = None,
             limit: Annotated[int, typer.Option("-n", "--limit", min=1, max=10_000,
                                                help="how many (the newest)")] = 50,
             follow: Annotated[bool, typer.Option("--follow", "-f", help="then print new ones as they finish")]
             = False) -> None:
    """Recent requests from the request log, oldest first: status, error, queue wait, TTFT,
    duration, tokens. --follow keeps printing until Ctrl-C (one JSON object a line with --json)."""
    params = {k: v for k, v in {"model": model, "tenant": tenant, "status": status, "since": _since_param(since),
                                "limit": limit}.items() if v is not None}
    rows = _call(url, "GET", "/admin/requests", params=params)["requests"][::-1]
    if as_json and not follow:
        return _print_json(rows)
    last = max((r["id"] for r in rows), default=0)
    if not follow:
        return _table(REQUEST_HEADERS, _request_rows(rows))
    # following: fixed-width lines (a table cannot grow), widths from the header and the first rows
    widths = [max([len(h), 8, *(len(row[i]) for row in _request_rows(rows))])
              for i, h in enumerate(REQUEST_HEADERS)]

    def emit(batch: list[dict]) -> None:
        for r, row in zip(batch, _request_rows(batch)):
            typer.echo(json.dumps(r) if as_json else "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())

    if not as_json:
        typer.echo("  ".join(h.ljust(w) for h, w in zip(REQUEST_HEADERS, widths)).rstrip())
    emit(rows)
    try:
        while True:
            time.sleep(1.0)
            fresh = _call(url, "GET", "/admin/requests", params={**params, "after_id": last,
                                                                "limit": 10_000})["requests"][::-1]
            if fresh:
                last = fresh[-1]["id"]
                emit(fresh)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    app()
