"""Unit tests of the SSE shapes' fast path for plain text tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from supervisor.inference import sse_frame
from supervisor.openai_shapes import ChatStream, CompletionStream


@given(st.text())
def test_text_sse_is_the_chunk_sse_frame_gives(text):
    """The token path builds a plain text chunk's bytes directly: byte for byte
    what the generic path (a chunk dict through sse_frame) gives, escapes too."""
    for shape in (ChatStream("m", False), CompletionStream("m", True)):
        assert shape.text_sse(text) == sse_frame(shape.chunk({"content": text}))
