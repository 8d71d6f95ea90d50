"""OpenAI's Codex CLI (npm @openai/codex), unmodified, headless (`codex exec --json`, then
`codex exec resume --last` twice) against the pool serving SmolLM2-135M-Instruct on
llama-server through /v1/responses, with a custom provider (wire_api = "responses") that
tries a WebSocket first. Each turn is answered; the WebSocket try gets 426 and Codex goes
on over HTTP at once (no stall of backed-off reconnects); every request has its row in the
request log, and every turn after the first reads its prefix from llama-server's cache.
scripts/test-codex installs the CLI and the model; without them this is skipped (an error
under CI). The direct-against-pool turn times are printed (pytest -s shows them)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from testkit.llama import direct_llama_server
from tests.conftest import llama
from tests.pool import wait_for
from tests.test_claude_code import _smollm2

pytestmark = pytest.mark.codex

TURNS = ["Say hello.", "Say it again, shorter.", "And once more."]
TURN_TIMEOUT_S = 240
DIRECT_TURN_TIMEOUT_S = 90  # the direct run is a measurement: a turn that talks on is cut sooner
STALL_S = 3.0  # Codex's backed-off WebSocket reconnects cost 6 s or more a turn before HTTP


@pytest.fixture(scope="module")
def codex_bin() -> str:
    path = os.environ.get("CODEX_BIN") or ""
    if not (path and Path(path).is_file()) or not _smollm2():
        if os.environ.get("CI"):
            pytest.fail("Codex or SmolLM2 is missing: .ci/run must run scripts/test-codex")
        pytest.skip("no Codex CLI or SmolLM2: run scripts/test-codex")
    return path


def provider_config(base_url: str, websockets: bool) -> str:
    """The provider block the README gives: the pool as a Responses provider (here one that
    tries a WebSocket first, as Codex's built-in provider does)."""
    return (f'model = "smollm2"\nmodel_provider = "llm-pool"\n'
            f'[model_providers.llm-pool]\nname = "llm-pool"\nbase_url = "{base_url}/v1"\n'
            f'wire_api = "responses"\nsupports_websockets = {str(websockets).lower()}\n'
            f'request_max_retries = 0\nstream_max_retries = 0\n')


def codex_turns(codex_bin: str, base_url: str, home: Path, websockets: bool = True,
                turn_timeout_s: float = TURN_TIMEOUT_S) -> list[tuple[float, list[dict]]]:
    """Three turns, each (seconds, its JSON events); a turn that fails says why."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(provider_config(base_url, websockets))
    work = home / "work"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "unused",
           "NO_COLOR": "1", "RUST_LOG": "error"}
    turns = []
    for n, prompt in enumerate(TURNS):
        resume = ["resume", "--last"] if n else []
        args = [codex_bin, "exec", "--json", "--skip-git-repo-check", "-s", "read-only", *resume, prompt]
        started = time.monotonic()
        done = subprocess.run(args, env=env, cwd=work, capture_output=True, text=True, timeout=turn_timeout_s)
        took = time.monotonic() - started
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0, (n, done.returncode, done.stdout[-3000:], done.stderr[-3000:])
        assert not [e for e in events if e.get("type") in ("error", "turn.failed")], (n, events)
        assert any(e.get("type") == "turn.completed" for e in events), (n, events, done.stderr[-2000:])
        turns.append((took, events))
    return turns


def pool_state(pool) -> dict:
    """What a turn that ran out of time leaves to read: the model's replicas, the rows of the
    requests that ended, and the end of llama-server's log."""
    return {"models": pool.http.get("/admin/models").json(),
            "requests": [{k: r.get(k) for k in ("status", "tokens_in", "tokens_out", "cached_tokens", "duration_ms")}
                         for r in pool.http.get("/admin/requests", params={"limit": 10}).json()["requests"]],
            "log": pool.http.get("/admin/models/smollm2/logs", params={"lines": 20}).text[-3000:]}


# How the model samples, here and direct. Under Codex's 4,600-token prompt, SmolLM2-135M at
# llama-server's default sampling fell into a loop ("You can find it in the Skills section. ...")
# in about one turn in three until its context was full: the turn ends "incomplete" and Codex
# fails it (or it outlasts the turn's time on a slow machine). Greedy, with the DRY sampler against
# repeated sequences, it answered every turn of 8 runs in 15 to 62 tokens. No client field changes:
# these are the server's defaults for what Codex leaves unset.
SAMPLING = ["--temp", "0", "--dry-multiplier", "0.8"]


def smollm2(llama_server_bin: str) -> dict:
    model = llama("smollm2", _smollm2(), llama_server_bin, ctx=8192, extra_args=["--jinja", *SAMPLING])
    model["options"]["threads"] = 2
    return model


@pytest.mark.timeout(3 * TURN_TIMEOUT_S + 3 * DIRECT_TURN_TIMEOUT_S + 120)  # the pool's turns, the direct ones, starts
def test_codex_answers_three_turns_through_the_pool(codex_bin, llama_server_bin, make_pool, tmp_path):
    pool = make_pool([smollm2(llama_server_bin)])
    try:
        turns = codex_turns(codex_bin, pool.url, tmp_path / "pool")
    except subprocess.TimeoutExpired as exc:  # say what the pool and llama-server were doing
        raise AssertionError(pool_state(pool)) from exc
    for took, events in turns:
        answered = [e for e in events if e.get("type") == "item.completed"
                    and e.get("item", {}).get("type") == "agent_message" and e["item"].get("text")]
        assert answered, events
    rows = wait_for(lambda: (rows := pool.http.get("/admin/requests", params={"limit": 100}).json()["requests"])
                    and len(rows) >= len(TURNS) and rows, 10, what="a row for every request")
    responses = [r for r in rows if r["endpoint"] == "responses"][::-1]
    assert len(responses) == len(rows) == len(TURNS), [(r["endpoint"], r["status"]) for r in rows]
    assert all(r["status"] == 200 for r in responses), [(r["status"], r["error_message"]) for r in responses]
    assert all(r["skipped_tools"] for r in responses)  # Codex's hosted tools (web_search), said
    # after the first turn, the conversation's prefix comes from llama-server's cache
    assert all((r["cached_tokens"] or 0) > r["tokens_in"] // 2 for r in responses[1:]), [
        (r["tokens_in"], r["cached_tokens"]) for r in responses]
    # no WebSocket stall: Codex's try gets 426 and it goes on over HTTP at once, so a turn takes
    # the pool's answer and Codex's own start, far less than its reconnects' backoff
    for (took, _), row in zip(turns, responses):
        assert took - row["duration_ms"] / 1000 < STALL_S, (took, row["duration_ms"])
    # the same turns direct, for the times side by side: a measurement, not a check of the pool (a
    # 135M model now and then talks on for thousands of tokens either way: there, bounded by -n and
    # a shorter turn, so that the measurement cannot hold the test)
    with direct_llama_server(llama_server_bin, _smollm2(),
                             ["-c", "8192", "-np", "1", "-t", "2", "--jinja", "-n", "1024", *SAMPLING],
                             tmp_path / "direct.log") as url:
        try:
            direct = [round(t, 1) for t, _ in codex_turns(codex_bin, url, tmp_path / "direct", websockets=False,
                                                          turn_timeout_s=DIRECT_TURN_TIMEOUT_S)]
        except (AssertionError, subprocess.TimeoutExpired) as exc:  # it serves no WebSocket
            direct = f"not measured ({type(exc).__name__})"
    print("\nCodex, seconds per turn: direct", direct, "pool", [round(t, 1) for t, _ in turns])
