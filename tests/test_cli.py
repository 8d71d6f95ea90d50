"""The operator CLI (`llm-pool ps/models/load/unload/restart/check/logs`), run as a real
subprocess against live pools, its figures checked against the processes themselves."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from tests.conftest import llama, synthetic
from tests.pool import ROOT, free_port, wait_for


def cli(*args: str, url: str | None = None, env: dict | None = None,
        timeout: float = 120, text: bool = True) -> subprocess.CompletedProcess:
    """Run `llm-pool ARGS` (python -m supervisor.cli) and return the finished process
    (its output as bytes with text=False: every byte it wrote, a lone \r too)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LLM_POOL_URL", "LLM_POOL_ADMIN_KEY")}
    cmd = [sys.executable, "-m", "supervisor.cli", *args] + (["--url", url] if url else [])
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=text, timeout=timeout,
                          env={**base, **(env or {})})


def cli_json(*args: str, url: str) -> list[dict]:
    done = cli(*args, "--json", url=url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_one_line_error(done: subprocess.CompletedProcess, text: str) -> None:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.startswith("llm-pool: ") and done.stderr.count("\n") == 1, done.stderr
    assert text in done.stderr, done.stderr


def table_rows(output: str) -> list[dict[str, str]]:
    """Parse the CLI's table (header line, then rows; columns at least two spaces apart)."""
    header, *rows = [line.rstrip() for line in output.splitlines() if line.strip()]
    names = re.split(r"\s{2,}", header)
    parsed = [re.split(r"\s{2,}", row) for row in rows]
    assert all(len(cells) == len(names) for cells in parsed), output
    return [dict(zip(names, cells)) for cells in parsed]


UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}


def parse_bytes(text: str) -> float:
    number, unit = text.split(" ")
    return float(number) * UNITS[unit]


def with_options(model: dict, **options) -> dict:
    model["options"].update(options)
    return model


def assert_rss_sane(reported: int, pid: int) -> None:
    actual = psutil.Process(pid).memory_info().rss
    assert actual / 2 <= reported <= actual * 2, (pid, reported, actual)


def test_synthetic_pool_through_the_cli(make_pool):
    pool = make_pool([synthetic("syn", replicas=2, capacity=2, target_inflight=2),
                      with_options(synthetic("lazy", load_on_start=False, tps=20, tokens=80),
                                   load_ms=1500)])
    url = pool.url

    # ps --json: the real worker processes, with sane RSS
    workers = cli_json("ps", url=url)
    assert sorted((w["model"], w["replica"]) for w in workers) == [("syn", 0), ("syn", 1)]
    assert {w["pid"] for w in workers} == {p.pid for p in pool.descendants()}
    for w in workers:
        assert psutil.pid_exists(w["pid"]) and "runtime_worker" in " ".join(psutil.Process(w["pid"]).cmdline())
        assert_rss_sane(w["rss_bytes"], w["pid"])

    # ps table: one row per replica, with its pid, human RSS and no made-up GPU figure
    done = cli("ps", "-o", "wide", url=url)
    assert done.returncode == 0, done.stderr
    rows = {int(r["PID"]): r for r in table_rows(done.stdout)}
    assert set(rows) == {w["pid"] for w in workers}
    for w in workers:
        row = rows[w["pid"]]
        assert row["MODEL"] == "syn" and row["REPLICA"] == str(w["replica"]) and row["STATE"] == "ready"
        assert row["INFLIGHT"] == "0/2" and row["CHILDREN"] == "-"
        assert row["NODE"] == w["node"] == socket.gethostname() and w["node_id"] is None  # local: this host
        assert abs(parse_bytes(row["RSS"]) - w["rss_bytes"]) <= 0.03 * w["rss_bytes"]  # idle: ~stable
        assert (row["GPU MEM"] == "-") == (w["gpu_memory_bytes"] is None)

    # models: states, replicas, capacities; the URL may come from LLM_POOL_URL
    done = cli("models", "--json", env={"LLM_POOL_URL": url})
    assert done.returncode == 0, done.stderr
    views = {m["name"]: m for m in json.loads(done.stdout)}
    assert views["syn"]["state"] == "loaded" and views["syn"]["replicas_ready"] == 2
    assert views["lazy"]["state"] == "unloaded"
    done = cli("models", "-o", "wide", url=url)
    table = {r["NAME"]: r for r in table_rows(done.stdout)}
    assert table["syn"]["STATE"] == "loaded" and table["syn"]["READY"] == "2/2"
    assert table["syn"]["CAPACITY cfg/eff"] == "4/4" and table["lazy"]["STATE"] == "unloaded"

    # load: while it runs (load_ms) the model is loading; then loaded, and its worker shows in ps
    loading = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "load", "lazy", "--url", url],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"})
    wait_for(lambda: pool.model("lazy")["state"] == "loading", 10, what="lazy loading")
    out, err = loading.communicate(timeout=60)
    assert loading.returncode == 0, err
    assert re.fullmatch(r"lazy: loaded \(load took \d+\.\ds\)\n", out), out
    assert "lazy: loading" in err  # the spinner showed the state polled from the server
    assert pool.model("lazy")["state"] == "loaded"
    assert [w["model"] for w in cli_json("ps", url=url)].count("lazy") == 1

    # unload waits for the drain, and shows it: a running generation (80 tokens at 20/s) finishes
    result = {}
    request = threading.Thread(target=lambda: result.update(r=httpx.post(
        url + "/v1/chat/completions", timeout=60,
        json={"model": "lazy", "messages": [{"role": "user", "content": "x"}]})))
    request.start()
    wait_for(lambda: pool.model("lazy")["runtime_inflight"] == 1, 10, what="lazy generating")
    done = cli("unload", "lazy", url=url, env={"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"})
    request.join(60)
    assert done.returncode == 0 and done.stdout == "lazy: unloaded\n", done.stderr
    assert "draining: 0 queued, 1 running" in done.stderr
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 80
    assert pool.model("lazy")["state"] == "unloaded"
    assert [w["model"] for w in cli_json("ps", url=url)] == ["syn", "syn"]

    # restart one replica: its pid changes, the other's does not
    before = {w["replica"]: w["pid"] for w in cli_json("ps", url=url)}
    done = cli("restart", "syn/1", url=url)
    assert done.returncode == 0, done.stderr
    after = {w["replica"]: w["pid"] for w in cli_json("ps", url=url)}
    assert after[0] == before[0] and after[1] != before[1] and psutil.pid_exists(after[1])
    assert_one_line_error(cli("restart", "syn/7", url=url), "has no replica 7")
    assert_one_line_error(cli("restart", "syn/x", url=url), "expected NAME or NAME/REPLICA")
    assert_one_line_error(cli("load", "nope", url=url), "model 'nope' does not exist")

    # logs: the tail of the replica's own log file
    log_path = next(w["log_path"] for w in cli_json("ps", url=url) if w["replica"] == 1)
    done = cli("logs", "syn/1", "-n", "2", url=url)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    with open(log_path, errors="replace") as f:
        in_file = f.read().splitlines()
    assert 1 <= len(printed) <= 2 and all(line in in_file for line in printed)
    assert any("runtime ready" in line for line in printed), printed
    assert_one_line_error(cli("logs", "syn/9", url=url), "model 'syn' has no replica 9")

    done = cli("check", url=url)
    assert done.returncode == 0 and done.stdout == "ready\n"


def test_check_and_errors_without_a_pool():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args in (["check"], ["ps"], ["models", "--json"], ["load", "x"], ["logs", "x"]):
        assert_one_line_error(cli(*args, url=url), f"llm-pool: cannot reach {url} (connection refused)")
    assert_one_line_error(cli("check", env={"LLM_POOL_URL": url}), f"cannot reach {url}")


def test_check_names_the_models_it_waits_for(make_pool):
    # "slow" is still loading (60 s): the start-up has not settled, so the pool is not ready yet
    pool = make_pool([synthetic("quick"), with_options(synthetic("slow"), load_ms=60_000)], wait_ready=False)
    wait_for(lambda: pool.model("quick")["state"] == "loaded", 30, what="quick loaded")
    r = pool.http.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "starting", "waiting_for": ["slow"]}
    assert_one_line_error(cli("check", url=pool.url), "llm-pool: not ready: starting (loading slow)")


def test_admin_key(make_pool):
    pool = make_pool([synthetic("syn")], server={"admin_key": "s3cret"})
    assert_one_line_error(cli("ps", url=pool.url), "llm-pool: unauthorized: set LLM_POOL_ADMIN_KEY")
    assert_one_line_error(cli("ps", url=pool.url, env={"LLM_POOL_ADMIN_KEY": "wrong"}), "unauthorized")
    done = cli("ps", "--json", url=pool.url, env={"LLM_POOL_ADMIN_KEY": "s3cret"})
    assert done.returncode == 0 and [w["model"] for w in json.loads(done.stdout)] == ["syn"]
    assert cli("check", url=pool.url).returncode == 0  # /ready needs no key


@pytest.mark.llama
def test_llama_server_pool_through_the_cli(make_pool, tiny_gguf, llama_server_bin, tmp_path):
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin),
                      llama("missing", str(tmp_path / "nope.gguf"), llama_server_bin, load_on_start=False)])
    url = pool.url

    [worker] = cli_json("ps", url=url)
    assert worker["model"] == "tiny" and psutil.pid_exists(worker["pid"])
    assert_rss_sane(worker["rss_bytes"], worker["pid"])
    [child] = worker["children"]
    proc = psutil.Process(child["pid"])
    assert child["name"] == proc.name() == "llama-server" and proc.ppid() == worker["pid"]
    assert_rss_sane(child["rss_bytes"], child["pid"])

    done = cli("ps", "-o", "wide", url=url)
    [row] = table_rows(done.stdout)
    assert row["MODEL"] == "tiny" and row["PID"] == str(worker["pid"])
    assert row["CHILDREN"] == f"llama-server:{child['pid']}"

    # a load that fails: exit 1 with llama-server backend's reason; the model shows failed
    done = cli("load", "missing", url=url)
    assert_one_line_error(done, "model file not found")
    assert "failed to load" in done.stderr
    views = {m["name"]: m for m in cli_json("models", url=url)}
    assert views["tiny"]["state"] == "loaded" and views["tiny"]["effective_target_inflight"] == 1
    assert views["missing"]["state"] == "failed" and "model file not found" in views["missing"]["error"]
    table = {r["NAME"]: r for r in table_rows(cli("models", "-o", "wide", url=url).stdout)}
    assert table["missing"]["STATE"] == "failed" and "model file not found" in table["missing"]["ERROR"]
    assert table["tiny"]["ERROR"] == "-"

    # logs: the replica log (a short one: all of it), with llama-server's own output in it
    done = cli("logs", "tiny", "-n", "400", url=url)
    assert done.returncode == 0, done.stderr
    with open(worker["log_path"], errors="replace") as f:
        in_file = f.read().splitlines()
    printed = done.stdout.splitlines()
    assert 3 < len(printed) < 400 and printed == in_file[:len(printed)]
    assert any(line.startswith("[llama-server] ") for line in printed), printed
    assert len(cli("logs", "tiny", "-n", "3", url=url).stdout.splitlines()) == 3

    # the pool serves, but a model failed: check says so (exit 2), with the reason
    done = cli("check", url=url)
    assert done.returncode == 2 and done.stdout.startswith("missing failed (0/1 ready): ")
    assert "model file not found" in done.stdout
    # unload: the llama-server child goes with its worker
    done = cli("unload", "tiny", url=url)
    assert done.returncode == 0 and done.stdout == "tiny: unloaded\n", done.stderr
    wait_for(lambda: not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, 15,
             what="llama-server gone")
    # only the failed load's replica is left: listed (with its reason), no process
    [left] = cli_json("ps", url=url)
    assert left["model"] == "missing" and left["pid"] is None and "model file not found" in left["last_error"]


def test_a_url_with_v1_is_taken_as_the_pools_and_a_bad_one_is_named(make_pool):
    """An OpenAI client's base URL (…/v1) given as --url reaches the admin API beside it,
    not a 401 for a key; a URL that is not http(s) is named as such."""
    pool = make_pool([synthetic("syn")])
    for url in (pool.url + "/v1", pool.url + "/v1/"):
        done = cli("ps", "--json", url=url)
        assert done.returncode == 0 and [w["model"] for w in json.loads(done.stdout)] == ["syn"], done.stderr
    assert cli("check", url=pool.url + "/v1").returncode == 0
    assert_one_line_error(cli("ps", url="ftp://127.0.0.1:1"), "is not an http:// or https:// URL")


LONG_NAME = "a-model-with-a-rather-long-name-for-a-table"


def test_tables_fit_80_columns_and_cut_no_pid_state_or_id(make_pool):
    """At 80 columns (and piped, which is the same) ps, models and requests fit: no line over
    80, every pid, state and request id whole (a long one on its own indented line below its
    row); -o wide has every column, a row a line; -o json (and --json) the server's JSON."""
    pool = make_pool([synthetic("syn", replicas=2), synthetic(LONG_NAME, aliases=["alias-one", "alias-two"])])
    ids = [f"client-request-{n}-" + "x" * 40 for n in range(3)]
    for rid in ids:
        r = httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": rid}, timeout=30,
                       json={"model": LONG_NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=30, headers={"x-request-id": "bad-one"},
                   json={"model": "syn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1})
    assert r.status_code == 400
    workers, views = cli_json("ps", url=pool.url), cli_json("models", url=pool.url)
    wait_for(lambda: len(cli_json("requests", url=pool.url)) == 4, 10, what="4 rows in the request log")
    requests = cli_json("requests", url=pool.url)

    for env in ({"COLUMNS": "80"}, {}):  # piped without COLUMNS: the same 80-column table
        shown = {c: cli(c, url=pool.url, env=env) for c in ("ps", "models", "requests")}
        for command, done in shown.items():
            assert done.returncode == 0, done.stderr
            assert max(map(len, done.stdout.splitlines())) <= 80, (command, done.stdout)
        words = {c: set(re.split(r"[\s:]+", done.stdout)) for c, done in shown.items()}
        assert {str(w["pid"]) for w in workers} <= words["ps"] and {w["state"] for w in workers} <= words["ps"]
        assert {m["state"] for m in views} <= words["models"] and LONG_NAME in words["models"]
        assert "alias-one, alias-two" in shown["models"].stdout  # its own line, below its row
        assert {r["request_id"] for r in requests} <= words["requests"], shown["requests"].stdout
        assert {"400", "invalid_request"} <= words["requests"]

    # -o wide: every column, a row a line, whatever the terminal's width
    for command, header in (("ps", "GPU MEM"), ("models", "IDLE UNLOAD IN"), ("requests", "PREFILL/S")):
        done = cli(command, "-o", "wide", url=pool.url, env={"COLUMNS": "80"})
        assert header in done.stdout.splitlines()[0]
        assert len(table_rows(done.stdout)) == {"ps": 3, "models": 2, "requests": 4}[command]
        as_json = cli(command, "-o", "json", url=pool.url)
        assert as_json.returncode == 0 and isinstance(json.loads(as_json.stdout), list)
    assert_one_line_error(cli("ps", "-o", "yaml", url=pool.url), "expected wide or json")

    # --help wraps to the terminal
    done = cli("requests", "--help", env={"COLUMNS": "60"})
    assert done.returncode == 0 and max(map(len, done.stdout.splitlines())) <= 60, done.stdout


def test_the_operators_commands_import_neither_pydantic_nor_rich(make_pool):
    """`ps`, `models`, `check` and `requests` start fast on a busy machine: what only `serve`
    (the config's schema: pydantic) or a spinner (rich) needs is not imported (scripts/cli-speed
    measures their CPU time)."""
    pool = make_pool([synthetic("syn")])
    for command in (["ps"], ["models"], ["check"], ["requests", "-n", "5"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "supervisor.cli", *command, "--url",
                               pool.url], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "typer" in imported and not imported & {"pydantic", "rich", "httpx"}, (command, imported)


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("name", ["syn", "smollm2", "a-model-name-much-longer-than-twenty-characters"])
def test_a_default_table_fits_the_terminal_whatever_the_names_length(monkeypatch, capsys, columns, name):
    """Issue 58: a name shorter than FLEX_MIN was counted at its width when columns were fitted,
    then widened to FLEX_MIN: `models` and `requests` printed 81-82 columns (101 at 100)."""
    from supervisor.cli.formatting import FIT, FLEX, KEEP, SPILL, table
    monkeypatch.setenv("COLUMNS", str(columns))
    cells = [("MODEL", FLEX), ("STATE", KEEP)] + [(f"C{i}", FIT if i % 2 else SPILL) for i in range(12)]
    for filler in range(1, 12):  # fillers that bring the row to each width around the terminal's
        row = (name, "loaded", *(("x" * filler,) * 12))
        table(cells, [row])
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= columns, (filler, lines)
        assert lines[1].split()[1] == "loaded"  # what an operator types back is never cut
