"""The Grafana dashboard and the alert rules in configs/ ask only for metrics the pool
exports; the rules pass their unit tests (promtool, where installed: Debian's `prometheus`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.conftest import synthetic
from tests.pool import ROOT

DASHBOARD = ROOT / "configs" / "grafana-dashboard.json"
RULES = ROOT / "configs" / "prometheus-rules.yaml"
RULE_TESTS = ROOT / "configs" / "prometheus-rules.test.yaml"


def test_dashboard_queries_only_exported_metrics(make_pool):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs.append(RULES.read_text())  # the alert rules' expressions ask for exported metrics too
    wanted = {name for e in exprs for name in re.findall(r"\bllm_pool_\w+", e)}
    assert len(wanted) >= 12, wanted
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))

    pool = make_pool([synthetic("m", tokens=3)])
    assert pool.http.post("/v1/chat/completions", json={  # streamed: TTFT is observed for streams only
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).status_code == 200
    text = pool.http.get("/metrics").text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("llm_pool_")}
    # and the labelled counters with no sample yet (llm_pool_requests_planned_total before any unload)
    exported |= {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE llm_pool_")
                 and line.endswith(" counter")}
    assert wanted <= exported, wanted - exported
    labels = set(re.findall(r"\b(\w+)=", pool.http.get("/metrics").text))
    used = {label for e in exprs for group in re.findall(r"by \(([^)]*)\)", e)
            for label in re.split(r",\s*", group)} - {"le"}
    assert used <= labels, used - labels


def test_dashboard_shows_client_and_server_errors_apart_and_the_queue_wait():
    panels = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in json.loads(DASHBOARD.read_text())["panels"]}
    errors = panels["Errors/s: client (4xx) and server (5xx)"]
    assert [bool(re.search(r'status=~"4\.\."', e)) for e in errors] == [True, False, False]
    assert [bool(re.search(r'status=~"5\.\."', e)) for e in errors] == [False, True, False]
    assert "llm_pool_requests_planned_total" in errors[1] and "llm_pool_requests_planned_total" in errors[2]
    assert 'status=~"5.."' in panels["Server errors (5xx) share"][0]
    assert 'status=~"4.."' in panels["Client errors (4xx) share"][0]
    assert all("llm_pool_tenant_queue_wait_seconds_bucket" in e for e in panels["Queue wait (p50, p95)"])


def test_alert_rules_pass_their_unit_tests():
    """Each alert fires when it should and only then (configs/prometheus-rules.test.yaml)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = RULES.read_text()
    alerts = re.findall(r"^\s+- alert: (\w+)$", rules, re.M)
    tested = set(re.findall(r"^\s+alertname: (\w+)$", RULE_TESTS.read_text(), re.M))
    assert len(alerts) >= 7 and set(alerts) == tested, (alerts, tested)  # every rule has a test
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    done = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
