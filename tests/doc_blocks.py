"""The fenced code blocks of the docs (README.md and docs/*.md), with the example marker
above each: `<!-- example: synthetic -->`, `<!-- example: demo -->` or
`<!-- example: not run: why -->` (tests/test_doc_examples.py runs them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from testkit import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- example: (synthetic|demo|not run: .+) -->$")
SHELL, PYTHON = ("bash", "sh", "console", "shell", ""), ("python", "py")
# what makes a block talk to a pool: its address, the CLI, an SDK client
TALKS_TO_A_POOL = re.compile(r"127\.0\.0\.1:8000|^\$? ?llm-pool |OpenAI\(|Anthropic\(", re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "synthetic", "demo", "not run: ...", or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def key(self) -> str:
        """The page and the block's first command (its comment left off): stable while the
        page around it changes."""
        first = self.code.splitlines()[0] if self.code.strip() else ""
        return f"{self.page.relative_to(ROOT)}: {first.split(' #')[0].strip()}"

    @property
    def talks_to_a_pool(self) -> bool:
        return self.lang in SHELL + PYTHON and bool(TALKS_TO_A_POOL.search(self.code))


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip().split(" ")[0]
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = lines[i - 1] if i else ""
            marker = MARKER.match(above)
            found.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n",
                               marker.group(1) if marker else None))
            i = end
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]
