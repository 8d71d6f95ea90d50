"""What the server writes to a connection, joined per loop turn (see CoalescedWrites)."""

from __future__ import annotations

import asyncio


def _closing() -> bool:
    return True


class CoalescedWrites(asyncio.Transport):
    """The connection's transport as the server's protocol sees it: what it writes in
    one turn of the event loop leaves in one write, after that turn. The server writes
    a response's head and body (or an event stream's head and first event) separately,
    each a system call; joined, they are one. Its pauses and resumes of reading go to
    the connection, which also reads on its own account. Everything else passes
    straight to the real transport, a pending write going out first where order
    matters (close, write_eof); an abort drops it."""

    def __init__(self, transport: asyncio.Transport, connection) -> None:
        super().__init__()
        self._transport = transport
        self._connection = connection
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        # asked many times a request (the server, the connection): the real transport's own
        # methods, no call of this layer in between
        self.is_closing = transport.is_closing
        self.get_extra_info = transport.get_extra_info

    def write(self, data) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, list_of_data) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        if self._connection.linger():  # after a refusal: it closes once the client has the answer
            return
        self._transport.close()
        self._connection.closing()

    def half_close(self) -> None:
        """What was written goes out with a FIN; reading goes on. From now on the server sees
        this transport as closing (it writes nothing more, and keeps no keep-alive timer)."""
        self._flush()
        self._transport.write_eof()
        self.is_closing = _closing

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def pause_reading(self) -> None:
        self._connection.server_reading(False)

    def resume_reading(self) -> None:
        self._connection.server_reading(True)

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def read(self, wanted: bool) -> None:
        """The connection's own say on reading (its bounds, and the server's wish)."""
        (self._transport.resume_reading if wanted else self._transport.pause_reading)()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def get_write_buffer_limits(self):
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self):
        return self._transport.get_protocol()
