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

    def __init__(self, browser, pool: Pool, shots: Path) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
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

    def open_(pool: Pool) -> Page:
        pages.append(Page(browser, pool, tmp_path))
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

    # an error row shows its message when clicked
    assert pool.http.post("/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}).status_code == 404
    failed = page.locator(f'#activity tbody tr[data-id="{next_id + 1}"]')
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
