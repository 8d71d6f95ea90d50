"""The few facts `llm-pool serve file.gguf` needs from a GGUF file's header: its
architecture, name and trained context length. Read here (a few dozen lines of the
documented format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) rather than
with the `gguf` package, which would bring numpy into the runtime's dependencies.
Every count and length is bounded: a damaged or hostile file is an error, not a hang."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
MAX_KEYS = 1 << 20
MAX_STRING = 1 << 24  # a chat template is some KB; a tokenizer's strings are short
MAX_ARRAY = 1 << 28
# value type -> struct format (fixed-size types); 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str | None
    name: str | None
    context_length: int | None
    size_bytes: int


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("the header ends early")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    if length > MAX_STRING:
        raise GGUFError(f"a string of {length} bytes")
    data = f.read(length)
    if len(data) != length:
        raise GGUFError("the header ends early")
    return data.decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int):
    if kind in SCALARS:
        return _read(f, SCALARS[kind])
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if count > MAX_ARRAY:
            raise GGUFError(f"an array of {count} items")
        if item in SCALARS:  # skipped, not read: a tokenizer's scores are 100,000s of numbers
            f.seek(count * struct.calcsize(SCALARS[item]), 1)
        else:
            for _ in range(count):
                _value(f, item)
        return None
    raise GGUFError(f"unknown value type {kind}")


def read_header(path: str | Path) -> GGUFInfo:
    path = Path(path)
    values: dict[str, object] = {}
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise GGUFError(f"{path}: GGUF version {version} is too old (2 or later)")
        _read(f, "<Q")  # tensor count
        keys = _read(f, "<Q")
        if keys > MAX_KEYS:
            raise GGUFError(f"{path}: {keys} metadata keys")
        try:
            for _ in range(keys):
                key = _string(f)
                values[key] = _value(f, _read(f, "<I"))
        except GGUFError as exc:
            raise GGUFError(f"{path}: {exc}") from None
    arch = values.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    context = values.get(f"{arch}.context_length") if arch else None
    name = values.get("general.name")
    return GGUFInfo(architecture=arch, name=name if isinstance(name, str) else None,
                    context_length=context if isinstance(context, int) and context > 0 else None,
                    size_bytes=path.stat().st_size)
