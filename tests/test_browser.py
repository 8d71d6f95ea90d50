"""The browser tier: the operator's page (GET /ui) in Debian's chromium, driven
by Playwright, against real pools (a synthetic model and the tiny llama-server
model). scripts/test-browser installs chromium and Playwright and runs these;
elsewhere they are skipped when either is missing.

Screenshots go to each test's tmp dir; LLM_POOL_UI_SCREENSHOT=PATH also saves
the overview there (docs/ui.png in the README is made that way)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.conftest import llama, synthetic
from tests.pool import Pool, wait_for

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("LLM_POOL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="no Playwright: run scripts/test-browser")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: run scripts/test-browser")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Page:
    """A fresh browser context (its own sessionStorage) on one pool's page,
    collecting console errors and uncaught exceptions."""

    def __init__(self, browser, pool: Pool, shots: Path, **context) -> None:
        self.context = browser.new_context(**{"viewport": {"width": 1400, "height": 1000}, **context})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("request", lambda r: self.requests.append(r))
        self.pool = pool
        self.shots = shots
        self.page.goto(pool.url + "/ui")

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=path, full_page=True)
        return path

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser, tmp_path):
    pages: list[Page] = []

    def open_(pool: Pool, **context) -> Page:  # context: Playwright's new_context options (a phone's)
        pages.append(Page(browser, pool, tmp_path, **context))
        return pages[-1]

    yield open_
    for page in pages:
        page.close()


@pytest.fixture(scope="module")
def pool(browser, tmp_path_factory, llama_server_bin, tiny_gguf):  # browser first: skip before starting
    """One pool for the page's tests: a request to `syn` runs 2 s, long enough to be caught in flight."""
    pool = Pool(tmp_path_factory.mktemp("pool"),
                [synthetic("syn", tokens=400, tps=200), llama("tiny", tiny_gguf, llama_server_bin)])
    pool.start()
    yield pool
    pool.stop()


def model_row(page, name: str):
    return page.locator(f'#models tbody tr[data-model="{name}"]')


def test_page_shows_models_workers_activity_and_log(pool, open_page):
    from playwright.sync_api import expect

    ui = open_page(pool)
    page = ui.page
    for name in ("syn", "tiny"):
        expect(model_row(page, name).locator(".state")).to_have_text("loaded")
        worker = pool.workers(name)[0]
        expect(page.locator(f'#workers tr[data-worker="{name}/0"] .pid')).to_have_text(str(worker["pid"]))
        expect(page.locator(f'#workers tr[data-worker="{name}/0"] .node')).to_have_text(worker["node"])
    llama_child = pool.workers("tiny")[0]["children"][0]
    expect(page.locator('#workers tr[data-worker="tiny/0"]')).to_contain_text(f"llama-server:{llama_child['pid']}")
    # warm swaps under the memory: on for llama-server (nothing saved yet); none for synthetic
    expect(model_row(page, "tiny").locator("td.memory .warm-swap")).to_have_text("KV saved: 0")
    expect(model_row(page, "syn").locator("td.memory .warm-swap")).to_have_count(0)

    # a request sent now is in the activity table within 2 s, with its status and token counts
    before = pool.http.get("/admin/requests", params={"limit": 1}).json()["requests"]
    next_id = (before[0]["id"] if before else 0) + 1
    r = pool.http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 6,
                                                     "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200
    usage = r.json()["usage"]
    row = page.locator(f'#activity tbody tr[data-id="{next_id}"]')
    expect(row).to_be_visible(timeout=2000)
    expect(row.locator(".model")).to_have_text("tiny")
    expect(row.locator(".status")).to_have_text("200")
    expect(row.locator(".tokens-in")).to_have_text(str(usage["prompt_tokens"]))
    expect(row.locator(".tokens-out")).to_have_text(str(usage["completion_tokens"]))

    # the same prompt again: llama-server serves most of it from its prompt cache, and times each phase
    again = pool.http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 6,
                                                         "messages": [{"role": "user", "content": "hello"}]})
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    row = page.locator(f'#activity tbody tr[data-id="{next_id + 1}"]')
    expect(row.locator(".cached")).to_have_text(str(cached), timeout=2000)
    expect(row.locator("td.speed").first).not_to_have_text("-")
    assert row.locator("td.speed.derived").count() == 0  # the runtime's own figures, unmarked
    row.click()
    expect(page.locator("#request-detail")).to_contain_text(f"(cached: {cached})")
    expect(page.locator("#request-detail")).to_contain_text("timed by the runtime")

    # an error row shows its message when clicked
    assert pool.http.post("/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}).status_code == 404
    failed = page.locator(f'#activity tbody tr[data-id="{next_id + 2}"]')
    expect(failed.locator(".code")).to_have_text("model_not_found", timeout=2000)
    failed.click()
    expect(page.locator("#request-detail")).to_contain_text("model 'nope' does not exist")

    # the log tail (replica syn/0, the first in the list) shows a line written now
    expect(page.locator("#log-target")).to_have_value("syn/0")
    log_path = pool.config_path.parent / "state" / "llm-pool" / "logs" / "syn-0.log"
    expect(page.locator("#log-lines")).not_to_be_empty()
    with open(log_path, "a") as f:
        f.write("a line the test wrote just now\n")
    expect(page.locator("#log-lines")).to_contain_text("a line the test wrote just now", timeout=3000)
    page.select_option("#log-target", "tiny/0")
    expect(page.locator("#log-lines")).to_contain_text("llama", timeout=3000)  # llama-server's own output

    # the charts have samples for both models
    wait_for(lambda: page.evaluate("state.samples.length") >= 2, 5, what="two live samples")
    expect(page.locator("#legend")).to_contain_text("syn")
    expect(page.locator("#legend")).to_contain_text("tiny")

    shot = ui.shot("overview")
    if os.environ.get("LLM_POOL_UI_SCREENSHOT"):
        shutil.copy(shot, os.environ["LLM_POOL_UI_SCREENSHOT"])
    assert ui.errors == []


def test_unload_button_drains_the_model(pool, open_page):
    from playwright.sync_api import expect

    pool.http.post("/admin/models/syn/load")  # loaded, whatever ran before
    result = {}

    def long_request() -> None:  # 2 s of tokens: in flight when the button is pressed
        result["r"] = pool.http.post("/v1/chat/completions", json={
            "model": "syn", "messages": [{"role": "user", "content": "long"}]})

    ui = open_page(pool)
    page = ui.page
    row = model_row(page, "syn")
    expect(row.locator(".state")).to_have_text("loaded")
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        wait_for(lambda: pool.model("syn")["runtime_inflight"] == 1, 5, what="the long request in flight")
        row.locator("button.unload").click()
        expect(row.locator(".state")).to_have_text("unloading", timeout=3000)
        expect(row.locator(".reason")).to_contain_text("unloading: asked by page")  # planned work says so
        ui.shot("unloading")
        expect(row.locator(".state")).to_have_text("unloaded", timeout=15000)
    finally:
        worker.join(30)
    assert dialogs == ["unload syn?"]
    assert result["r"].status_code == 200  # drained: the running request finished
    assert pool.model("syn")["state"] == "unloaded"
    expect(page.locator('#workers tr[data-worker="syn/0"]')).to_have_count(0, timeout=3000)
    expect(model_row(page, "tiny").locator(".state")).to_have_text("loaded")
    ui.shot("unloaded")
    assert ui.errors == []


def test_admin_key_is_asked_for_and_sent_as_a_header(make_pool, open_page):
    from playwright.sync_api import expect

    key = "page-admin-key-123"
    pool = make_pool([synthetic("k")], server={"admin_key": key})
    ui = open_page(pool)
    page = ui.page
    expect(page.locator("#key-dialog")).to_be_visible()
    expect(page.locator("#main")).to_be_hidden()
    assert model_row(page, "k").count() == 0
    ui.shot("key-asked")

    page.fill("#key-input", "a-wrong-key")
    page.click("#key-submit")
    expect(page.locator("#key-error")).to_be_visible()
    expect(page.locator("#main")).to_be_hidden()

    page.fill("#key-input", key)
    page.click("#key-submit")
    expect(page.locator("#main")).to_be_visible()
    expect(model_row(page, "k").locator(".state")).to_have_text("loaded")
    expect(page.locator('#workers tr[data-worker="k/0"]')).to_have_count(1)
    wait_for(lambda: page.evaluate("state.samples.length") >= 1, 5, what="live samples with the key")
    assert page.evaluate("sessionStorage.getItem('llm-pool-admin-key')") == key
    ui.shot("key-entered")

    page.reload()  # kept for the session: not asked again
    expect(model_row(page, "k").locator(".state")).to_have_text("loaded")
    expect(page.locator("#key-dialog")).to_be_hidden()

    admin = [r for r in ui.requests if "/admin/" in r.url]
    assert admin and all(key not in r.url for r in ui.requests)
    sent = [r.headers.get("authorization") for r in admin]
    assert f"Bearer {key}" in sent
    # the only console errors are the refused calls (401) before the right key was typed
    assert all("401" in e for e in ui.errors), ui.errors


# -- the operator at 3 a.m.: what the page says when things go wrong ---------------------------------
def _kill(pool, model: str, replica: int) -> None:
    import signal
    os.kill(pool.workers(model)[replica]["pid"], signal.SIGKILL)


def test_degraded_and_failed_models_say_why_and_events_tell_the_story(make_pool, open_page):
    """A degraded model amber with its reason; a failed model's reason and its replica
    listed, with no alert(); the events panel: kill -> restart -> fatal, in order."""
    from playwright.sync_api import expect

    from tests.test_cli import with_options
    from tests.test_operator import break_spawns, mend_spawns

    pool = make_pool([synthetic("syn", replicas=2),
                      with_options(synthetic("stuck", load_timeout_s=1), load_ms=60_000)], wait_ready=False)
    wait_for(lambda: pool.model("stuck")["state"] == "failed" and pool.model("syn")["state"] == "loaded", 30,
             what="stuck failed, syn loaded")
    ui = open_page(pool)
    page = ui.page
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.type), d.accept()))

    # the failed model: its reason in its row, its replica listed with the error, its log selectable
    stuck = model_row(page, "stuck")
    expect(stuck.locator(".state")).to_have_text("failed")
    expect(stuck.locator(".reason")).to_contain_text("load_timeout_s")
    expect(page.locator('#workers tr[data-worker="stuck/0"] .reason')).to_contain_text("load_timeout_s")
    expect(page.locator('#log-target option[value="stuck/0"]')).to_have_count(1)

    # kill -> (crash restart) -> operator restart from the page -> fatal
    _kill(pool, "syn", 1)
    wait_for(lambda: pool.workers("syn")[1]["state"] == "ready" and pool.workers("syn")[1]["restarts"] == 1, 20,
             what="syn/1 restarted after the crash")
    model_row(page, "syn").locator("button.restart").click()
    expect(page.locator('#events tr[data-kind="restarted"]')).to_have_count(2, timeout=20000)  # syn/0 and syn/1
    broken = break_spawns(pool)
    _kill(pool, "syn", 1)
    row = model_row(page, "syn")
    expect(row.locator(".state")).to_have_text("degraded", timeout=10000)
    expect(row.locator(".reason")).to_contain_text("syn/1 fatal")
    expect(row.locator(".reason")).to_contain_text("cannot spawn the worker")
    amber = page.evaluate("getComputedStyle(document.documentElement).getPropertyValue('--warn').trim()")
    assert row.locator(".state").evaluate("e => getComputedStyle(e).color") == _rgb(amber)
    expect(page.locator('#workers tr[data-worker="syn/1"] .last-exit')).to_have_text("SIGKILL")
    expect(page.locator('#events tr[data-kind="fatal"]')).to_have_count(1, timeout=5000)
    kinds = page.locator("#events tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.kind + ' ' + r.querySelector('td:nth-child(3)').textContent).reverse()")
    story = [k for k in kinds if k.endswith("syn/1") and k.split()[0] in ("crashed", "restarting", "fatal")]
    assert story == ["crashed syn/1", "restarting syn/1", "crashed syn/1", "fatal syn/1"], kinds
    expect(page.locator('#events tr[data-kind="restarting"]').first).to_contain_text("page")
    ui.shot("degraded")
    if os.environ.get("LLM_POOL_UI_SCREENSHOT"):
        shutil.copy(ui.shot("degraded"), os.environ["LLM_POOL_UI_SCREENSHOT"])
    mend_spawns(*broken)
    assert dialogs == ["confirm"]  # the restart's confirmation; no alert() anywhere
    assert ui.errors == []


def _rgb(hex_color: str) -> str:
    h = hex_color.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))


def test_restart_button_lets_a_running_stream_finish(make_pool, open_page):
    import json

    from playwright.sync_api import expect

    pool = make_pool([synthetic("syn", tps=20, tokens=100)])  # 5 s of tokens
    ui = open_page(pool)
    page = ui.page
    page.on("dialog", lambda d: d.accept())
    row = model_row(page, "syn")
    expect(row.locator(".state")).to_have_text("loaded")
    got = {"tokens": 0}

    def stream() -> None:
        with pool.http.stream("POST", "/v1/chat/completions", json={
                "model": "syn", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "long"}]}) as r:
            got["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        got["error"] = chunk["error"]
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        got["tokens"] += len(chunk["choices"][0]["delta"]["content"].split())  # a word a token
                    if chunk.get("usage"):
                        got["usage"] = chunk["usage"]["completion_tokens"]
                elif line == "data: [DONE]":
                    got["done"] = True

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        wait_for(lambda: got["tokens"] >= 3, 10, what="the stream under way")
        pid = pool.workers("syn")[0]["pid"]
        row.locator("button.restart").click()
        # an operator's restart shows as what it is while it drains (it showed "draining", as an unload)
        expect(page.locator('#workers tr[data-worker="syn/0"] td:nth-child(4)')).to_have_text("restarting",
                                                                                           timeout=3000)
        ui.shot("restarting")
        wait_for(lambda: pool.workers("syn")[0]["pid"] not in (None, pid), 30, what="a new worker")
    finally:
        runner.join(30)
    assert got == {"status": 200, "tokens": 100, "usage": 100, "done": True}, got  # the whole answer, no error
    expect(row.locator(".state")).to_have_text("loaded")
    assert ui.errors == []


def test_a_1000_character_model_name_leaves_the_layout_intact(make_pool, open_page):
    from playwright.sync_api import expect

    pool = make_pool([synthetic("syn")])
    ui = open_page(pool)
    page = ui.page
    expect(model_row(page, "syn").locator(".state")).to_have_text("loaded")
    name = "m" * 990 + "-the-end"
    r = pool.http.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    row = page.locator("#activity tbody tr").first
    expect(row.locator(".code")).to_have_text("model_not_found", timeout=3000)
    width = page.evaluate("document.documentElement.clientWidth")
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    for table in ("#activity", "#models", "#workers", "#events"):
        box = page.locator(table).bounding_box()
        assert box["x"] + box["width"] <= width, table
    cell = row.locator(".model").bounding_box()
    assert cell["width"] < 400  # clipped
    row.click()
    stored = pool.http.get("/admin/requests", params={"limit": 1}).json()["requests"][0]["model"]
    assert name.startswith(stored) and len(stored) >= 200  # the request log keeps it bounded
    expect(page.locator("#request-detail")).to_contain_text(stored)  # all the log has, in the detail
    detail = page.locator("#request-detail").bounding_box()
    assert detail["x"] + detail["width"] <= width
    ui.shot("long-name")

    # filters and the error rate: the one request so far is a 4xx (a client's error, not the pool's)
    expect(page.locator("#error-rate")).to_contain_text("1 requests; 4xx 1 (100.0%), 5xx 0 (0.0%)")
    page.select_option("#filter-status", "2xx")
    expect(page.locator("#activity tbody tr")).to_have_count(0, timeout=3000)
    page.select_option("#filter-status", "4xx")
    expect(page.locator("#activity tbody tr")).to_have_count(1, timeout=3000)
    assert ui.errors == []


def test_offline_greys_every_table_and_comes_back(make_pool, open_page, tmp_path):
    import httpx
    from playwright.sync_api import expect

    pool = make_pool([synthetic("syn")])
    ui = open_page(pool)
    page = ui.page
    expect(model_row(page, "syn").locator(".state")).to_have_text("loaded")
    expect(page.locator("#offline")).to_be_hidden()
    pool.stop()
    pool.proc = None  # stopped here: the fixture has nothing left to stop
    expect(page.locator("#offline")).to_be_visible(timeout=5000)
    expect(page.locator("#offline")).to_contain_text("not answering since")
    expect(page.locator("#main")).to_have_class("is-offline")
    assert page.locator("section").first.evaluate("e => getComputedStyle(e).opacity") == "0.45"
    expect(page.locator("#conn")).to_contain_text("offline since")
    ui.shot("offline")

    # the same pool, started again on the same port: the page comes back by itself
    again = Pool(tmp_path, [synthetic("syn")], server={"port": pool.port})
    again.port, again.url = pool.port, pool.url
    again.http = httpx.Client(base_url=pool.url, timeout=60)
    again.start()
    try:
        expect(page.locator("#offline")).to_be_hidden(timeout=10000)
        expect(page.locator("#main")).not_to_have_class("is-offline")
        expect(page.locator("#conn")).to_have_text("live")
        pid = again.workers("syn")[0]["pid"]
        expect(page.locator('#workers tr[data-worker="syn/0"] .pid')).to_have_text(str(pid), timeout=5000)
    finally:
        again.stop()
    # the only console errors are the failed fetches while it was down
    assert all("Failed to load resource" in e or "fetch" in e.lower() for e in ui.errors), ui.errors


def test_activity_filters_by_tenant_and_blanks_what_a_runtime_did_not_report(make_pool, open_page):
    """The tenant filter lists the configured tenants and shows one tenant's rows; a runtime
    that reports no cached tokens (synthetic) leaves the cell blank, its speeds marked derived."""
    from playwright.sync_api import expect

    admin = "tenant-page-admin"
    pool = make_pool([synthetic("syn", tokens=3, tps=100)], server={"admin_key": admin},
                     tenants=[{"name": "team-a", "keys": ["sk-a"]}, {"name": "team-b", "keys": ["sk-b"]}])
    for k in ("sk-a", "sk-b", "sk-b"):
        r = pool.http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {k}"},
                           json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    ui = open_page(pool)
    page = ui.page
    page.fill("#key-input", admin)
    page.click("#key-submit")
    rows = page.locator("#activity tbody tr")
    expect(rows).to_have_count(3)
    expect(page.locator("#filter-tenant option")).to_have_text(["all", "team-a", "team-b", "default"])
    page.select_option("#filter-tenant", "team-b")
    expect(rows).to_have_count(2)
    expect(page.locator("#activity tbody tr .tenant")).to_have_text(["team-b", "team-b"])
    page.select_option("#filter-tenant", "team-a")
    expect(rows).to_have_count(1)
    expect(rows.locator(".tenant")).to_have_text("team-a")
    expect(rows.locator(".cached")).to_have_text("")  # not reported: blank, never a 0
    expect(rows.locator("td.speed.derived").last).to_contain_text("~")  # decode, from the pool's own times
    ui.shot("tenant-filter")
    assert all("401" in e for e in ui.errors), ui.errors  # the page's first call, before the key was typed


# -- the page fits the screen, and a refresh leaves what the operator is doing alone ----------------------------
OVERFLOWS = """() => {
  const out = [], width = window.innerWidth, page = document.scrollingElement;
  if (page.scrollWidth > width) out.push(`the page: ${page.scrollWidth} px wide in ${width}`);
  for (const s of document.querySelectorAll("section")) {
    if (s.scrollWidth > s.clientWidth) out.push(`${s.querySelector("h2").textContent.trim().slice(0, 20)}: ` +
                                                 `${s.scrollWidth} px in ${s.clientWidth}`);
  }
  return out;
}"""


def assert_fits(page, what: str) -> None:
    """No sideways scrolling: not the page, not one section."""
    assert page.evaluate(OVERFLOWS) == [], what


def within_width(page, selector: str) -> list[str]:
    """The elements of `selector` that reach past the viewport's right edge (or its left)."""
    width = page.viewport_size["width"]
    out = []
    for item in page.locator(selector).all():
        box = item.bounding_box()
        if box is None or box["x"] < 0 or box["x"] + box["width"] > width:
            out.append(f"{selector}: {box}")
    return out


@pytest.mark.parametrize("width, height", [(1280, 800), (390, 844)])
def test_the_page_fits_a_laptop_and_a_phone(pool, open_page, width, height):
    """At 1280x800 the models table's buttons are on screen with no sideways scroll; at a phone's
    390 px no section scrolls sideways either (the tables become lists of cards)."""
    from playwright.sync_api import expect

    for model in ("tiny", "nope"):  # a success and an error in the activity table
        pool.http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    ui = open_page(pool)
    page = ui.page
    page.set_viewport_size({"width": width, "height": height})
    expect(model_row(page, "syn")).to_be_visible()  # loaded, or unloaded by an earlier test's button
    expect(model_row(page, "tiny").locator(".state")).to_have_text("loaded")
    expect(page.locator('#workers tr[data-worker="tiny/0"]')).to_be_visible()
    expect(page.locator('#routing tr[data-worker="tiny/0"]')).to_be_visible()
    expect(page.locator("#activity tbody tr .code").first).to_have_text("model_not_found", timeout=3000)
    wait_for(lambda: page.evaluate("state.samples.length") >= 1, 5, what="a live sample")
    ui.shot(f"fit-{width}")
    assert_fits(page, f"{width}x{height}")
    assert page.locator("#models button").count() == 6
    assert within_width(page, "#models button") == []
    assert within_width(page, "#error-rate") == []
    assert ui.errors == []


def test_a_long_name_a_failed_model_and_the_error_rates_stay_on_screen(make_pool, open_page, tmp_path):
    """A configured name as long as the config allows (64), a client's 200-character one and a
    model that failed to load (its reason in the why column) leave the models' buttons, the
    replica-choice table, the chart captions, the filters and the error rate on screen at 1280x800
    and at a phone's width; the error rate shows 4xx and 5xx apart, and who sent the 4xx."""
    from playwright.sync_api import expect

    name = "a-model-with-a-name-as-long-as-the-config-allows-" + "x" * 14
    model = synthetic(name, tokens=4, tps=100)
    model["options"].update(chaos="lone_surrogate", chaos_prompt="boom")  # "boom": the worker fails it, 502
    ghost = {"name": "ghost", "backend": "llama_server", "options": {"model": str(tmp_path / "no" / "ghost.gguf")}}
    pool = make_pool([model, ghost], server={"admin_key": "sk-admin"}, wait_ready=False,
                     tenants=[{"name": "team-a", "keys": ["sk-a"]}])
    admin, team = {"Authorization": "Bearer sk-admin"}, {"Authorization": "Bearer sk-a"}
    wait_for(lambda: {m["name"]: m["state"] for m in pool.http.get("/admin/models", headers=admin).json()[
        "models"]} == {name: "loaded", "ghost": "failed"}, 30, what="one model loaded, one failed")
    for model_name, content in ((name, "hi"), (name, "boom"), ("m" * 200, "hi")):
        pool.http.post("/v1/chat/completions", headers=team,
                       json={"model": model_name, "messages": [{"role": "user", "content": content}]})
    assert pool.http.post("/v1/chat/completions", headers=team, json={"model": name}).status_code == 400
    ui = open_page(pool)
    page = ui.page
    page.set_viewport_size({"width": 1280, "height": 800})
    page.fill("#key-input", "sk-admin")
    page.click("#key-submit")
    expect(model_row(page, name).locator(".state")).to_have_text("loaded")
    expect(model_row(page, "ghost").locator(".reason")).to_contain_text("model file not found")
    expect(page.locator("#activity tbody tr")).to_have_count(4)
    expect(page.locator(f'#routing tr[data-worker="{name}/0"]')).to_be_visible()
    wait_for(lambda: page.evaluate("state.samples.length") >= 1, 5, what="a live sample")
    for width, height in ((1280, 800), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        ui.shot(f"long-name-{width}")
        assert_fits(page, f"{width}x{height}")
        assert within_width(page, "#models button") == []
        assert within_width(page, "#error-rate") == []
        assert within_width(page, ".filters select") == []
        assert within_width(page, "figcaption") == []

    rate = page.locator("#error-rate")
    expect(rate).to_contain_text("4 requests")
    expect(rate.locator(".rate-4xx")).to_have_text("4xx 2 (50.0%)")
    expect(rate.locator(".rate-5xx")).to_have_text("5xx 1 (25.0%)")
    expect(rate.locator(".rate-5xx")).to_have_class("rate-5xx bad")
    expect(rate).to_contain_text("4xx by tenant: team-a 2")
    assert all("401" in e for e in ui.errors), ui.errors  # the page's first call, before the key was typed


def test_a_refresh_keeps_a_selection_and_fetches_only_new_rows(pool, open_page):
    """An error code selected in the activity table, or a model's name, stays selected while the
    page refreshes (rows that did not change are not rebuilt); after its first fetch the page asks
    only for the rows after the newest it has; activity fills the window, not nine rows."""
    from playwright.sync_api import expect

    for i in range(24):
        pool.http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": f"hi {i}"}]})
    assert pool.http.post("/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}).status_code == 404
    failed = wait_for(lambda: (rows := pool.http.get("/admin/requests", params={"limit": 1}).json()["requests"])
                      and rows[0]["status"] == 404 and rows[0]["id"], 5, what="the 404's row")
    ui = open_page(pool)
    page = ui.page
    page.set_viewport_size({"width": 1280, "height": 800})
    code = page.locator(f'#activity tr[data-id="{failed}"] .code')
    expect(code).to_have_text("model_not_found")
    page.locator("#activity").scroll_into_view_if_needed()
    scroller, rows = page.locator("#activity").locator(".."), page.locator("#activity tbody tr")
    bottom = scroller.bounding_box()["y"] + scroller.bounding_box()["height"]
    assert sum(1 for row in rows.all()[:40] if row.bounding_box()["y"] + 10 < bottom) >= 15

    select = """selector => { const range = document.createRange();
      range.selectNodeContents(document.querySelector(selector));
      getSelection().removeAllRanges(); getSelection().addRange(range); return String(getSelection()); }"""
    assert page.evaluate(select, f'#activity tr[data-id="{failed}"] .code .cut') == "model_not_found"
    asked = len(ui.requests)
    assert pool.http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "one more"}]}).status_code == 200
    expect(page.locator(f'#activity tr[data-id="{failed + 1}"]')).to_be_visible(timeout=3000)
    fetched = lambda: [r.url for r in ui.requests[asked:] if "/admin/requests?" in r.url]  # noqa: E731
    # (page.evaluate lets Playwright deliver the page's request events to this thread)
    wait_for(lambda: page.evaluate("true") and len(fetched()) >= 3, 10, what="three more refreshes")
    assert page.evaluate("String(getSelection())") == "model_not_found"

    # a model's row changes (its last use, in flight) around a selected name
    assert page.evaluate(select, '#models tr[data-model="tiny"] td.name .cut') == "tiny"
    used = model_row(page, "tiny").locator("td").nth(6)
    before = used.text_content()
    pool.http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "again"}]})
    wait_for(lambda: used.text_content() != before, 10, what="the model's row to change")
    assert page.evaluate("String(getSelection())") == "tiny"

    requests = [r.url for r in ui.requests if "/admin/requests?" in r.url]
    assert "after_id" not in requests[0] and len(requests) > 3
    assert all("after_id=" in url for url in requests[1:]), requests
    assert ui.errors == []


def test_activity_pages_back_past_the_newest_200_rows(make_pool, open_page):
    from playwright.sync_api import expect

    pool = make_pool([synthetic("syn", tokens=1)])
    for i in range(205):
        assert pool.http.post("/v1/chat/completions", json={"model": "syn", "messages": [
            {"role": "user", "content": f"n{i}"}]}).status_code == 200
    wait_for(lambda: len(pool.http.get("/admin/requests", params={"limit": 300}).json()["requests"]) == 205, 5,
             what="205 rows in the request log")
    ui = open_page(pool)
    page = ui.page
    rows = page.locator("#activity tbody tr")
    expect(rows).to_have_count(200)
    expect(rows.first).to_have_attribute("data-id", "205")
    page.click("#activity-older")
    expect(rows).to_have_count(205)
    expect(rows.last).to_have_attribute("data-id", "1")
    expect(page.locator("#activity-older")).to_be_hidden()
    assert ui.errors == []
