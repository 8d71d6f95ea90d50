"""An operator's unload under traffic (issue 47, item 3): a load on demand soon after it is
warned of (the unload achieved nothing), and `unload --hold` keeps the model unloaded:
requests get 409 model_not_loaded naming the hold, as for load_on_demand = false, until an
operator's load or a reload. Real pools, real workers, the real CLI."""

from __future__ import annotations

from tests.conftest import synthetic
from tests.pool import wait_for
from tests.test_cli import cli, table_rows


def chat(pool, model: str):
    return pool.http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]})


def kind_events(pool, kind: str) -> list[dict]:
    return [e for e in pool.http.get("/admin/events").json()["events"] if e["kind"] == kind]


def test_a_load_on_demand_right_after_an_operators_unload_is_warned_of(make_pool):
    pool = make_pool([synthetic("syn")])
    assert pool.http.post("/admin/models/syn/unload").status_code == 200
    assert pool.model("syn")["held"] is False
    assert chat(pool, "syn").status_code == 200  # requests keep coming: it loads again on demand
    [warning] = wait_for(lambda: kind_events(pool, "unload_undone") or None, 10, what="the warning")
    assert warning["level"] == "warning", warning
    assert warning["message"].startswith("model syn was loaded on demand ")
    assert "after an operator's unload: requests keep coming; `llm-pool unload syn --hold` keeps it unloaded" \
        in warning["message"], warning
    assert "model syn was loaded on demand" in pool.log()

    # a load on demand long after the unload (an idle model woken) is no warning; once warned, not again
    assert pool.http.post("/admin/models/syn/unload").status_code == 200
    assert pool.http.post("/admin/models/syn/load").status_code == 200
    assert pool.http.post("/admin/models/syn/unload").status_code == 200
    assert len(kind_events(pool, "unload_undone")) == 1  # an operator's load is no load on demand


def test_unload_hold_keeps_a_model_unloaded_until_an_operators_load(make_pool):
    pool = make_pool([synthetic("syn"), synthetic("other")])
    done = cli("unload", "syn", "--hold", url=pool.url)
    assert done.returncode == 0, done.stderr
    assert "syn: unloaded (held" in done.stdout, done.stdout
    view = pool.model("syn")
    assert (view["state"], view["held"]) == ("unloaded", True) and view["held_by"], view

    refused = chat(pool, "syn")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded" and error["param"] == "model"
    assert "held unloaded" in error["message"] and "llm-pool unload --hold" in error["message"], error
    assert pool.model("syn")["state"] == "unloaded"  # no load on demand
    assert not kind_events(pool, "unload_undone")
    # the pool says it: /ready lists it as not serving; `llm-pool models` shows the hold
    assert "syn" in pool.http.get("/ready").json()["not_serving"]
    rows = {r["NAME"]: r for r in table_rows(cli("models", "-o", "wide", url=pool.url).stdout)}
    assert rows["syn"]["STATE"] == "unloaded (held)" and rows["other"]["STATE"] == "loaded", rows

    # an operator's load releases it; an unload without --hold then loads on demand again
    assert cli("load", "syn", url=pool.url).returncode == 0
    assert pool.model("syn")["held"] is False
    assert chat(pool, "syn").status_code == 200
    assert pool.http.post("/admin/models/syn/unload").status_code == 200
    assert chat(pool, "syn").status_code == 200


def test_a_reload_releases_an_unloads_hold(make_pool):
    pool = make_pool([synthetic("syn")])
    answer = pool.http.post("/admin/models/syn/unload", params={"hold": "true"})
    assert answer.status_code == 200 and answer.json()["held"] is True, answer.text
    assert chat(pool, "syn").status_code == 409
    assert pool.http.post("/admin/reload").status_code == 200
    assert pool.model("syn")["held"] is False
    assert chat(pool, "syn").status_code == 200
