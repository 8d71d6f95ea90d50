"""The relay of a native runtime's output into the worker's log: lines of any
length, and a child that never blocks on a full pipe."""

from __future__ import annotations

import asyncio
import contextlib
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


def test_a_log_that_cannot_be_written_drops_lines_and_never_stops_the_runtime(tmp_path, monkeypatch):
    """The replica's log on a full disk (/dev/full: every write is ENOSPC): the runtime's lines
    are dropped and counted, the runtime keeps running (it was SIGKILLed, and its model went
    down for good), and once the log takes lines again the count is written there first."""
    full = open("/dev/full", "w", buffering=1)  # line-buffered, as a worker's redirected stderr
    log = tmp_path / "replica.log"
    go_on = tmp_path / "go-on"
    script = ("import os, sys, time\n"
              "for i in range(50): print('line', i, flush=True)\n"
              f"while not os.path.exists({str(go_on)!r}): time.sleep(0.02)\n"
              "print('after the disk was freed', flush=True)\n"
              "time.sleep(60)\n")

    async def run() -> NativeServer:
        server = NativeServer("child", logging.getLogger("test"))
        monkeypatch.setattr(sys, "stderr", full)
        await server.launch([sys.executable, "-c", script], key_env="UNUSED_KEY")
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while server.dropped_lines < 50:
                assert asyncio.get_running_loop().time() < deadline, server.dropped_lines
                await asyncio.sleep(0.02)
            assert server.proc.returncode is None and not server._relay.done()
            with open(log, "w", buffering=1) as writable:
                monkeypatch.setattr(sys, "stderr", writable)
                go_on.touch()
                while "after the disk was freed" not in log.read_text():
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.02)
            assert server.proc.returncode is None
        finally:
            monkeypatch.setattr(sys, "stderr", sys.__stderr__)
            await server.stop()
        return server

    asyncio.run(run())
    with contextlib.suppress(OSError):  # what it still buffers cannot be written either
        full.close()
    lines = log.read_text().splitlines()
    assert lines[0].startswith("[child] (50 lines of output dropped") and "No space left" in lines[0], lines
    assert lines[1] == "[child] after the disk was freed", lines
