"""The browser tier (see test_browser.py): the page at 3 a.m. A crash loop and a run of
reloads folded into one row each with their count, the events filtered by model and level,
an event opened by a tap to its whole text at a phone's 390 px; failed and degraded models
first, the tab's title and icon saying so; the errors chart (4xx apart from 5xx); no "-",
"null" or "undefined" in an empty cell; one time format everywhere."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.conftest import synthetic
from tests.pool import wait_for
from tests.test_browser import assert_fits, browser, model_row, open_page  # noqa: F401 (the tier's fixtures)

pytestmark = pytest.mark.browser

TIME = re.compile(r"^(\d{4}-\d{2}-\d{2} )?\d{2}:\d{2}:\d{2}$")
EMPTY_WORDS = """() => [...document.querySelectorAll("main td")].map((td) => td.textContent.trim())
  .filter((text) => ["-", "null", "undefined", "NaN", "None"].includes(text) || /\\b(undefined|NaN)\\b/.test(text))"""

# the favicon's colour: its middle pixel
DOT_COLOUR = """async (src) => { const img = new Image(); img.src = src; await img.decode();
  const c = document.createElement("canvas"); c.width = c.height = 32; const g = c.getContext("2d");
  g.drawImage(img, 0, 0); return [...g.getImageData(16, 16, 1, 1).data].slice(0, 3); }"""


def _crash(pool, model: str, times: int) -> None:
    """Kill a model's replica `times` times, each once it is back (a crash loop the restart
    policy still restarts: five crashes in two minutes make it fatal)."""
    killed: set[int] = set()

    def ready_worker() -> dict | None:
        # a worker is listed before it has a pid (spawning) and before it is ready: wait for both,
        # and for a pid not killed already (the row may still show the dead worker)
        w = pool.workers(model)[0]
        return w if w["state"] == "ready" and w["pid"] and w["pid"] not in killed else None

    for i in range(times):
        worker = wait_for(ready_worker, 30, what=f"{model}/0 ready before crash {i + 1}")
        killed.add(worker["pid"])
        os.kill(worker["pid"], signal.SIGKILL)
    wait_for(ready_worker, 30, what=f"{model}/0 back after crash {times}")


def test_a_crash_loop_folds_filters_and_opens_by_touch_at_a_phones_width(make_pool, open_page):
    from playwright.sync_api import expect

    pool = make_pool([synthetic("loop"), synthetic("calm")])
    _crash(pool, "loop", 3)
    for _ in range(3):
        assert pool.http.post("/admin/reload").status_code == 200
    ui = open_page(pool, viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True)
    page = ui.page
    expect(model_row(page, "loop").locator(".state")).to_have_text("loaded")

    # unfiltered: the three reloads (the same text) are one row, ×3
    reloads = page.locator('#events tbody tr[data-kind="reloaded"]')
    expect(reloads).to_have_count(1)
    expect(reloads).to_have_attribute("data-count", "3")
    expect(reloads.locator(".kind")).to_have_text("reloaded ×3")
    expect(reloads.locator("td").nth(2)).to_have_text("pool")
    # the crash loop too, unfiltered: its model's state changes between the crashes do not cut the run
    loop = page.locator('#events tbody tr[data-kind="crashed"]')
    expect(loop).to_have_count(1)
    expect(loop).to_have_attribute("data-count", "3")
    page.select_option("#events-model", "(pool)")  # the pool's own events: no model's
    expect(reloads).to_have_count(1)
    expect(page.locator('#events tbody tr[data-kind="loaded"]')).to_have_count(0)

    # the crash loop, by model and level: one red row, ×3 (its state events, warnings, filtered out)
    page.select_option("#events-model", "loop")
    page.select_option("#events-level", "error")
    rows = page.locator("#events tbody tr")
    expect(rows).to_have_count(1)
    crashed = rows.first
    expect(crashed).to_have_attribute("data-kind", "crashed")
    expect(crashed).to_have_attribute("data-count", "3")
    expect(crashed.locator(".kind")).to_have_text("crashed ×3")
    page.select_option("#events-model", "calm")
    expect(rows).to_have_count(0)
    page.select_option("#events-level", "")
    expect(page.locator('#events tbody tr[data-kind="loaded"]')).to_have_count(1)
    expect(page.locator('#events tbody tr[data-kind="crashed"]')).to_have_count(0)
    page.select_option("#events-model", "loop")
    page.select_option("#events-level", "error")

    # at 390 px the row is one clipped line; a tap opens it to the whole text, wrapped on screen
    text = crashed.locator("td.what .cut")
    message = [e["message"] for e in pool.http.get("/admin/events", params={"model": "loop"}).json()["events"]
               if e["kind"] == "crashed"][-1]
    clipped = text.evaluate("e => [e.scrollWidth, e.clientWidth, e.getBoundingClientRect().height]")
    assert clipped[0] > clipped[1], f"not clipped at 390 px: {clipped}"
    crashed.tap()
    expect(crashed).to_have_class(re.compile(r"\bopen\b"))
    expect(crashed).to_have_attribute("aria-expanded", "true")
    expect(text).to_contain_text(message)
    expect(text).to_contain_text(re.compile(r"\(×3 since \d\d:\d\d:\d\d\)"))
    opened = text.evaluate("e => [e.scrollWidth, e.clientWidth, e.getBoundingClientRect().height]")
    assert opened[2] > clipped[2] * 1.5, (clipped, opened)  # wrapped over lines
    box = text.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    assert_fits(page, "an event opened at 390 px")
    ui.shot("event-open-390")
    # a new event remakes the rows: the open one stays open (which rows are open is the page's, not a row's)
    assert pool.http.post("/admin/reload").status_code == 200
    newest = pool.http.get("/admin/events", params={"limit": 1}).json()["events"][-1]["id"]
    wait_for(lambda: page.evaluate("state.lastEvent") >= newest, 10, what="the page has the new event")
    expect(crashed).to_have_class(re.compile(r"\bopen\b"))
    crashed.tap()
    expect(crashed).not_to_have_class(re.compile(r"\bopen\b"))
    crashed.press("Enter")  # the keyboard's way
    expect(crashed).to_have_attribute("aria-expanded", "true")
    page.set_viewport_size({"width": 1280, "height": 800})  # open on a laptop: wrapped there too
    assert_fits(page, "an event opened at 1280 px")

    # warnings and errors: the crashes (and any warning), not the loads (info)
    page.select_option("#events-level", "warning")
    expect(page.locator('#events tbody tr[data-kind="crashed"]')).to_have_count(1)
    expect(page.locator('#events tbody tr[data-kind="loaded"]')).to_have_count(0)
    page.select_option("#events-level", "info")
    expect(page.locator('#events tbody tr[data-kind="loaded"]')).to_have_count(1)
    assert ui.errors == []


def test_failed_first_the_tab_says_so_errors_are_charted_and_empty_cells_are_empty(make_pool, open_page,
                                                                                  tmp_path):
    from playwright.sync_api import expect

    from tests.test_operator import break_spawns, mend_spawns

    boom = synthetic("boom", tokens=2)
    boom["options"].update(chaos="lone_surrogate", chaos_prompt="boom")  # "boom": the worker fails it, 502
    ghost = {"name": "ghost", "backend": "llama_server", "options": {"model": str(tmp_path / "no" / "ghost.gguf")}}
    pool = make_pool([synthetic("aaa"), boom, synthetic("half", replicas=2), ghost], wait_ready=False)
    wait_for(lambda: pool.model("ghost")["state"] == "failed" and all(
        pool.model(n)["state"] == "loaded" for n in ("aaa", "boom", "half")), 30, what="three loaded, ghost failed")
    broken = break_spawns(pool)
    try:
        os.kill(pool.workers("half")[1]["pid"], signal.SIGKILL)
        wait_for(lambda: pool.model("half")["state"] == "degraded", 20, what="half degraded")
    finally:
        mend_spawns(*broken)
    ui = open_page(pool)
    page = ui.page

    # failed, then degraded, then the rest in the pool's order
    names = page.locator("#models tbody tr")
    expect(names).to_have_count(4)
    expect(page.locator("#models tbody tr td.name")).to_have_text(["ghost", "half", "aaa", "boom"])
    # the tab: its title and a red dot for its icon
    expect(page).to_have_title("✖ 1 failed, 1 degraded · llm-pool")
    icon = page.locator("#favicon").get_attribute("href")
    assert icon.startswith("data:image/png;base64,"), icon
    assert page.evaluate(DOT_COLOUR, icon) == [0xc5, 0x30, 0x30]  # --bad

    # the errors chart: the clients' 4xx apart from the pool's 5xx
    wait_for(lambda: page.evaluate("state.samples.length") >= 2, 10, what="live samples")
    expect(page.locator("#now-errors")).to_have_text("4xx 0, 5xx 0")
    for model, content in (("nope", "x"), ("nope", "y"), ("boom", "boom"), ("aaa", "hi")):
        pool.http.post("/v1/chat/completions",
                       json={"model": model, "messages": [{"role": "user", "content": content}]})
    expect(page.locator("#now-errors")).to_have_text("4xx 2, 5xx 1", timeout=5000)
    wait_for(lambda: int(page.locator("#chart-errors").get_attribute("data-points") or 0) >= 2, 5,
             what="the errors chart drawn")
    chart = page.locator("#chart-errors")
    chart.hover(position={"x": chart.bounding_box()["width"] - 18, "y": 40})  # "now": the newest sample
    expect(page.locator("#chart-tip")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d: 4xx \d+, 5xx \d+$"))
    expect(page.locator("#activity tbody tr")).to_have_count(4)
    expect(page.locator('#workers tr[data-worker="ghost/0"]')).to_have_count(1)

    # an empty cell is empty: ghost never used, no memory, no pid; the 404s have no tokens, no times
    assert page.evaluate(EMPTY_WORDS) == []
    expect(model_row(page, "ghost").locator("td.last-used")).to_have_text("")
    expect(page.locator("#activity tbody tr").last.locator("td.tokens-out")).to_have_text("")  # the first 404

    # one time format: the events', the activity's, a last use's (on hover)
    times = page.locator("#events td.time, #activity td.time").all_text_contents()
    assert times and all(TIME.match(t) for t in times), times
    used = model_row(page, "aaa").locator("td.last-used")
    expect(used).to_have_attribute("title", TIME)
    ui.shot("failed-first")

    # healthy again: the tab's plain title and empty icon are back
    assert pool.http.post("/admin/models/ghost/unload").status_code == 200
    assert pool.http.post("/admin/models/half/restart").status_code == 200
    wait_for(lambda: pool.model("half")["state"] == "loaded", 30, what="half loaded again")
    expect(page).to_have_title("llm-pool", timeout=5000)
    assert page.locator("#favicon").get_attribute("href") == "data:,"
    assert ui.errors == []
