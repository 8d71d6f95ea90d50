"""Replicas on other hosts, placed by Ray (a model with placement = "ray").

For each such replica a Ray actor (`WorkerHost`, node_host/host.py: the
node's side, which imports nothing of the supervisor) is scheduled on a node
that has the model's [models.ray] resources. On its node the actor starts
`python -m runtime_worker` (with the CUDA_VISIBLE_DEVICES Ray set from the
GPUs it assigned), watches it, reports its exit, and answers for its processes
(pid, RSS, CPU, children, GPU memory) and its output. The worker connects back to
the supervisor's ROUTER over TCP, encrypted and authenticated with CURVE
(curve_listener.py): jobs and tokens travel on that link exactly as they do
over ipc, never through Ray's object store. Ray carries only the actor's few
calls: start (with the worker's keys, for its environment), wait, poll, stop.

The worker dies with its parent, the actor (its lifeline), and the actor with
its owner, the supervisor's Ray driver: a supervisor that dies takes its
remote workers with it, and a worker that no longer hears the supervisor's
heartbeats exits after liveness_s in any case. A node that is lost takes its
actor: the handle reports the exit (ACTOR_LOST) and the replica takes its
crash path (in-flight jobs end 502, unstarted ones run elsewhere, a restart
with backoff lands on a node that fits).

`RayCluster` is the supervisor's connection (once, on the first Ray-placed
load) and the TCP listener; `RemoteWorker` stands, for a remote worker, where
process.WorkerProcess stands for a local one. Ray is an optional dependency:
it is imported only when a Ray-placed model loads (and on the nodes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

from node_host.host import WorkerHost
from protocol.curve import curve_env
from supervisor.config import ModelConfig, ServerConfig
from supervisor.tasks import spawn
from supervisor.replicas.transport import Transport

log = logging.getLogger("llm_pool.ray")

ACTOR_LOST = -1  # exit code when the actor (or its node) died without telling how the worker ended
POLL_S = 1.0  # how often the process view and new log output are fetched from the node
KILL_GRACE_S = 5.0  # a kill the actor does not carry out in this long: Ray kills the actor itself
WILDCARD_HOSTS = {"0.0.0.0", "::", "*", "[::]"}
CONNECT_TIMEOUT_S = 60.0  # ray.init waits long for a cluster that does not answer


def _in_daemon_thread(fn, *args) -> concurrent.futures.Future:
    """Run a blocking call in a thread of its own: ray.init blocks for seconds (for
    minutes when the cluster does not answer), and in the main thread it would
    replace the server's SIGTERM handler (the one that drains). A daemon thread:
    one stuck in ray.init must not hold the process at exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
    threading.Thread(target=run, name="ray-init", daemon=True).start()
    return future


# -- in the supervisor ----------------------------------------------------------------------------

_ACTOR_CLASS = None


def _actor_class():
    """WorkerHost as a Ray actor class, made once (each one is exported to the cluster)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray
        _ACTOR_CLASS = ray.remote(WorkerHost)
    return _ACTOR_CLASS


async def _result(ref):
    """Await a Ray ObjectRef from any asyncio loop (the supervisor's runs uvloop)."""
    return await asyncio.wrap_future(ref.future())


class RemoteWorker:
    """The supervisor's handle of a worker on a Ray node: pid (on that node),
    returncode, wait, stop, kill_tree, as process.WorkerProcess has; plus the
    node, the last process view, and the worker's log, mirrored into the
    replica's local log file."""

    def __init__(self, actor, info: dict, log_path: Path, on_exit: Callable[[], None]) -> None:
        self.actor = actor
        self.pid: int = info["pid"]
        self.node: str = info["host"]
        self.node_id: str = info["node_id"]
        self.node_ip: str = info["ip"]
        self.returncode: int | None = None
        self.view: dict = {}
        self._log_path = log_path
        self._log_offset = 0
        self._on_exit = on_exit
        self._polling = asyncio.Lock()  # one poll at a time: each takes the log from where the last ended
        self._exit = spawn(self._watch(), what="remote worker task")

    async def _watch(self) -> int:
        poller = spawn(self._poll_loop(), what="remote worker task")
        try:
            code = await _result(self.actor.wait.remote())
        except Exception as exc:  # RayActorError: the actor died, or its node was lost
            log.error("worker pid %d on node %s (%s): its Ray actor is gone (%s: %s); counted as a crash",
                      self.pid, self.node, self.node_id[:12], type(exc).__name__, _first_line(exc))
            code = ACTOR_LOST
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        if code != ACTOR_LOST:
            try:
                await asyncio.wait_for(self._poll_rest(), 5.0)  # its last words: why it exited
            except Exception:
                pass
        self.returncode = code
        self.view = {}
        self._kill_actor()  # its resources free for the next placement
        self._on_exit()
        return code

    async def _poll_loop(self) -> None:
        while True:
            try:
                more = await self._poll_once()
            except Exception as exc:  # a slow or lost node: the watch reports a lost actor
                log.debug("poll of worker pid %d on %s failed: %r", self.pid, self.node, exc)
                more = False
            if not more:
                await asyncio.sleep(POLL_S)

    async def refresh(self) -> None:
        """Fetch the process view and new log output now (GET /admin/workers, ps)."""
        if self.returncode is None:
            await self._poll_once()

    async def _poll_rest(self) -> None:
        while await self._poll_once():
            pass

    async def _poll_once(self) -> bool:
        """One poll; True if the node has more output waiting."""
        async with self._polling:
            return await self._poll_locked()

    async def _poll_locked(self) -> bool:
        got = await _result(self.actor.poll.remote(self._log_offset))
        if got["view"] is not None:
            self.view = got["view"]
        output = got["output"]
        if got["dropped"]:
            output = f"[llm-pool: {got['dropped']} bytes of this worker's output were dropped]\n".encode() + output
        if output:
            with open(self._log_path, "ab") as f:
                f.write(output)
        self._log_offset = got["end"]
        return bool(got.get("more"))

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def snapshot(self, max_age_s: float = 0.0) -> None:
        """The actor keeps the tree on its node (see WorkerHost)."""

    def kill_tree(self) -> None:
        """SIGKILL the worker's tree on its node, through the actor; if the actor
        does not do it soon, Ray kills the actor, and the worker dies with it."""
        if self.returncode is not None:
            return
        _detach(self.actor.kill.remote())
        asyncio.get_running_loop().call_later(KILL_GRACE_S, self._kill_if_running)

    def _kill_if_running(self) -> None:
        if self.returncode is None:
            log.warning("worker pid %d on node %s: not dead %.0fs after a kill; killing its Ray actor",
                        self.pid, self.node, KILL_GRACE_S)
            self._kill_actor()

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM, up to `timeout_s`, then SIGKILL of the whole tree (by the actor)."""
        if self.returncode is None:
            try:
                await asyncio.wait_for(_result(self.actor.stop.remote(timeout_s)), timeout_s + KILL_GRACE_S)
            except Exception:  # TimeoutError, RayActorError: an actor that cannot do it goes itself
                self._kill_actor()
        return await self.wait()

    def _kill_actor(self) -> None:
        _kill(self.actor)


def _kill(actor) -> None:
    """End an actor (its worker dies with it); its resources are free again."""
    import ray
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already gone, or Ray is disconnected
        log.debug("ray.kill: %r", exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


def _detach(ref) -> None:
    """Fire and forget an actor call; its error (the actor is gone) is expected,
    and a Ray error never fetched would be logged as 'unhandled'."""
    asyncio.ensure_future(asyncio.wrap_future(ref.future())).add_done_callback(
        lambda f: f.cancelled() or f.exception())


class RayLauncher:
    """A replica's launcher (see replica.Launcher) for placement = "ray": places a
    WorkerHost actor where the model's resources are, and starts the worker there
    with a CURVE key pair made for it alone (let in while it runs)."""

    def __init__(self, cluster: RayCluster, cfg: ModelConfig) -> None:
        self.cluster = cluster
        self.cfg = cfg

    @property
    def endpoint(self) -> str:
        """Where its workers connect: the ROUTER's TCP endpoint."""
        if self.cluster.endpoint is None:
            raise OSError(f"not connected to the Ray cluster ({self.cluster.error or 'not tried yet'})")
        return self.cluster.endpoint

    def actor_options(self) -> dict:
        r = self.cfg.ray
        options = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "max_restarts": 0, "max_task_retries": 0}
        if r.resources:
            options["resources"] = dict(r.resources)
        if r.node_labels:
            options["label_selector"] = dict(r.node_labels)
        return options

    def needs(self) -> str:
        r = self.cfg.ray
        parts = [f"num_cpus={r.num_cpus:g}", f"num_gpus={r.num_gpus:g}",
                 *(f"{k}={v:g}" for k, v in r.resources.items()), *(f"label {k}={v}" for k, v in r.node_labels.items())]
        return ", ".join(parts)

    async def __call__(self, args: list[str], log_path: Path, env: dict[str, str]) -> RemoteWorker:
        """Raises OSError when no node takes the worker within load_timeout_s, or it cannot start there."""
        import ray
        listener = self.cluster.listener
        public, secret = zmq.curve_keypair()
        env = {**env, **curve_env(listener.server_public, public, secret)}
        listener.allow(public)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.load_timeout_s
        actor = None
        try:
            while True:
                actor = _actor_class().options(**self.actor_options()).remote()
                try:
                    info = await asyncio.wait_for(_result(actor.start.remote(args, env)),
                                                  max(0.0, deadline - loop.time()))
                    break
                except TimeoutError:
                    raise OSError(f"no Ray node took it within load_timeout_s={self.cfg.load_timeout_s:g} "
                                  f"(it needs {self.needs()})") from None
                except ray.exceptions.RayActorError as exc:  # its node died while it was placed: once more
                    _kill(actor)
                    if loop.time() >= deadline:
                        raise OSError(f"its Ray actor died before the worker started: {exc}") from None
                    log.warning("%s: its Ray actor died before the worker started; placing it again",
                                log_path.stem)
                    await asyncio.sleep(0.5)
                except ray.exceptions.RayTaskError as exc:
                    raise OSError(f"the Ray actor could not start the worker: {exc}") from None
        except BaseException:  # no worker (or cancelled): no actor left holding its resources, no key let in
            if actor is not None:
                _kill(actor)
            listener.revoke(public)
            raise
        log.info("%s: worker pid %d started on Ray node %s (%s, %s)", log_path.stem, info["pid"], info["host"],
                 info["ip"], info["node_id"][:12])
        return RemoteWorker(actor, info, log_path, on_exit=lambda: listener.revoke(public))


class RayCluster:
    """The supervisor's side of the Ray cluster: one connection, made on the first
    Ray-placed load, and the ROUTER's CURVE TCP listener."""

    def __init__(self, server: ServerConfig, transport: Transport) -> None:
        self.server = server
        self.transport = transport
        self.endpoint: str | None = None  # tcp://host:port, once connected and listening
        self.error: str | None = None
        self._connecting: asyncio.Future | None = None
        self._init: concurrent.futures.Future | None = None  # ray.init, in its own thread
        self._connected = False

    @property
    def listener(self):
        return self.transport.remote

    def launcher(self, cfg: ModelConfig) -> RayLauncher:
        return RayLauncher(self, cfg)

    async def connect(self) -> None:
        """Connect (once; a failed attempt is tried again by the next load). Raises
        OSError with the reason when the cluster cannot be used."""
        if self.endpoint is not None:
            return
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        await asyncio.shield(self._connecting)

    async def _connect(self) -> None:
        address = self.server.ray_address
        if self._init is None or (self._init.done() and self._init.exception() is not None):
            self._init = _in_daemon_thread(self._ray_init, address)
        try:  # an attempt still under way (a slow cluster) is waited for again, not doubled
            node_ip = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._init)), CONNECT_TIMEOUT_S)
        except TimeoutError:
            self.error = f"cannot connect to the Ray cluster at {address!r}: no answer within {CONNECT_TIMEOUT_S:g}s"
            raise OSError(self.error) from None
        except Exception as exc:
            self.error = f"cannot connect to the Ray cluster at {address!r}: {type(exc).__name__}: {exc}"
            raise OSError(self.error) from None
        self._connected = True
        host = self.server.ray_bind_host or node_ip
        try:
            listener = self.transport.listen_tcp(host, self.server.ray_bind_port)
        except zmq.ZMQError as exc:
            self.error = f"cannot listen for remote workers on {host}:{self.server.ray_bind_port}: {exc}"
            raise OSError(self.error) from None
        dial = node_ip if host in WILDCARD_HOSTS else host
        self.endpoint = f"tcp://{f'[{dial}]' if ':' in dial else dial}:{listener.port}"
        self.error = None
        log.info("Ray cluster %r: remote workers connect to %s (CURVE; server key %s)", address, self.endpoint,
                 listener.server_public.decode())

    @staticmethod
    def _ray_init(address: str) -> str:
        if address != "auto":  # nothing listening there: say so now (ray.init would wait minutes)
            host, _, port = address.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                pass
        # Ray's core worker would print a stack dump for the SIGTERM that starts a graceful drain
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        # ...and ray.init warns that, off the main thread, it leaves SIGTERM alone: as intended here
        logging.getLogger("ray._private.worker").addFilter(
            lambda record: "SIGTERM handler is not set" not in record.getMessage())
        import ray
        if not ray.is_initialized():
            # log_to_driver=False: a worker's output reaches its replica's log through the actor
            ray.init(address=address, log_to_driver=False, namespace="llm-pool")
        return ray.util.get_node_ip_address()

    async def close(self) -> None:
        if self._connected:
            import ray
            await asyncio.wrap_future(_in_daemon_thread(ray.shutdown))
            self._connected = False
