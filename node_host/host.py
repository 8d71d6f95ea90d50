"""WorkerHost: the Ray actor that owns one worker process on its node.

The supervisor's RayLauncher places it (ray.remote(WorkerHost)) where the
model's [models.ray] resources are. On its node it starts `python -m
runtime_worker` (with the CUDA_VISIBLE_DEVICES Ray set from the GPUs it
assigned), watches it, reports its exit, and answers for its processes (pid,
RSS, CPU, children, GPU memory) and its output. Jobs and tokens never pass
through it: the worker connects to the supervisor's ROUTER itself."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from procutil.sample import TreeSampler, gpu_memory_by_pid
from procutil.tree import ChildTree
from protocol.owner import OWNER_ENV
from protocol.redact import worker_env

LOG_KEEP_BYTES = 1 << 20  # the actor keeps this much of the worker's output for the supervisor to fetch
# output per poll: under Ray's inline limit (100 KB), so that none of it goes through the object store
LOG_CHUNK_BYTES = 64 * 1024


class WorkerHost:
    """The Ray actor (an asyncio one: `wait` runs while `poll` answers) that owns
    one worker process on its node. Wrapped by ray.remote() when placed."""

    def __init__(self) -> None:
        self.worker: ChildTree | None = None
        self.output = bytearray()  # the tail of the worker's stdout+stderr
        self.output_end = 0  # offset just past self.output in everything the worker wrote
        self._relay: asyncio.Task | None = None
        self._sampler = TreeSampler()  # used in one thread at a time: the supervisor polls one at a time

    async def start(self, args: list[str], env: dict[str, str]) -> dict:
        """Start the worker; its keys come in `env` (its environment, not argv)."""
        import ray
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime_worker", *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            # None in `env`: a name the worker must not see (the pool's keys, other models')
            env=worker_env(dict(os.environ), {**env, OWNER_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}),
            start_new_session=True)
        self.worker = ChildTree(proc)
        self._relay = asyncio.create_task(self._keep_output(proc.stdout))
        return {"pid": proc.pid, "node_id": ray.get_runtime_context().get_node_id(),
                "host": socket.gethostname(), "ip": ray.util.get_node_ip_address()}

    async def _keep_output(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.output += chunk
            self.output_end += len(chunk)
            if len(self.output) > LOG_KEEP_BYTES:
                del self.output[:len(self.output) - LOG_KEEP_BYTES]

    async def wait(self) -> int:
        """The worker's exit code, once it exited and whatever it left behind was killed."""
        code = await self.worker.wait()
        self.worker.kill_tree()
        try:
            await asyncio.wait_for(asyncio.shield(self._relay), 2.0)  # its last lines
        except Exception:  # TimeoutError: a runtime child still holds the pipe; it is killed
            pass
        return code

    async def stop(self, timeout_s: float) -> int:
        return await self.worker.stop(timeout_s)

    async def kill(self) -> None:
        self.worker.kill_tree()

    async def poll(self, offset: int) -> dict:
        """The process view, and up to LOG_CHUNK_BYTES of the output written since
        `offset` (`more` if there is more; `dropped` what the supervisor fell too far
        behind to get: over LOG_KEEP_BYTES)."""
        start = self.output_end - len(self.output)
        begin = max(offset, start)
        data = bytes(self.output[begin - start:begin - start + LOG_CHUNK_BYTES])
        end = begin + len(data)
        view = None
        if self.worker.returncode is None:  # psutil and NVML block: off the actor's loop
            view = await asyncio.to_thread(self._view, self.worker.pid)
        return {"view": view, "output": data, "end": end, "dropped": begin - offset, "more": end < self.output_end}

    def _view(self, pid: int) -> dict:
        self._sampler.forget_dead()
        return self._sampler.view(pid, gpu_memory_by_pid())
