"""What the request a task serves is, as its request-log row records it: set by the edge
(edge/request_ids.py, the Responses mapping), read when the row is written (live.Activity),
so no stage in between carries it."""

from __future__ import annotations

from contextvars import ContextVar

# the id of the request this task serves (set by the edge); None outside a request
REQUEST_ID: ContextVar[str | None] = ContextVar("llm_pool.request_id", default=None)
# the tools the request's body named that the pool left out (set by the Responses mapping); None: none
SKIPPED_TOOLS: ContextVar[str | None] = ContextVar("llm_pool.skipped_tools", default=None)
