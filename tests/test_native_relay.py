"""The relay of a native runtime's output into the worker's log: lines of any
length, and a child that never blocks on a full pipe."""

from __future__ import annotations

import asyncio
import logging
import sys

from runtime_worker.native_server import RELAY_LINE_BYTES, NativeServer


def test_a_70_kib_line_neither_kills_the_relay_nor_blocks_the_child(capfd):
    async def run() -> NativeServer:
        server = NativeServer("child", logging.getLogger("test"))
        # 70 KiB in one line, then 8 MiB more (far past a pipe's buffer), then a marker
        script = ("import sys; sys.stdout.write('x' * 70 * 1024 + '\\n');"
                  "sys.stdout.write(('y' * 1023 + '\\n') * 8192); print('the end')")
        await server.launch([sys.executable, "-c", script], key_env="UNUSED_KEY")
        code = await asyncio.wait_for(server.proc.wait(), 60)  # a blocked child would never exit
        await asyncio.wait_for(server._relay, 10)
        assert code == 0
        await server.stop()
        return server

    server = asyncio.run(run())
    assert server.tail[-1] == "the end"
    err = capfd.readouterr().err
    assert err.count("[child] " + "x" * RELAY_LINE_BYTES) == 70 * 1024 // RELAY_LINE_BYTES
    assert "[child] the end" in err
