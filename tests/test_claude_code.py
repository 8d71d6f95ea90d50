"""The Claude Code CLI (npm @anthropic-ai/claude-code), unmodified, in headless mode
against the pool serving SmolLM2-135M-Instruct on llama-server (ctx 8192) through
/v1/messages: its request (its system prompt, about 1,500 to 5,000 tokens) goes
through the translation both ways and it reads every answer (no API error).
scripts/test-claude-code installs the CLI and the model; without them this is skipped
(an error under CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import llama
from tests.pool import ROOT, wait_for

pytestmark = pytest.mark.claude_code


def _smollm2() -> str | None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from pool_bench.fairness import smollm2_gguf  # the wheel's GGUF, found without importing it
    return smollm2_gguf()


@pytest.fixture(scope="module")
def claude_bin() -> str:
    path = os.environ.get("CLAUDE_CODE_BIN") or ""
    if not (path and Path(path).is_file()) or not _smollm2():
        if os.environ.get("CI"):
            pytest.fail("Claude Code or SmolLM2 is missing: .ci/run must run scripts/test-claude-code")
        pytest.skip("no Claude Code CLI or SmolLM2: run scripts/test-claude-code")
    return path


def test_claude_code_answers_through_the_pool(claude_bin, llama_server_bin, make_pool, tmp_path):
    # its model slots land on the one resident model through aliases, as the README shows
    model = llama("smollm2", _smollm2(), llama_server_bin, ctx=8192, extra_args=["--jinja"],
                  aliases=["claude-sonnet", "claude-haiku"])
    model["options"]["threads"] = 2
    pool = make_pool([model])
    env = {**os.environ, "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": pool.url, "ANTHROPIC_AUTH_TOKEN": "unused",
           "ANTHROPIC_MODEL": "smollm2", "ANTHROPIC_DEFAULT_SONNET_MODEL": "claude-sonnet",
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": "claude-haiku", "ANTHROPIC_DEFAULT_OPUS_MODEL": "smollm2",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           # a 135M model writes until its context is full when let: a cap keeps the run short
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200"}
    started = time.monotonic()
    # no tools: a 135M model that calls them runs turn after turn (its tool calls go through the pool
    # in tests/test_messages.py, from a runtime scripted to make them)
    done = subprocess.run([claude_bin, "-p", "Say hello.", "--output-format", "json", "--tools", ""], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - started
    result = json.loads(done.stdout)  # one JSON object, whatever the outcome
    # No API error: every answer was one Claude Code took. What a 135M model writes is its own:
    # it ends its turn (is_error false), or it runs to the cap, which the pool reports as
    # stop_reason max_tokens and Claude Code then calls an error of its own
    assert result["api_error_status"] is None, result
    ran_to_cap = f"exceeded the {env['CLAUDE_CODE_MAX_OUTPUT_TOKENS']} output token maximum"
    assert result["is_error"] is False or ran_to_cap in result["result"], result
    assert result["result"] and done.returncode == (1 if result["is_error"] else 0), (result, done.stderr[-2000:])

    def served() -> list[dict]:  # the request log is written off the loop: its rows come a moment later
        rows = pool.http.get("/admin/requests", params={"limit": 50}).json()["requests"]
        return [r for r in rows if r["endpoint"] == "messages"]
    rows = wait_for(served, 10, what="the Messages requests in the request log")
    assert all(r["status"] == 200 for r in rows), rows
    prompt = result["usage"]["input_tokens"] + result["usage"].get("cache_read_input_tokens", 0)
    print(f"claude -p took {took:.1f} s; {len(rows)} Messages requests; a prompt of {prompt} tokens; "
          f"{'ran to the cap' if result['is_error'] else 'ended its turn'}")
