"""`llm-pool`: run the pool (`serve`) and inspect or control a running one
(a thin client over the HTTP admin API)."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from typing import Annotated
from urllib.parse import quote

import typer

from supervisor.cli import formatting as fmt
from supervisor.cli.client import Failure, call, sse_events, until_ctrl_c
from supervisor.cli.serve import init, serve
from supervisor.printable import printable

# The operator's commands answer in a fraction of a second: what only `serve` needs (the
# config's schema, the server) or only a spinner needs (rich) is imported where it is used.

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Serve several local LLMs behind one OpenAI-compatible API.")


@app.callback()
def _main() -> None:
    """Serve several local LLMs behind one OpenAI-compatible API."""


app.command()(serve)  # supervisor/cli/serve.py
app.command()(init)


# -- the operator client: a thin layer over the HTTP admin API --------------------------------
# What it prints of the server's answers goes through printable(): a client's text (a model
# name, an error) shows its control characters escaped, never sends them to the terminal.

DEFAULT_URL = "http://127.0.0.1:8000"
Url = Annotated[str, typer.Option("--url", envvar="LLM_POOL_URL", help="the pool's base URL")]
AsJson = Annotated[bool, typer.Option("--json", help="print the server's raw JSON list (the same as -o json)")]
Output = Annotated[str | None, typer.Option(
    "--output", "-o", metavar="wide|json",
    help="wide: every column, a row a line (for grep and awk); json: the server's JSON, for scripts. "
         "Without it, a table that fits the terminal (80 columns piped).")]
Target = Annotated[str, typer.Argument(metavar="NAME[/REPLICA]", help="a model, or one of its replicas")]


def _client(command):
    """Register a client command; a Failure in it becomes `llm-pool: <message>` and exit 1."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Failure as exc:
            typer.echo(f"llm-pool: {printable(str(exc))}", err=True)
            raise typer.Exit(1) from None
    return app.command()(run)


def _output(output: str | None, as_json: bool) -> str:
    """The output mode: "" (the table for the terminal), "wide" or "json" (--json: -o json)."""
    if output not in (None, "wide", "json"):
        raise Failure(f"-o {output!r}: expected wide or json")
    return "json" if as_json else output or ""


def _model_path(name: str, action: str) -> str:
    return f"/admin/models/{quote(name, safe='')}/{action}"


def _model_view(url: str, name: str) -> dict:
    for view in call(url, "GET", "/admin/models", timeout=5.0)["models"]:
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
    from rich.console import Console
    from rich.text import Text
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


PS_COLUMNS = [("MODEL", fmt.FLEX), ("REPLICA", fmt.KEEP), ("PID", fmt.KEEP), ("STATE", fmt.KEEP),
              ("UPTIME", fmt.FIT), ("RESTARTS", fmt.KEEP), ("CRASHES", fmt.KEEP), ("LAST EXIT", fmt.BELOW),
              ("WHO ENDED IT", fmt.BELOW), ("INFLIGHT", fmt.KEEP),
              ("RSS", fmt.FIT), ("CPU%", fmt.FIT), ("NODE", fmt.WIDE), ("GPU MEM", fmt.WIDE),
              ("CHILDREN", fmt.BELOW), ("ERROR", fmt.BELOW)]


@_client
def ps(url: Url = DEFAULT_URL, output: Output = None, as_json: AsJson = False) -> None:
    """One row per replica: process, state, load, memory, CPU, GPU, children."""
    mode = _output(output, as_json)
    workers = call(url, "GET", "/admin/workers")["workers"]
    if mode == "json":
        return fmt.print_json(workers)
    if not workers:
        typer.echo("no replicas running", err=True)
        return
    # -o wide: the error column only when there is something in it
    columns = PS_COLUMNS if any(w.get("last_error") for w in workers) else PS_COLUMNS[:-1]
    fmt.table(columns, [
        (fmt.clip(w["model"]), str(w["replica"]), fmt.dash(w["pid"]), w["state"], fmt.duration(w["uptime_s"]),
         str(w["restarts"]), str(w.get("crashes", 0)), w.get("last_exit") or "-",
         fmt.one_line(w.get("last_exit_why")) if w.get("last_exit_why") else "-", f"{w['inflight']}/{w['capacity']}",
         fmt.size(w["rss_bytes"]), "-" if w["cpu_percent"] is None else f"{w['cpu_percent']:.1f}", _node(w),
         fmt.size(w["gpu_memory_bytes"]),  # None (no GPU, no NVML) stays "-"
         ", ".join(f"{c['name']}:{c['pid']}" for c in w["children"]) or "-", fmt.one_line(w.get("last_error")))
        for w in workers], wide=mode == "wide")


def _node(worker: dict) -> str:
    """The host a replica runs on; a Ray node by its address (hosts may share a name) and id."""
    if worker.get("node_id"):
        return f"{worker.get('node_address') or worker.get('node') or '-'} (ray {worker['node_id'][:8]})"
    return worker.get("node") or "-"


MODEL_COLUMNS = [("NAME", fmt.FLEX), ("BACKEND", fmt.KEEP), ("STATE", fmt.KEEP), ("READY", fmt.KEEP),
                 ("QUEUE", fmt.KEEP), ("INFLIGHT", fmt.KEEP), ("CAPACITY cfg/eff", fmt.FIT), ("CONTEXT", fmt.FIT),
                 ("MEMORY", fmt.FIT), ("LAST USED", fmt.FIT), ("IDLE UNLOAD IN", fmt.WIDE), ("PINNED", fmt.WIDE),
                 ("WARM SWAP", fmt.WIDE), ("ALIASES", fmt.BELOW), ("ERROR", fmt.BELOW)]


def warm_swap_cell(view: dict | None) -> str:
    """A model's warm swaps: "-" where its runtime cannot save its KV, "off: why", or "on" with
    what is saved and what its replicas restored at their last load."""
    if view is None:
        return "-"
    if not view["on"]:
        return f"off: {fmt.one_line(view['off_reason'], 60)}"
    saved = view["saved"]
    text = f"on, {saved['conversations']} saved ({fmt.size(saved['bytes'])})" if saved["conversations"] else "on"
    restored = view.get("last_restore") or {}
    return text + (f", restored {restored['restored']}" if restored.get("restored") else "")


@_client
def models(url: Url = DEFAULT_URL, output: Output = None, as_json: AsJson = False) -> None:
    """One row per configured model: state, replicas, queue, inflight, capacity, error."""
    mode = _output(output, as_json)
    views = call(url, "GET", "/admin/models")["models"]
    if mode == "json":
        return fmt.print_json(views)
    # -o wide: the error column only when there is something in it
    columns = MODEL_COLUMNS if any(m["error"] for m in views) else MODEL_COLUMNS[:-1]
    fmt.table(columns, [
        (fmt.clip(m["name"]), m["backend"], m["state"] + (" (held)" if m.get("held") else ""), f"{m['replicas_ready']}/{m['replicas']}",
         str(m["queue_depth"]), str(m["runtime_inflight"]),
         f"{m['configured_target_inflight']}/{m['effective_target_inflight']}", fmt.dash(m.get("context_length")),
         "-" if m.get("memory_mb") is None else f"{m['memory_mb']:g} MB ({m['memory_source']})",
         "-" if m.get("last_used_at") is None else f"{fmt.duration(time.time() - m['last_used_at'])} ago",
         fmt.duration(m.get("idle_unload_in_s")), "yes" if m.get("pinned") else "no",
         warm_swap_cell(m.get("warm_swap")), ", ".join(m.get("aliases") or []) or "-", fmt.one_line(m["error"]))
        for m in views], wide=mode == "wide")


@_client
def load(name: Annotated[str, typer.Argument(help="model name")], url: Url = DEFAULT_URL) -> None:
    """Load a model and wait until it is loaded (exit 1 with the reason if it fails)."""
    def describe(elapsed: float) -> str:
        view = _model_view(url, name)
        return f"{name}: {view['state']}, {view['replicas_ready']}/{view['replicas']} ready, {elapsed:.0f}s"

    view = _waiting(lambda: call(url, "POST", _model_path(name, "load"), timeout=None), describe)
    took = f" (load took {view['load_seconds']:.1f}s)" if view.get("load_seconds") is not None else ""
    typer.echo(f"{name}: {view['state']}{took}")


@_client
def unload(name: Annotated[str, typer.Argument(help="model name")], url: Url = DEFAULT_URL,
           hold: Annotated[bool, typer.Option("--hold", help="keep it unloaded: no load on demand until "
                                              "`llm-pool load NAME` or a reload")] = False) -> None:
    """Unload a model: refuse new requests, let running ones finish, stop its workers."""
    def describe(elapsed: float) -> str:
        view = _model_view(url, name)
        return (f"{name}: {view['state']}, draining: {view['queue_depth']} queued, "
                f"{view['runtime_inflight']} running, {elapsed:.0f}s")

    params = {"hold": "true"} if hold else None
    view = _waiting(lambda: call(url, "POST", _model_path(name, "unload"), params=params, timeout=None), describe)
    typer.echo(f"{name}: {view['state']}" + (" (held: no load on demand until `llm-pool load`)"
                                             if view.get("held") else ""))


@_client
def restart(target: Target, url: Url = DEFAULT_URL,
            now: Annotated[bool, typer.Option("--now", help="cut running jobs instead of letting them finish")]
            = False) -> None:
    """Restart a model's replicas (one after another), or just one (NAME/REPLICA). Each is first
    taken out of rotation and its running jobs finish (up to the model's drain_timeout_s)."""
    name, replica = _target(target)

    def describe(elapsed: float) -> str:
        view = _model_view(url, name)
        return (f"restarting {target}: {view['replicas_ready']}/{view['replicas']} ready, "
                f"{view['runtime_inflight']} running, {elapsed:.0f}s")

    params = {**({} if replica is None else {"replica": replica}), **({"now": "true"} if now else {})} or None
    view = _waiting(lambda: call(url, "POST", _model_path(name, "restart"), params=params,
                                  timeout=None), describe)
    typer.echo(f"{target}: restarted; {name} {view['state']}, "
               f"{view['replicas_ready']}/{view['replicas']} replicas ready")


@_client
def reload(url: Url = DEFAULT_URL, as_json: AsJson = False) -> None:
    """Re-read the config file: add, remove and reload the models that changed; keep the rest running."""
    result = call(url, "POST", "/admin/reload", timeout=None)
    if as_json:
        return fmt.print_json(result)
    for key in ("added", "removed", "reloaded", "kept"):
        typer.echo(f"{key}: {', '.join(result[key]) or '-'}")


CHECK_UNHEALTHY = 2  # `check`: a model is degraded or failed (the pool may still serve the others)


@_client
def check(url: Url = DEFAULT_URL) -> None:
    """Exit 0 when the pool is ready and every model healthy; 2 when a model is degraded or
    failed (each printed with why, whether or not the others serve); 1 when the pool cannot be
    reached, or is starting or stopping."""
    body = call(url, "GET", "/ready", timeout=10.0, accept=(503,))
    health = call(url, "GET", "/health", timeout=10.0)
    models = health.get("models") if isinstance(health.get("models"), dict) else {}

    def why(name: str) -> str:
        m = models.get(name) or {}
        reason = fmt.one_line(m.get("reason"), 200) if m.get("reason") else "no reason recorded"
        return f"{name} {m.get('state', '?')} ({m.get('ready', 0)}/{m.get('configured', 0)} ready): {reason}"

    unhealthy = [n for n in health.get("unhealthy") or [] if isinstance(n, str)]
    status = body.get("status")
    if status == "starting":
        waiting = ", ".join(body.get("waiting_for") or []) or "its models"
        raise Failure(f"not ready: starting (loading {waiting})" + "".join(f"; {why(n)}" for n in unhealthy))
    if status == "shutting_down":
        raise Failure("not ready: shutting down")
    for name in unhealthy:
        typer.echo(why(name))
    if status != "ready":
        typer.echo(f"llm-pool: not ready: no model can serve ({len(unhealthy)} degraded or failed)", err=True)
        raise typer.Exit(CHECK_UNHEALTHY)
    if unhealthy:
        typer.echo(f"llm-pool: ready, but {len(unhealthy)} model(s) degraded or failed", err=True)
        raise typer.Exit(CHECK_UNHEALTHY)
    planned = [f"{n} ({', '.join(m['restarting'])} restarting)" for n, m in models.items()
               if isinstance(m, dict) and m.get("restarting")]
    planned += [f"{n} unloading ({fmt.planned_unload(m['unloading'])})" for n, m in models.items()
                if isinstance(m, dict) and isinstance(m.get("unloading"), dict)]
    typer.echo("ready" + (f"; planned work: {'; '.join(planned)}" if planned else ""))


SUPERVISOR = "supervisor"  # `llm-pool logs supervisor`: the supervisor's own log
FOLLOW_REPRINT_S = 10.0  # `events -f`: a repeat's line with its count, at most this often


@_client
def logs(target: Annotated[str, typer.Argument(
             metavar="NAME[/REPLICA]|supervisor",
             help="a model (replica 0) or one of its replicas; `supervisor` for the supervisor's own log")],
         lines: Annotated[int, typer.Option("-n", "--lines", min=1, help="how many lines")] = 200,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="then print new lines as they are "
                                              "written, until Ctrl-C")] = False,
         url: Url = DEFAULT_URL) -> None:
    """The tail of a replica's log (the worker's and its backend's output), or of the supervisor's."""
    if target == SUPERVISOR:
        path, live, params = "/admin/logs/supervisor", "/admin/logs/supervisor/live", {"lines": lines}
    else:
        name, replica = _target(target)
        path, live = _model_path(name, "logs"), _model_path(name, "logs/live")
        params = {"replica": replica or 0, "lines": lines}
    if not follow:
        for line in call(url, "GET", path, params=params)["lines"]:
            typer.echo(printable(line, keep="\t"))
        return
    call(url, "GET", path, params={**params, "lines": 1})  # a bad name or replica fails here, in one line
    with until_ctrl_c():
        for _event, data in sse_events(url, live, params):
            for line in data:
                typer.echo(printable(line, keep="\t"))


def _since_param(text: str | None) -> str | None:
    """'10m', '2h', '3d', '45s' (before now), or what the server takes (unix seconds, ISO 8601)."""
    if text is None:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        return str(time.time() - float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]])
    return text


ID_CHARS = 128  # a request id is never cut (the edge takes a client's up to 128 characters)


def _request_rows(rows: list[dict]) -> list[tuple[str, ...]]:
    return [(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])),
             fmt.clip(r["model"]), fmt.clip(r.get("replica"), 44), fmt.clip(r.get("tenant"), 40),
             fmt.clip(r["endpoint"]),
             str(r["status"]), fmt.clip(r["error_code"]), fmt.ms(r["queued_ms"]), fmt.ms(r["ttft_ms"]),
             fmt.ms(r["duration_ms"]), fmt.dash(r["tokens_in"]), fmt.dash(r.get("cached_tokens")), fmt.dash(r["tokens_out"]),
             fmt.dash(r["tokens_per_s"]), fmt.dash(r.get("prefill_tokens_per_s")), fmt.dash(r.get("decode_tokens_per_s")),
             fmt.dash(r.get("speeds_from")), fmt.clip(r.get("request_id"), ID_CHARS))
            for r in rows]


# CACHED: of IN, from the runtime's prompt cache ("-": the runtime did not say); PREFILL/S and
# DECODE/S: tokens/s of each phase, timed by the runtime or derived from the pool's times (FROM)
REQUEST_COLUMNS = [("TIME", fmt.KEEP), ("MODEL", fmt.FLEX), ("REPLICA", fmt.WIDE), ("TENANT", fmt.FIT),
                   ("ENDPOINT", fmt.WIDE), ("STATUS", fmt.KEEP), ("ERROR", fmt.SPILL), ("QUEUED", fmt.FIT),
                   ("TTFT", fmt.KEEP), ("DURATION", fmt.KEEP), ("IN", fmt.FIT), ("CACHED", fmt.WIDE),
                   ("OUT", fmt.KEEP), ("TOK/S", fmt.WIDE), ("PREFILL/S", fmt.WIDE), ("DECODE/S", fmt.WIDE),
                   ("FROM", fmt.WIDE), ("REQUEST ID", fmt.SPILL)]
REQUEST_HEADERS = [h for h, _ in REQUEST_COLUMNS]


@_client
def requests(url: Url = DEFAULT_URL, output: Output = None, as_json: AsJson = False,
             model: Annotated[str | None, typer.Option("--model", "-m", help="only this model")] = None,
             tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="only this tenant's")] = None,
             request_id: Annotated[str | None, typer.Option("--id", help="only this request id (its answer's "
                                                            "x-request-id)")] = None,
             status: Annotated[str | None, typer.Option(help="an HTTP status, a class (4xx, 5xx), 'ok' or "
                                                         "'error'")] = None,
             since: Annotated[str | None, typer.Option(help="e.g. 10m, 2h, 1d, or an ISO 8601 time")] = None,
             limit: Annotated[int, typer.Option("-n", "--limit", min=1, max=10_000,
                                                help="how many (the newest)")] = 50,
             follow: Annotated[bool, typer.Option("--follow", "-f", help="then print new ones as they finish")]
             = False) -> None:
    """Recent requests from the request log, oldest first: status, error, queue wait, TTFT,
    duration, tokens. --follow keeps printing until Ctrl-C (one JSON object a line with --json).
    --id (without --follow) prints that request's whole story: admission, queue wait, replica,
    TTFT, tokens, its end, and the events and replica log lines from around its time."""
    mode = _output(output, as_json)
    as_json = mode == "json"
    if request_id is not None and not follow:
        stories = call(url, "GET", "/admin/requests/story", params={"id": request_id})["stories"][::-1]
        if as_json:
            return fmt.print_json(stories)
        if not stories:
            typer.echo(f"llm-pool: no request with id {request_id!r} in the request log", err=True)
            raise typer.Exit(1)
        for told in stories:
            typer.echo("\n".join(fmt.story_lines(told["row"], told["story"])))
        return None
    params = {k: v for k, v in {"model": model, "tenant": tenant, "id": request_id, "status": status,
                                "since": _since_param(since), "limit": limit}.items() if v is not None}
    rows = call(url, "GET", "/admin/requests", params=params)["requests"][::-1]
    if as_json and not follow:
        return fmt.print_json(rows)
    last = max((r["id"] for r in rows), default=0)
    if not follow:
        return fmt.table(REQUEST_COLUMNS, _request_rows(rows), wide=mode == "wide")
    # following: fixed-width lines (a table cannot grow), widths from the header and the first rows
    widths = [max([len(h), 8, *(len(row[i]) for row in _request_rows(rows))])
              for i, h in enumerate(REQUEST_HEADERS)]

    def emit(batch: list[dict]) -> None:
        for r, row in zip(batch, _request_rows(batch)):
            typer.echo(json.dumps(r) if as_json else "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())

    if not as_json:
        typer.echo("  ".join(h.ljust(w) for h, w in zip(REQUEST_HEADERS, widths)).rstrip())
    emit(rows)
    with until_ctrl_c():
        while True:
            time.sleep(1.0)
            fresh = call(url, "GET", "/admin/requests", params={**params, "after_id": last,
                                                                "limit": 10_000})["requests"][::-1]
            if fresh:
                last = fresh[-1]["id"]
                emit(fresh)


def _event_line(e: dict) -> str:
    where = e["model"] or "-"
    if e.get("replica") is not None:
        where += f"/{e['replica']}"
    by = f" (asked by {e['by']})" if e.get("by") else ""
    message = e["message"].replace("\n", " | ")
    count = e.get("count") or 1  # folded repeats (GET /admin/events?fold=true)
    kind = f"{e['kind']} ×{count}" if count > 1 else e["kind"]
    repeats = f" (×{count} over {fmt.duration(e['ts'] - e['first_ts'])})" if count > 1 else ""
    return printable(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['ts']))}  {e['level']:<7}  "
                     f"{kind:<14}  {fmt.clip(where, 40):<12}  {message}{by}{repeats}")


@_client
def events(url: Url = DEFAULT_URL, as_json: AsJson = False,
           model: Annotated[str | None, typer.Option("--model", "-m", help="only this model")] = None,
           limit: Annotated[int, typer.Option("-n", "--limit", min=1, max=10_000, help="how many (the newest)")]
           = 50,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="then print new ones as they happen")]
           = False,
           each: Annotated[bool, typer.Option("--each", help="every event on its own line: repeats (a crash "
                                              "loop) are not folded")] = False) -> None:
    """The event timeline, oldest first: the supervisor's start and stop, loads, unloads,
    evictions, crashes, restarts (and who asked), reloads, models turning degraded or failed.
    Repeats fold into one line ("crashed ×6 over 15s") unless --each. --follow keeps printing
    until Ctrl-C; a repeat there prints its line again with the count, at most every 10 s."""
    params = {k: v for k, v in {"model": model, "limit": limit}.items() if v is not None}
    body = call(url, "GET", "/admin/events", params={**params, **({} if each else {"fold": "true"})})
    rows = body["events"]
    if as_json and not follow:
        return fmt.print_json(rows)

    def emit(batch: list[dict]) -> None:
        for e in batch:
            typer.echo(json.dumps(e) if as_json else _event_line(e))

    emit(rows)
    if not follow:
        return
    from supervisor.events import Folder  # -f alone needs it
    folder = Folder()
    for row in rows:  # printed folded (unless --each): a repeat of one counts on
        folder.seen(row)
    # a repeat's line is printed again with its count at most every FOLLOW_REPRINT_S (a crash
    # loop is a line every 10 s, not one per crash); the last count shows within that time
    printed_at: dict[tuple, float] = {}
    pending: dict[tuple, dict] = {}
    last = body.get("last_id") or 0
    with until_ctrl_c():
        while True:
            time.sleep(1.0)
            got = call(url, "GET", "/admin/events", params={**params, "after_id": last, "limit": 10_000})
            last = got.get("last_id") or last
            if each or as_json:
                emit(got["events"])
                continue
            now = time.monotonic()
            for e in got["events"]:
                key = folder.key(e)
                folded, new = folder.add(e)
                if new:
                    if key in pending:  # its earlier run's last count, not printed yet
                        emit([pending.pop(key)])
                    emit([folded])
                    printed_at[key] = now
                else:
                    pending[key] = folded
            for key, folded in list(pending.items()):
                if now - printed_at.get(key, 0.0) >= FOLLOW_REPRINT_S:
                    emit([folded])
                    printed_at[key] = now
                    del pending[key]
            folder.prune(time.time())
            printed_at = {k: t for k, t in printed_at.items() if k in folder.latest or k in pending}


if __name__ == "__main__":
    app()
