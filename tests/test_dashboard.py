"""The Grafana dashboard in configs/ asks only for metrics the pool exports."""

from __future__ import annotations

import json
import re

from tests.conftest import synthetic
from tests.pool import ROOT

DASHBOARD = ROOT / "configs" / "grafana-dashboard.json"


def test_dashboard_queries_only_exported_metrics(make_pool):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    wanted = {name for e in exprs for name in re.findall(r"\bllm_pool_\w+", e)}
    assert len(wanted) >= 12, wanted
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))

    pool = make_pool([synthetic("m", tokens=3)])
    assert pool.http.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    exported = {line.split("{")[0].split(" ")[0] for line in pool.http.get("/metrics").text.splitlines()
                if line.startswith("llm_pool_")}
    assert wanted <= exported, wanted - exported
    labels = set(re.findall(r"\b(\w+)=", pool.http.get("/metrics").text))
    used = {label for e in exprs for group in re.findall(r"by \(([^)]*)\)", e)
            for label in re.split(r",\s*", group)} - {"le"}
    assert used <= labels, used - labels
