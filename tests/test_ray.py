"""Replicas on a Ray cluster (placement = "ray"): Ray's own multi-node harness,
several raylets on this machine, each with its own custom resource (node_a,
node_b); the pool's supervisor is the cluster's driver and its workers dial the
ROUTER over TCP with CURVE. One cluster serves the whole module (it takes
seconds to start); each test starts its own pool on it.

Run with scripts/test-ray (it installs the `ray` extra)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import llama, synthetic
from tests.pool import ROOT, wait_for

pytestmark = pytest.mark.ray

NODES = ("node_a", "node_b")
GPUS = {"node_a": 0, "node_b": 2}  # Ray's logical GPUs: it assigns them (CUDA_VISIBLE_DEVICES) with no real one


@dataclass
class RayTestCluster:
    cluster: object  # ray.cluster_utils.Cluster
    nodes: dict  # resource name -> ray._private.node.Node

    @property
    def address(self) -> str:
        return self.cluster.address

    def name_of(self, node_id: str) -> str:
        return next(name for name, node in self.nodes.items() if node.node_id == node_id)

    def add(self, name: str):
        self.nodes[name] = self.cluster.add_node(num_cpus=2, num_gpus=GPUS[name], resources={name: 1, "slot": 1},
                                                 labels={"zone": name.removeprefix("node_")})
        self.cluster.wait_for_nodes()
        return self.nodes[name]


def _ray_processes(session_dir: str) -> list[psutil.Process]:
    """The cluster's daemons (their command lines name its session directory) and
    Ray's worker processes (which retitle themselves "ray::...") of this user."""
    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if any(session_dir in part for part in cmdline) or (
                    cmdline and cmdline[0].startswith("ray::") and proc.info["uids"].real == os.getuid()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray", reason="scripts/test-ray installs the `ray` extra")
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0,  # the supervisor's host: no replica lands there
        "include_dashboard": False,
        # a lost node is declared dead within about a second, not Ray's default half minute
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                           "health_check_timeout_ms": 300, "health_check_failure_threshold": 3},
    })
    session_dir = cluster.head_node.get_session_dir_path()
    testing = RayTestCluster(cluster, {})
    try:
        for name in NODES:
            testing.add(name)
        yield testing
    finally:
        cluster.shutdown()
        leftovers = wait_for_gone(lambda: _ray_processes(session_dir), 30)
        shutil.rmtree(session_dir, ignore_errors=True)  # its logs and sockets
        ray_tmp = Path(session_dir).parent  # Ray's temp dir: its "session_latest" link now points nowhere
        latest = ray_tmp / "session_latest"
        if latest.is_symlink() and not latest.exists():
            latest.unlink()
        with contextlib.suppress(OSError):
            ray_tmp.rmdir()  # only when nothing else of Ray's is in it
        assert not leftovers, f"Ray processes left: {[p.cmdline()[:2] for p in leftovers]}"


def wait_for_gone(find, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return left


def on_ray(model: dict, **ray) -> dict:
    return {**model, "placement": "ray", "ray": {"num_cpus": 1, **ray}}


@pytest.fixture
def ray_pool(make_pool, ray_cluster):
    def make(models: list[dict], server: dict | None = None, **kw):
        return make_pool(models, {"ray_address": ray_cluster.address, **(server or {})}, **kw)
    return make


def sse(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def chat(pool, model: str, content: str = "hi", **body) -> httpx.Response:
    return pool.http.post("/v1/chat/completions", json={"model": model, "messages": [
        {"role": "user", "content": content}], **body})


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_two_replicas_one_per_node_serve_concurrent_load(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("spread", replicas=2, target_inflight=4, capacity=4, tps=200, tokens=20),
                            resources={"slot": 1}),
                     synthetic("here")])  # a local model beside them, on ipc
    workers = pool.workers("spread")
    assert {ray_cluster.name_of(w["node_id"]) for w in workers} == set(NODES), workers
    for w in workers:
        assert w["state"] == "ready" and w["node"] and w["rss_bytes"] and w["pid"]
        assert "runtime_worker" in " ".join(psutil.Process(w["pid"]).cmdline())
        endpoint = next(a for a in psutil.Process(w["pid"]).cmdline() if "://" in a)
        assert endpoint.startswith("tcp://")
        # the keys came in the environment, and the worker removed them (its runtime inherits none)
        assert not any("CURVE" in a for a in psutil.Process(w["pid"]).cmdline())
    with ThreadPoolExecutor(8) as ex:
        replies = list(ex.map(lambda i: chat(pool, "spread", f"q{i}"), range(16)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in replies)
    # both nodes took a share (least-loaded dispatch over two replicas of capacity 4)
    served = {w["replica"]: w for w in pool.workers("spread")}
    assert len(served) == 2 and chat(pool, "here").status_code == 200
    # the process view and the log come from the node, through the actor
    # -o wide: every column (the default fits 80 columns, where NODE may not)
    ps = subprocess.run([sys.executable, "-m", "supervisor.cli", "ps", "-o", "wide", "--url", pool.url], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ps.returncode == 0 and "NODE" in ps.stdout and "(ray " in ps.stdout, ps.stdout + ps.stderr
    logs = wait_for(lambda: (r := pool.http.get("/admin/models/spread/logs", params={"replica": 1})).status_code
                    == 200 and any("runtime ready" in line for line in r.json()["lines"]) and r, 10,
                    what="the remote worker's log, mirrored")
    assert logs.json()["lines"]


def first_content(events) -> None:
    for e in events:
        if e.get("type") == "response.output_text.delta" or (
                e.get("choices") and e["choices"][0]["delta"].get("content")):
            return
    raise AssertionError("the stream ended before its first token")


def stream_chat(pool, model: str, **body):
    return httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "stream": True, "messages": [{"role": "user", "content": "x"}], **body})


@pytest.mark.llama
def test_a_llama_server_replica_on_a_chosen_node_serves_through_the_pool(ray_pool, ray_cluster, tiny_gguf,
                                                                          llama_server_bin):
    pool = ray_pool([on_ray(llama("tiny", tiny_gguf, llama_server_bin, ctx=2048), resources={"node_b": 1})])
    worker = pool.workers("tiny")[0]
    assert ray_cluster.name_of(worker["node_id"]) == "node_b"
    assert [c["name"] for c in worker["children"]] == ["llama-server"]  # the view of its tree, from its node
    r = chat(pool, "tiny", max_tokens=8, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    # ignore_eos: sampled, random weights may end an answer early (its finish_reason then "stop")
    with stream_chat(pool, "tiny", max_tokens=8, ignore_eos=True) as s:
        chunks = list(sse(s))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_ray_assigns_each_replica_its_gpus(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("gpu", replicas=2), num_gpus=1)])
    workers = pool.workers("gpu")
    assert [ray_cluster.name_of(w["node_id"]) for w in workers] == ["node_b", "node_b"]  # the node with GPUs
    devices = sorted(psutil.Process(w["pid"]).environ().get("CUDA_VISIBLE_DEVICES") for w in workers)
    assert devices == ["0", "1"], devices  # one each, as Ray assigned them


def test_a_node_label_chooses_the_node(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("labelled", replicas=2), node_labels={"zone": "b"}),
                     on_ray(synthetic("unmatched", load_timeout_s=2), node_labels={"zone": "c"})], wait_ready=False)
    wait_for(lambda: pool.model("labelled")["state"] == "loaded", 30, what="loaded")
    assert [ray_cluster.name_of(w["node_id"]) for w in pool.workers("labelled")] == ["node_b", "node_b"]
    failed = wait_for(lambda: (m := pool.model("unmatched"))["state"] == "failed" and m, 30, what="load failed")
    assert "label zone=c" in failed["error"], failed  # no node has it: never placed elsewhere


def test_a_replica_no_node_can_take_fails_its_load_with_the_reason(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("nowhere", load_timeout_s=2), resources={"node_c": 1}),
                     on_ray(synthetic("somewhere"), resources={"node_a": 1})], wait_ready=False)
    failed = wait_for(lambda: (m := pool.model("nowhere"))["state"] == "failed" and m, 30, what="load failed")
    assert "no Ray node took it within load_timeout_s=2 (it needs num_cpus=1, num_gpus=0, node_c=1)" \
        in failed["error"], failed
    wait_for(lambda: pool.model("somewhere")["state"] == "loaded", 30, what="the other model loaded")
    assert chat(pool, "somewhere").status_code == 200  # a placement that can be made is not held up


def test_an_unreachable_cluster_fails_the_load_at_once_with_the_reason(ray_pool, ray_cluster):
    from tests.pool import free_port
    address = f"127.0.0.1:{free_port()}"
    pool = ray_pool([on_ray(synthetic("far")), synthetic("near")], server={"ray_address": address},
                    wait_ready=False)
    failed = wait_for(lambda: (m := pool.model("far"))["state"] == "failed" and m, 30, what="load failed")
    assert f"cannot connect to the Ray cluster at {address!r}: ConnectionRefusedError" in failed["error"], failed
    wait_for(lambda: pool.model("near")["state"] == "loaded", 30, what="the local model loaded")
    assert chat(pool, "near").status_code == 200


def test_a_worker_with_a_wrong_curve_key_is_refused_and_logged(ray_pool, ray_cluster):
    import re

    import zmq
    pool = ray_pool([on_ray(synthetic("real"), resources={"slot": 1})], server={"liveness_s": 3.0})
    real = pool.workers("real")[0]
    found = re.search(r"remote workers connect to (tcp://\S+) \(CURVE; server key (.{40})\)", pool.log())
    assert found, pool.log()
    endpoint, server_key = found[1], found[2].encode()
    identity = next(a for a in psutil.Process(real["pid"]).cmdline() if a.startswith("real/0#"))
    stranger_public, stranger_secret = zmq.curve_keypair()
    _, other_server_key = zmq.curve_keypair()
    rogues = []
    for keys in ((server_key, stranger_public, stranger_secret), (other_server_key, stranger_public, stranger_secret)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_POOL_CURVE")}
        env.update({"LLM_POOL_CURVE_SERVER_KEY": keys[0].decode(), "LLM_POOL_CURVE_PUBLIC_KEY": keys[1].decode(),
                    "LLM_POOL_CURVE_SECRET_KEY": keys[2].decode()})
        # it claims the real replica's identity: were it let in, it could take its jobs
        rogues.append(subprocess.Popen(
            [sys.executable, "-m", "runtime_worker", "--endpoint", endpoint, "--replica", identity,
             "--backend", "synthetic", "--heartbeat-s", "0.5", "--liveness-s", "3"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        wait_for(lambda: f"its CURVE key {stranger_public.decode()} is not one this supervisor handed out"
                 in pool.log(), 10, what="the refusal of an unknown key, logged")
        wait_for(lambda: "handshake failed" in pool.log(), 10, what="the refusal of a wrong server key, logged")
        # never let in, they hear no heartbeat and give up after their liveness window
        for rogue in rogues:
            assert rogue.wait(15) == 4  # WorkerExit.SUPERVISOR_GONE
    finally:
        for rogue in rogues:
            if rogue.poll() is None:
                rogue.kill()
                rogue.wait()
    assert chat(pool, "real").status_code == 200
    after = pool.workers("real")[0]
    assert after["pid"] == real["pid"] and after["restarts"] == 0 and after["protocol_errors"] == 0


def test_a_sigkilled_supervisor_leaves_no_runtime_process_on_any_node(ray_pool, ray_cluster):
    liveness_s = 3.0
    pool = ray_pool([on_ray(synthetic("s", replicas=2), resources={"slot": 1})], server={"liveness_s": liveness_s})
    workers = pool.workers("s")
    assert {ray_cluster.name_of(w["node_id"]) for w in workers} == set(NODES)
    pids = [w["pid"] for w in workers]
    actors = [psutil.Process(pid).ppid() for pid in pids]  # the Ray actor that started each worker
    killed_at = time.monotonic()
    pool.proc.kill()
    pool.proc.wait(10)
    wait_for(lambda: all(gone(pid) for pid in pids + actors), liveness_s + 2, interval=0.05,
             what="every remote worker and its actor gone within the liveness window")
    print(f"supervisor SIGKILL -> no remote worker left: {(time.monotonic() - killed_at) * 1000:.0f} ms")


def test_a_hung_remote_worker_is_detected_killed_on_its_node_and_restarted(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("h", tps=10, tokens=200), resources={"slot": 1})],
                    server={"heartbeat_s": 0.25, "liveness_s": 1.5})
    pid = pool.workers("h")[0]["pid"]
    try:
        with stream_chat(pool, "h") as s:
            events = sse(s)
            first_content(events)
            os.kill(pid, signal.SIGSTOP)  # hung: it neither answers nor exits
            assert list(events)[-1]["error"]["code"] == "runtime_timeout"
        wait_for(lambda: gone(pid), 10, what="the hung worker killed on its node, by its actor")
        fresh = wait_for(lambda: (w := pool.workers("h")[0])["state"] == "ready" and w["pid"] != pid and w,
                         20, what="a new worker")
        assert fresh["restarts"] == 1
        assert chat(pool, "h", max_tokens=2).status_code == 200
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_unload_drains_remote_replicas_like_local_ones(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("d", replicas=2, tps=40, tokens=60), resources={"slot": 1})])
    pids = [w["pid"] for w in pool.workers("d")]
    with ThreadPoolExecutor(2) as ex, stream_chat(pool, "d") as a, stream_chat(pool, "d") as b:
        ea, eb = sse(a), sse(b)
        first_content(ea)
        first_content(eb)
        queued = ex.submit(chat, pool, "d")
        wait_for(lambda: pool.model("d")["queue_depth"] == 1, 10, what="one queued")
        unload = ex.submit(pool.http.post, "/admin/models/d/unload")
        wait_for(lambda: pool.model("d")["state"] == "unloading", 10, what="unloading")
        late = chat(pool, "d")
        assert late.status_code == 503 and late.json()["error"]["code"] == "model_unloading"
        assert queued.result().json()["error"]["code"] == "model_unloading"
        # both streams run to their end: the drain cuts nothing
        for events in (ea, eb):
            last = [c for c in events if c.get("choices")][-1]
            assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
        assert unload.result().status_code == 200
    assert pool.model("d")["state"] == "unloaded" and pool.workers("d") == []
    wait_for(lambda: all(gone(pid) for pid in pids), 10, what="the remote workers gone")


def test_remote_time_to_first_token_against_local(ray_pool, ray_cluster):
    """Loopback TCP with CURVE (remote) against ipc (local), same synthetic runtime."""
    pool = ray_pool([synthetic("here", tokens=2), on_ray(synthetic("there", tokens=2), resources={"slot": 1})])

    def ttft(model: str) -> float:
        started = time.perf_counter()
        with pool.http.stream("POST", "/v1/chat/completions", json={  # one kept-alive connection
                "model": model, "stream": True, "messages": [{"role": "user", "content": "x"}]}) as s:
            first_content(sse(s))
            return time.perf_counter() - started

    for model in ("here", "there"):  # warm both paths
        ttft(model)
    samples = {"here": [], "there": []}
    for _ in range(60):  # interleaved, so that load on the machine hits both alike
        for model in samples:
            samples[model].append(ttft(model))
    p50 = {m: statistics.median(v) * 1000 for m, v in samples.items()}
    p90 = {m: statistics.quantiles(v, n=10)[-1] * 1000 for m, v in samples.items()}
    print(f"TTFT p50 local (ipc) {p50['here']:.2f} ms, remote (TCP+CURVE) {p50['there']:.2f} ms, "
          f"added {p50['there'] - p50['here']:+.2f} ms; p90 {p90['here']:.2f} / {p90['there']:.2f} ms")
    assert p50["there"] < p50["here"] + 10, p50  # the link adds little: no Ray call on the token path


def test_losing_a_node_mid_stream_fails_in_flight_reruns_queued_and_restarts_elsewhere(ray_pool, ray_cluster):
    pool = ray_pool([on_ray(synthetic("lost", target_inflight=2, capacity=2, tps=20, tokens=400),
                            resources={"slot": 1})])
    worker = pool.workers("lost")[0]
    lost = ray_cluster.name_of(worker["node_id"])
    (kept,) = set(NODES) - {lost}
    try:
        with ThreadPoolExecutor(1) as ex, stream_chat(pool, "lost") as a, httpx.stream(
                "POST", pool.url + "/v1/responses", timeout=60,
                json={"model": "lost", "input": "x", "stream": True}) as b:
            ea, eb = sse(a), sse(b)
            first_content(ea)
            first_content(eb)
            queued = ex.submit(chat, pool, "lost", "q", max_tokens=3)
            wait_for(lambda: pool.model("lost")["queue_depth"] == 1, 10, what="one queued")
            removed_at = time.monotonic()
            ray_cluster.cluster.remove_node(ray_cluster.nodes.pop(lost))
            # the streams that had tokens end with a clean error, not a hang or a reset
            assert [c for c in ea][-1]["error"]["code"] == "runtime_crashed"
            assert [e for e in eb][-1]["response"]["error"]["code"] == "runtime_crashed"
            failed_after = time.monotonic() - removed_at
            # the queued one had not started: it runs on the replica restarted on the other node
            r = queued.result()
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        fresh = pool.workers("lost")[0]
        assert fresh["state"] == "ready" and fresh["restarts"] == 1 and fresh["last_exit_code"] == -1
        assert ray_cluster.name_of(fresh["node_id"]) == kept
        assert gone(worker["pid"])
        print(f"node removed -> in-flight clients failed: {failed_after * 1000:.0f} ms")
    finally:
        if lost not in ray_cluster.nodes:
            ray_cluster.add(lost)  # the module's cluster has both nodes again
