"""What the bench says: progress on stderr, and the figures and tables of its report."""

from __future__ import annotations

import os
import sys
import time

from pool_bench.load import Round


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ms(v: float | None) -> str:
    return "-" if v is None else (f"{v * 1000:.0f}" if v >= 0.1 else f"{v * 1000:.1f}")


def num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def per_1k_tokens(r: Round, key: str | None = None) -> str:
    cpu = r.cpu if key is None else r.cpu_by.get(key)
    return "-" if not r.tokens or cpu is None else f"{cpu * 1000 / (r.tokens / 1000):.0f}"


def per_request_us(r: Round, key: str | None = None) -> str:
    cpu = r.cpu if key is None else r.cpu_by.get(key)
    return "-" if not r.done or cpu is None else f"{cpu * 1e6 / r.done:,.0f}"


def loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def mib(v: int | None) -> str:
    return "-" if not v else f"{v / 2**20:.0f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def errors_note(name: str, r: Round) -> str | None:
    if not r.errors:
        return None
    return f"{name}: {len(r.errors)} failed requests, first: {r.errors[0]}"

