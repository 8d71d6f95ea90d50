"""The worker's one sender: every message to the supervisor goes through one
FIFO drained by one task.

Deltas of the same job that pile up while the sender waits (the event loop is
busy running a backend that produces tokens faster than they are sent) leave
as one frame, so fast runtimes cost one frame per wake-up, not one per token.
A slow runtime's tokens still leave one by one, as soon as they exist: nothing
is held back to wait for company. Order per job is kept; a job's Done or Error
is never merged and never overtakes its deltas."""

from __future__ import annotations

import asyncio

import protocol as p
from protocol.loop_socket import LoopSocket

MERGE_LIMIT_CHARS = 64 * 1024  # well under the frame cap, whatever the encoding


def coalesce(batch: list[p.Message | bytes]) -> list[p.Message | bytes]:
    """Merge consecutive (per job) deltas; everything else passes as is."""
    out: list[p.Message | bytes] = []
    open_delta: dict[str, int] = {}  # job -> index in `out` of its delta still open for merging
    for item in batch:
        if isinstance(item, p.Delta):
            at = open_delta.get(item.job)
            if at is not None and len(out[at].text) + len(item.text) <= MERGE_LIMIT_CHARS:
                out[at] = p.Delta(job=item.job, text=out[at].text + item.text)
                continue
            open_delta[item.job] = len(out)
        elif isinstance(item, bytes):
            open_delta.clear()  # a raw frame (fault injection) is opaque: keep every order
        elif (job := getattr(item, "job", None)) is not None:
            open_delta.pop(job, None)
        out.append(item)
    return out


class Outbox:
    def __init__(self, sock: LoopSocket) -> None:
        self.sock = sock
        self._items: list[p.Message | bytes] = []
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()

    def put(self, item: p.Message | bytes) -> None:
        """Queue a message (or an already encoded frame); never blocks."""
        self._items.append(item)
        self._empty.clear()
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._items = self._items, []
            for item in coalesce(batch):
                await self.sock.send([item if isinstance(item, bytes) else p.encode(item)])
            if not self._items:
                self._empty.set()

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) until everything put so far has been handed to the socket."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        except TimeoutError:
            pass
