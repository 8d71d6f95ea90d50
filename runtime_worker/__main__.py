"""`python -m runtime_worker`: connect to the supervisor, load the runtime,
run jobs, heartbeat; exit when told to, or when the supervisor is gone."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

import zmq

import protocol as p
from procutil.groups import signal_group
from protocol.curve import take_curve_keys
from protocol.errors import ErrorCode, WorkerExit
from protocol.loop_socket import LoopSocket
from runtime_worker.backends import backend_class
from runtime_worker.backends.base import (
    Backend, BackendLoadError, Finished, JobError, OutputLimits, PartsDelta, RawFrame, RuntimeTasks, TextDelta)
from runtime_worker.cancel_watch import CancelWatch
from runtime_worker.lifeline import die_with_parent
from runtime_worker.outbox import Outbox
from runtime_worker.warm_swap import DEFAULT_MIN_FREE_MB, WarmSwap

log = logging.getLogger("runtime_worker")
TURN_S = 0.02  # a job relays its backend's events this long at most before the loop gets a turn


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, args.replica.encode())
        sock.setsockopt(zmq.LINGER, 500)
        if keys := take_curve_keys():  # a worker on another host: TCP, encrypted and authenticated
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        elif args.endpoint.startswith("tcp://"):
            raise SystemExit("a tcp:// endpoint needs the CURVE keys in the environment (see protocol/curve.py)")
        sock.connect(args.endpoint)
        self.sock = LoopSocket(sock, self.on_frames)
        self.outbox = Outbox(self.sock, on_job_failed=self.cancel_job)
        self.backend: Backend | None = None  # made once Setup brings the options
        self.setup: asyncio.Future[p.Setup] = asyncio.get_running_loop().create_future()
        self.capacity = 0
        self.light: set[str] = set()  # jobs of LIGHT_ENDPOINTS among `jobs`: they take no slot
        self.jobs: dict[str, asyncio.Task] = {}
        self.cancel_watch = CancelWatch(args.cancel_grace_s)
        self.submits_seen = 0  # told in heartbeats: the supervisor knows which jobs a beat covers
        self.last_heard = time.monotonic()
        self._silence_told = False  # a warning about a silent supervisor was logged
        self.stopping = asyncio.Event()
        self.exit_code = WorkerExit.OK
        self.killed_runtime: str | None = None  # why this worker killed its own runtime, if it did

    def send(self, msg: p.Message) -> None:
        self.outbox.put(msg)

    def _background(self, coro, name: str) -> asyncio.Task:
        """A task the worker cannot do without: if it ends by an exception, the
        worker says so and exits non-zero, so its supervisor restarts it."""
        task = asyncio.create_task(coro, name=name)

        def ended(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("%s died: %r; exiting", name, t.exception(), exc_info=t.exception())
                self.stop(WorkerExit.CRASH)
        task.add_done_callback(ended)
        return task

    async def run(self) -> int:
        self.send(p.Hello())
        sender = self._background(self.outbox.run(), "sender")
        tasks = [self._background(self.heartbeat_loop(), "heartbeat"), self._background(self.load(), "load")]
        await self.stopping.wait()
        for job in list(self.jobs.values()):
            job.cancel()
        if self.jobs:  # bounded: a backend whose cancel hangs must not hold the worker
            await asyncio.wait(list(self.jobs.values()), timeout=self.args.stop_timeout_s)
        if self.exit_code is WorkerExit.OK:  # a planned stop, with the runtime alive: save its KV
            await self.save_kv()
        await self.outbox.flush(timeout_s=2.0)  # last words (a load error, cancelled jobs) go out
        tasks.append(sender)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            # a native runtime gets stop_timeout_s from SIGTERM to SIGKILL inside backend.stop();
            # this bound only guards a stop that hangs, so it must not cut that grace short
            if self.backend is not None:
                await asyncio.wait_for(self.backend.stop(), timeout=self.args.stop_timeout_s + 5)
        except Exception:
            log.exception("backend stop failed")
        self.sock.close()
        self.ctx.term()
        return int(self.exit_code)

    async def save_kv(self) -> None:
        """Warm swaps: the runtime's KV to disk, within the supervisor's kv_save_timeout_s (its
        wait for this worker's exit allows for it); a save that fails or runs late is logged."""
        backend = self.backend
        if backend is None or backend.warm_swap is None:
            return
        try:
            await asyncio.wait_for(backend.save_kv(), backend.warm_swap.save_timeout_s)
        except TimeoutError:
            log.error("warm swap: the save did not finish within kv_save_timeout_s=%g; the next load is cold "
                      "for what it missed", backend.warm_swap.save_timeout_s)
        except Exception:
            log.exception("warm swap: the save failed; the next load is cold for what it missed")

    def stop(self, code: WorkerExit) -> None:
        if not self.stopping.is_set():
            self.exit_code = code
            self.stopping.set()

    async def load(self) -> None:
        setup = await self.setup  # the supervisor's answer to Hello: secrets never ride in argv
        self.backend = backend_class(self.args.backend)(
            setup.options, self.args.target_inflight, log, stop_timeout_s=self.args.stop_timeout_s,
            limits=OutputLimits(self.args.max_job_output_bytes, self.args.max_upstream_line_bytes))
        if setup.warm_swap:
            ws = setup.warm_swap
            try:
                self.backend.warm_swap = WarmSwap(str(ws["dir"]), float(ws["budget_mb"]), float(ws["save_timeout_s"]),
                                                  min_free_mb=float(ws.get("min_free_mb", DEFAULT_MIN_FREE_MB)))
            except (KeyError, TypeError, ValueError) as exc:
                log.error("warm swap: a setup the worker cannot read (%r): off", exc)
        self.backend.kv_events_sink = lambda events, reset: self.send(p.KvEvents(events=events, reset=reset))
        started = time.monotonic()
        try:
            capacity, info = await self.backend.start()
        except BackendLoadError as exc:
            log.error("runtime failed to load: %s", exc)
            self.send(p.Error(job=None, code=ErrorCode.LOAD_FAILED, message=str(exc)))
            self.stop(WorkerExit.BOOT_FAILURE)
            return
        except Exception as exc:
            log.exception("runtime crashed while loading")
            self.send(p.Error(job=None, code=ErrorCode.LOAD_FAILED, message=f"{type(exc).__name__}: {exc}"))
            self.stop(WorkerExit.BOOT_FAILURE)
            return
        self.capacity = capacity
        log.info("runtime ready in %.2fs, capacity %d", time.monotonic() - started, capacity)
        self.send(p.Ready(capacity=capacity, info=info))
        reason = await self.backend.wait_dead()
        if self.killed_runtime:  # the worker's own kill: say so, not only the signal
            reason = f"{reason} ({self.killed_runtime})"
        log.error("runtime died: %s", reason)
        # runtime_timeout: this worker killed it (the supervisor reports it killed by the pool)
        code = ErrorCode.RUNTIME_TIMEOUT if self.killed_runtime else ErrorCode.RUNTIME_CRASHED
        self.send(p.Error(job=None, code=code, message=reason,
                          exit_code=self.backend.runtime_exit_code()))
        self.stop(WorkerExit.CRASH)

    def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.handle(p.ProtocolError(f"a {len(frames)}-part message"))
        else:
            for msg in p.decode_many(frames[0]):
                self.handle(msg)

    def handle(self, msg: p.Message | p.ProtocolError) -> None:
        self.last_heard = time.monotonic()
        match msg:
            case p.Submit(job=job, request=request, endpoint=endpoint, headers=headers):
                self.submits_seen += 1
                # a light call runs beside the slots, whichever way the supervisor sent it: at most
                # LIGHT_CALLS_PER_WORKER past its queue, and the rest in slots it counts as taken (so
                # the worker never holds a slot the supervisor thinks free)
                light = endpoint in p.LIGHT_ENDPOINTS
                if (len(self.light) >= p.LIGHT_CALLS_PER_WORKER + self.capacity if light
                        else len(self.jobs) - len(self.light) >= self.capacity):
                    self.send(p.Error(job=job, code=ErrorCode.RUNTIME_ERROR, message="worker is at capacity"))
                else:
                    self.cancel_watch.disarm()
                    task = self.jobs[job] = asyncio.create_task(self.run_job(job, request, endpoint, headers))
                    if light:
                        self.light.add(job)
                    task.add_done_callback(lambda t, job=job: self._job_ended(job))
            case p.Cancel(job=job):
                self.cancel_job(job)
            case p.Setup():
                if not self.setup.done():
                    self.setup.set_result(msg)
            case p.Shutdown():
                self.stop(WorkerExit.OK)
            case p.Heartbeat():
                pass
            case p.ProtocolError(reason=reason):
                log.error("bad frame from supervisor: %s", reason)
            case _:
                log.error("unexpected message from supervisor: %r", msg)

    async def run_job(self, job: str, request: dict, endpoint: str = "chat", headers: dict | None = None) -> None:
        try:
            self.backend.check(endpoint, request)
            if headers:  # for the runtime's own routes (Submit.headers): text only, whatever the frame held
                headers = {k: v for k, v in headers.items() if isinstance(v, str)}
            budget = self.args.max_job_output_bytes  # what this job may still send (characters, about bytes)
            # closed when the job ends, not by the garbage collector (whose finalizer costs a
            # thread-safe wake-up of the loop and a task per job)
            loop = asyncio.get_running_loop()
            turn_started = loop.time()
            async with contextlib.aclosing(self.backend.job(endpoint, job, request, headers)) as events:
                async for event in events:
                    if loop.time() - turn_started > TURN_S:
                        # a backend whose events come without a wait (behind its schedule on a busy
                        # machine, a buffer full of tokens) must not hold the loop: the heartbeat,
                        # the outbox and a cancel run now, or the supervisor takes the worker for dead
                        await asyncio.sleep(0)
                        turn_started = loop.time()
                    if isinstance(event, TextDelta):
                        if event.text:
                            budget -= len(event.text)
                            self._over_budget(budget)
                            self.outbox.put_text(job, event.text, event.tokens)
                    elif isinstance(event, PartsDelta):
                        if event.parts:
                            delta = p.Delta(job=job, parts=event.parts, tokens=event.tokens)
                            budget -= p.delta_size(delta)
                            self._over_budget(budget)
                            self.send(delta)
                    elif isinstance(event, RuntimeTasks):  # said at once: the job may yet die with its runtime
                        self.send(p.Delta(job=job, tokens=0, tasks=[list(pair) for pair in event.tasks]))
                    elif isinstance(event, RawFrame):
                        self.outbox.put(event.data)
                    elif isinstance(event, Finished):
                        usage = {"input_tokens": event.input_tokens, "output_tokens": event.output_tokens}
                        if event.cached_tokens is not None:  # a runtime's 0 is a fact; its silence is not
                            usage["cached_tokens"] = event.cached_tokens
                        if event.reasoning_tokens:
                            usage["reasoning_tokens"] = event.reasoning_tokens
                        self.send(p.Done(job=job, finish_reason=event.finish_reason, usage=usage,
                                         finish_reasons=list(event.finish_reasons), result=event.result or {},
                                         timings=event.timings or {}, extra=event.extra or {},
                                         usage_on_finish=event.usage_on_finish))
                        return
            raise JobError(ErrorCode.RUNTIME_ERROR, "runtime ended the job without finishing it")
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                self.send(p.Done(job=job, finish_reason="cancelled", usage={}))
        except JobError as exc:
            self.send(p.Error(job=job, code=exc.code, message=exc.message, param=exc.param))
        except Exception as exc:
            log.exception("job %s failed", job)
            self.send(p.Error(job=job, code=ErrorCode.RUNTIME_ERROR, message=f"{type(exc).__name__}: {exc}"))
        finally:
            self.jobs.pop(job, None)
            self.light.discard(job)

    def _over_budget(self, budget: int) -> None:
        if budget < 0:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the job's output exceeds the pool's {self.args.max_job_output_bytes}"
                           " byte bound on one job (server.max_job_output_bytes)")

    def cancel_job(self, job: str) -> None:
        if task := self.jobs.get(job):
            log.info("cancelling job %s", job)
            task.cancel()
            self.cancel_watch.arm(time.monotonic())

    def _job_ended(self, job: str) -> None:
        """run_job removes its job when it ends. A job still listed here was
        cancelled before its first step (a Cancel in the same loop turn as its
        Submit), so none of run_job ran: its Done is sent here, else its slot in
        the supervisor would stay taken."""
        self.light.discard(job)
        if self.jobs.pop(job, None) is not None and not self.stopping.is_set():
            self.send(p.Done(job=job, finish_reason="cancelled", usage={}))

    async def heartbeat_loop(self) -> None:
        parent = self.args.parent_pid
        while True:
            await asyncio.sleep(self.args.heartbeat_s)
            if os.getppid() != parent:
                log.error("supervisor (pid %d) is gone; exiting", parent)
                self.stop(WorkerExit.SUPERVISOR_GONE)
                return
            # Its parent alive, a silent supervisor is slow (a stalled loop, a SIGSTOP), not dead:
            # the jobs go on for supervisor_patience_s. A dead local one ends this worker at once
            # (PR_SET_PDEATHSIG, or the parent check above); a remote worker cannot tell, and
            # its Ray actor dies with the supervisor's driver. A worker never set up (never let
            # in: a wrong key, a stale endpoint) has nothing to keep: it goes after liveness_s.
            silent_s = time.monotonic() - self.last_heard
            patience_s = self.args.supervisor_patience_s if self.setup.done() else self.args.liveness_s
            if silent_s > patience_s:
                log.error("no word from the supervisor for %.1fs; exiting", silent_s)
                self.stop(WorkerExit.SUPERVISOR_GONE)
                return
            if silent_s > self.args.liveness_s and not self._silence_told:
                self._silence_told = True
                log.warning("no word from the supervisor for %.1fs (stalled?); its %d jobs go on for up to %.0fs",
                            silent_s, len(self.jobs), self.args.supervisor_patience_s)
            elif silent_s <= self.args.liveness_s and self._silence_told:
                self._silence_told = False
                log.info("the supervisor answers again")
            self.send(p.Heartbeat(inflight=len(self.jobs), jobs=list(self.jobs), submits_seen=self.submits_seen))
            pid = self.backend.runtime_pid() if self.backend is not None else None
            busy = self.cancel_watch.busy_for(pid, not self.jobs, time.monotonic())
            if busy is not None:
                log.error("the runtime is still busy %.0fs after a cancel left it no job (a cancel it "
                          "does not honour): killing it, so that the worker is restarted", busy)
                self.killed_runtime = f"by its worker: still busy {busy:.0f}s after a cancel left it no job"
                signal_group(pid, signal.SIGKILL)  # busy, it would sit out a SIGTERM; it leads its group
                self.cancel_watch.disarm()  # its death ends the worker (load() sees it) with code 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="runtime_worker")
    ap.add_argument("--endpoint", required=True,
                    help="supervisor ROUTER endpoint (ipc://..., or tcp://... with CURVE keys in the environment)")
    ap.add_argument("--replica", required=True, help="routing identity, e.g. model/0")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--target-inflight", type=int, default=1)
    ap.add_argument("--parent-pid", type=int, default=os.getppid())
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--liveness-s", type=float, default=10.0)
    ap.add_argument("--stop-timeout-s", type=float, default=10.0)
    ap.add_argument("--max-job-output-bytes", type=int, default=OutputLimits().max_job_output_bytes,
                    help="one job's output past this many bytes fails it (runtime_error)")
    ap.add_argument("--max-upstream-line-bytes", type=int, default=OutputLimits().max_upstream_line_bytes,
                    help="a line of a runtime's streamed answer past this many bytes fails its job")
    ap.add_argument("--supervisor-patience-s", type=float, default=120.0,
                    help="no word from a supervisor that still lives, this long: exit")
    ap.add_argument("--cancel-grace-s", type=float, default=30.0,
                    help="a runtime still busy this long after a cancel left it no job is restarted")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    die_with_parent()
    if os.getppid() != args.parent_pid:  # the parent died before prctl took hold
        return int(WorkerExit.SUPERVISOR_GONE)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.replica} %(levelname)s %(message)s")
    async def go() -> int:
        worker = Worker(args)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop, WorkerExit.OK)
        return await worker.run()

    try:
        import uvloop  # a dependency on Linux; the worker's loop runs every token
    except ImportError:
        return asyncio.run(go())
    return uvloop.run(go())

if __name__ == "__main__":
    sys.exit(main())
