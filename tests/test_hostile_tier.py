"""The hostile tier (issue 44, items 5 and 6): tools nobody here wrote against the pool.
Debian's slowhttptest runs each of its four attacks (slowloris, slow body, slow read, range)
for a bounded time against a real pool, from 127.0.0.1, while a second client (127.0.0.2)
asks for /health every 0.2 s: every answer within a second, the supervisor's RSS within
64 MiB of where the attack found it, and a real request served after the attack. Then the
same attacks through Debian's nginx running configs/nginx/llm-pool.conf in front of a
pool, and what that config is for: a stream arrives through it event by event, a body that
stalls is cut by nginx and never reaches the pool, one too large is refused at once.
The project's own attack tests (tests/test_edge_attacks.py, tests/test_edge_round_two.py)
keep what slowhttptest does not do: pipelining, Upgrade, the caps from several addresses,
streams nobody reads, bodies to unknown paths.

scripts/test-hostile installs both tools and runs this tier; `-s` prints what each attack did."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from procutil.tree import stop_tree
from tests.conftest import synthetic
from tests.pool import ROOT, Pool, free_port, wait_for

pytestmark = pytest.mark.hostile

RSS_SLACK = 64 * 2**20
ATTACK_S = 15              # slowhttptest's -l: how long each attack lasts
CONNECTIONS = 500          # slowhttptest's -c: past the pool's per-client cap (256)
PROBE_FROM = "127.0.0.2"   # the second client; slowhttptest connects from 127.0.0.1
PROBE_EVERY_S = 0.2
DRIP_TOKENS, DRIP_TPS = 12, 4.0  # a stream of 3 s, for the SSE check through nginx
NGINX_CONF = ROOT / "configs" / "nginx" / "llm-pool.conf"
CHAT = "/v1/chat/completions"

# name: (slowhttptest's mode and options, the path it attacks)
ATTACKS = {
    "slowloris": (["-H"], "/health"),
    "slow body": (["-B", "-s", "1000000"], CHAT),  # a 1 MB body announced, sent a few bytes a second
    # the OpenAPI document (its largest answer) ten times per connection, read 5 bytes a second;
    # 5,000 pipelined in the first 3 s are a flood too: the pool serves it from bytes rendered once
    "slow read": (["-X", "-k", "10"], "/openapi.json"),
    "range": (["-R"], "/openapi.json"),  # 'Apache killer': a Range of 2,000 overlapping parts
}


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if os.access(f"/usr/sbin/{name}", os.X_OK) else None)
    if not path:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run must run scripts/test-hostile")
        pytest.skip(f"no {name}: run scripts/test-hostile (it installs Debian's {name})")
    return path


def models() -> list[dict]:
    return [synthetic("syn", capacity=4, target_inflight=4, tokens=4),
            synthetic("drip", tokens=DRIP_TOKENS, tps=DRIP_TPS)]


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """A pool with the default edge bounds, attacked directly."""
    tool("slowhttptest")
    pool = Pool(tmp_path_factory.mktemp("direct"), models())
    pool.start()
    try:
        yield Front(pool.url, pool)
    finally:
        pool.stop()


# -- nginx in front ----------------------------------------------------------------------------------------
def rendered_conf(pool_port: int, listen_port: int) -> str:
    """configs/nginx/llm-pool.conf with the test's ports: its upstream and listen lines, each once."""
    text = NGINX_CONF.read_text()
    for line, ours in (("server 127.0.0.1:8000;", f"server 127.0.0.1:{pool_port};"),
                       ("listen 8080;", f"listen 127.0.0.1:{listen_port};")):
        assert text.count(line) == 1, f"{NGINX_CONF} no longer has one {line!r} for the test to set"
        text = text.replace(line, ours)
    return text


def main_conf(tmp: Path) -> str:
    """What /etc/nginx/nginx.conf would be, everything under tmp (an operator's runs as a service)."""
    temps = "\n".join(f"    {kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                          "uwsgi", "scgi"))
    # as root, workers would drop to nobody, who cannot write the test's private tmp dir
    user = "user root;\n" if os.geteuid() == 0 else ""
    return (f"{user}worker_processes 1;\npid {tmp / 'nginx.pid'};\nerror_log {tmp / 'error.log'} info;\n"
            "events { worker_connections 4096; }\n"
            f"http {{\n    log_format statuses '$status';\n    access_log {tmp / 'access.log'} statuses;\n"
            f"{temps}\n    include {tmp / 'llm-pool.conf'};\n}}\n")


@dataclass
class Nginx:
    proc: subprocess.Popen
    tmp: Path

    def statuses_since(self, offset: int) -> dict[str, int]:
        """How many answers of each status nginx logged after `offset` bytes of its access log."""
        with open(self.tmp / "access.log", "rb") as f:
            f.seek(offset)
            lines = f.read().decode().split()
        return {s: lines.count(s) for s in sorted(set(lines))}

    def log_size(self) -> int:
        return (self.tmp / "access.log").stat().st_size

    def rss(self) -> int:
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children()]
        return sum(p.memory_info().rss for p in procs)


@pytest.fixture(scope="module")
def behind_nginx(tmp_path_factory):
    """A pool as docs/security.md says to run one behind nginx (every client is nginx's address,
    and its Host is the name clients use), and nginx with configs/nginx/llm-pool.conf."""
    binary = tool("nginx")
    tool("slowhttptest")
    pool = Pool(tmp_path_factory.mktemp("proxied"), models(),
                server={"max_connections_per_client": 1000, "allowed_hosts": ["127.0.0.1"]})
    pool.start()
    tmp = tmp_path_factory.mktemp("nginx")
    port = free_port()
    (tmp / "llm-pool.conf").write_text(rendered_conf(pool.port, port))
    (tmp / "nginx.conf").write_text(main_conf(tmp))
    args = [binary, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")]
    checked = subprocess.run([*args, "-t"], capture_output=True, text=True, timeout=30)
    print("\nnginx -t:", checked.stderr.strip())
    proc = None
    try:
        assert checked.returncode == 0, checked.stderr
        proc = subprocess.Popen([*args, "-g", "daemon off;"])  # nginx as this test's child, not a service
        front = Front(f"http://127.0.0.1:{port}", pool, Nginx(proc, tmp))
        wait_for(lambda: front.health_ok(proc), 30, what="/health through nginx")
        yield front
    finally:
        try:
            if proc is not None:
                seen = {p.pid for p in psutil.Process(proc.pid).children()} if proc.poll() is None else set()
                left = stop_tree(proc, seen, 10)
                assert not left, f"nginx left {left}"
        finally:
            pool.stop()


# -- what each attack is measured by ----------------------------------------------------------------------
@dataclass
class Front:
    """Where clients send requests (the pool itself, or nginx before it), and the pool behind."""
    url: str
    pool: Pool
    nginx: Nginx | None = None

    def client(self, timeout: float) -> httpx.Client:
        """The second client: its own address, a new connection per request."""
        return httpx.Client(base_url=self.url, timeout=timeout, headers={"connection": "close"},
                            transport=httpx.HTTPTransport(local_address=PROBE_FROM))

    def health_ok(self, proc: subprocess.Popen) -> bool:
        assert proc.poll() is None, f"nginx exited with {proc.returncode}"
        try:
            with self.client(2) as c:
                return c.get("/health").status_code == 200
        except httpx.TransportError:
            return False


@dataclass
class Probe:
    """The second client's /health latencies and the supervisor's RSS, while an attack runs."""
    rss_before: int
    latencies: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each poll began, in s from the attack's start
    failures: list[str] = field(default_factory=list)
    rss_peak: int = 0

    def run(self, front: Front, attack: subprocess.Popen, deadline_s: float) -> None:
        supervisor = psutil.Process(front.pool.proc.pid)
        self.began = time.monotonic()
        deadline = self.began + deadline_s
        with front.client(timeout=1.0) as c:
            while attack.poll() is None:
                assert time.monotonic() < deadline, "slowhttptest ran past its own test length"
                started = time.monotonic()
                try:
                    status = c.get("/health").status_code
                    if status != 200:
                        self.failures.append(f"/health answered {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"/health: {exc!r}")
                took = time.monotonic() - started
                self.latencies.append(took)
                self.times.append(round(started - self.began, 1))
                self.rss_peak = max(self.rss_peak, supervisor.memory_info().rss)
                time.sleep(max(0.0, PROBE_EVERY_S - took))  # the poll's pace, not a wait for a condition


def slowhttptest_report(prefix: Path, stdout: str) -> dict:
    """What slowhttptest says of its run: its CSV (one row a second) and its exit line."""
    with open(prefix.with_suffix(".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, f"slowhttptest wrote no statistics:\n{stdout[-2000:]}"
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", stdout)
    exit_line = re.findall(r"Exit status:\s*(.+)", plain)
    return {"seconds": len(rows) - 1,
            "max_connected": max(int(r["Connected"]) for r in rows),
            "closed": int(rows[-1]["Closed"]),
            # its own probe is a connection from the attacker's address: refused there by a
            # per-address cap that holds (the pool's max_connections_per_client, nginx's limit_conn)
            "its_probe_unavailable_s": sum(1 for r in rows[1:] if r["Service Available"] == "0"),
            "service_available_at_end": rows[-1]["Service Available"] != "0",
            "exit": exit_line[-1].strip() if exit_line else "?"}


def run_attack(front: Front, name: str, tmp: Path) -> dict:
    options, path = ATTACKS[name]
    prefix = tmp / name.replace(" ", "_")
    command = [tool("slowhttptest"), *options, "-c", str(CONNECTIONS), "-r", "200", "-i", "1",
               "-l", str(ATTACK_S), "-p", "2", "-g", "-o", str(prefix), "-u", front.url + path]
    supervisor = psutil.Process(front.pool.proc.pid)
    probe = Probe(rss_before=supervisor.memory_info().rss)
    log_offset = front.nginx.log_size() if front.nginx else 0
    nginx_rss = front.nginx.rss() if front.nginx else 0
    attack = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
    try:
        probe.run(front, attack, deadline_s=ATTACK_S + 30)
        stdout = attack.communicate(timeout=10)[0]
    finally:
        if attack.poll() is None:
            attack.kill()
            attack.wait()
    report = slowhttptest_report(prefix, stdout)
    worst = sorted(zip(probe.latencies, probe.times), reverse=True)[:3]
    report.update(worst_health_s=round(max(probe.latencies), 3), health_polls=len(probe.latencies),
                  slowest_at_s={t: round(took, 3) for took, t in worst},
                  rss_growth_mib=round((probe.rss_peak - probe.rss_before) / 2**20, 1))
    if front.nginx:
        report.update(nginx_statuses=front.nginx.statuses_since(log_offset),
                      nginx_rss_growth_mib=round((front.nginx.rss() - nginx_rss) / 2**20, 1))
    print(f"\n{name} ({'through nginx' if front.nginx else 'direct'}): {json.dumps(report)}")
    assert attack.returncode == 0, stdout[-2000:]
    assert report["max_connected"] > 0, f"slowhttptest never reached {front.url}:\n{stdout[-2000:]}"
    assert not probe.failures, probe.failures[:5]
    assert max(probe.latencies) < 1.0, f"worst /health {max(probe.latencies):.3f} s"
    assert probe.rss_peak - probe.rss_before < RSS_SLACK, f"supervisor RSS grew {report['rss_growth_mib']} MiB"
    served_after(front)
    return report


def served_after(front: Front) -> None:
    """The pool still serves a real request, from the second client."""
    with front.client(timeout=30) as c:
        answer = c.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["choices"][0]["message"]["content"]


# -- the attacks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ATTACKS)
def test_slowhttptest_against_the_pool(direct, name, tmp_path):
    run_attack(direct, name, tmp_path)


@pytest.mark.parametrize("name", ATTACKS)
def test_slowhttptest_through_nginx(behind_nginx, name, tmp_path):
    run_attack(behind_nginx, name, tmp_path)


# -- what the nginx config is for -----------------------------------------------------------------------------
def test_a_stream_comes_through_nginx_event_by_event(behind_nginx):
    """The drip model streams 12 tokens over 3 s: through nginx the first arrives seconds before
    the last (a buffering proxy would hand them all over at the end)."""
    body = {"model": "drip", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    arrivals = []
    with behind_nginx.client(timeout=30) as c, c.stream("POST", CHAT, json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                arrivals.append(time.monotonic())
    stream_s = DRIP_TOKENS / DRIP_TPS
    spread = arrivals[-1] - arrivals[0]
    print(f"\nSSE through nginx: {len(arrivals)} content events over {spread:.2f} s (the stream lasts {stream_s} s)")
    assert len(arrivals) >= DRIP_TOKENS // 2, len(arrivals)
    assert spread > stream_s / 2, f"the events came within {spread:.2f} s of each other: buffered"


def send_head(port: int, head: bytes, source: str = "127.0.0.3", timeout: float = 30) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(head)
    return s


def read_to_close(s: socket.socket, meanwhile=lambda: None) -> bytes:
    """What the peer sends until it closes; `meanwhile()` runs whenever 0.1 s passes without a byte."""
    s.settimeout(0.1)
    answer = b""
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            meanwhile()
            continue
        except ConnectionResetError:  # reset_timedout_connection: a timed-out close is a reset
            return answer
        if not chunk:
            return answer
        answer += chunk


def client_body_timeout_s() -> float:
    return float(re.search(r"client_body_timeout (\d+)s;", NGINX_CONF.read_text()).group(1))


def test_nginx_cuts_a_stalled_body_before_the_pool_and_refuses_one_too_large(behind_nginx):
    port = int(behind_nginx.url.rsplit(":", 1)[1])
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    with send_head(port, f"{head}Content-Length: {5 * 2**20}\r\n\r\n".encode()) as too_large:
        answer = read_to_close(too_large)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]

    # nginx's connections to the pool: none once its idle ones are dropped (upstream keepalive_timeout)
    supervisor = psutil.Process(behind_nginx.pool.proc.pid)
    limit = client_body_timeout_s()
    deadline = time.monotonic() + limit + 10

    def to_the_pool() -> list:
        assert time.monotonic() < deadline, "nginx never cut the stalled body"
        return [c for c in supervisor.net_connections("tcp") if c.raddr]
    wait_for(lambda: not to_the_pool(), 15, what="nginx's idle connections to the pool dropped")

    # a 100 KB body, 1 KB of it sent, then nothing: nginx closes it after client_body_timeout,
    # and meanwhile opens no connection to the pool (it passes a body on only once it is whole)
    opened = []
    deadline = time.monotonic() + limit + 10
    with send_head(port, f"{head}Content-Length: 100000\r\n\r\n".encode() + b" " * 1000) as stalled:
        started = time.monotonic()
        answer = read_to_close(stalled, meanwhile=lambda: opened.extend(to_the_pool()))
    took = time.monotonic() - started
    print(f"\nstalled body: nginx closed it after {took:.1f} s, answering {answer[:40]!r}")
    assert limit - 1 < took < limit + 10, took
    assert not opened, f"nginx passed a partial body on to the pool: {opened[:3]}"
    served_after(behind_nginx)
