"""The browser tier (see test_browser.py): one request's story in the page's request
detail, from a 502 row to the crash event and the replica's log lines; and the latency
charts (TTFT, duration, queue wait per model) drawn with data after some requests."""

from __future__ import annotations

import re

import os
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import IGNORE_EOS, llama, synthetic
from tests.pool import wait_for
from tests.test_browser import browser, open_page  # noqa: F401 (the browser tier's fixtures)

pytestmark = pytest.mark.browser


def test_a_502_rows_story_shows_the_crash_and_the_log_lines(browser, make_pool, open_page, llama_server_bin,  # noqa: F811
                                                             tiny_gguf):
    from playwright.sync_api import expect

    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    ui = open_page(pool)
    page = ui.page
    [runtime] = pool.workers("tiny")[0]["children"]
    asker = threading.Thread(target=lambda: httpx.post(
        pool.url + "/v1/chat/completions", timeout=120, headers={"x-request-id": "page-doomed"},
        json={"model": "tiny", "max_tokens": 100_000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}))
    asker.start()
    wait_for(lambda: pool.model("tiny")["runtime_inflight"] == 1, 60, what="the request reached llama-server")
    time.sleep(0.5)
    os.kill(runtime["pid"], signal.SIGKILL)
    asker.join(60)
    [row] = wait_for(lambda: pool.http.get("/admin/requests", params={"id": "page-doomed"}).json()["requests"], 10,
                     what="the 502 row")
    assert row["status"] == 502
    wait_for(lambda: [e for e in pool.http.get("/admin/events").json()["events"] if e["kind"] == "crashed"], 10,
             what="the crash event")
    shown = page.locator(f'#activity tbody tr[data-id="{row["id"]}"]')
    expect(shown.locator(".status")).to_have_text("502", timeout=5000)
    shown.click()
    detail = page.locator("#request-detail")
    expect(detail).to_contain_text("story of page-doomed", timeout=5000)
    expect(detail).to_contain_text("replica tiny/0")
    expect(detail).to_contain_text("crashed tiny/0: replica tiny/0 crashed: llama-server was killed by SIGKILL")
    expect(detail).to_contain_text("runtime died: llama-server was killed by SIGKILL")  # its log's line
    ui.shot("story")
    assert ui.errors == []


def test_the_latency_charts_are_drawn_with_each_models_figures(browser, make_pool, open_page):  # noqa: F811
    pool = make_pool([synthetic("quick", tps=200, ttft_ms=40, tokens=8)])
    ui = open_page(pool)
    page = ui.page
    for chart in ("ttft", "duration", "queued"):  # nothing finished yet: no points
        assert page.locator(f"#chart-{chart}").get_attribute("data-points") in (None, "0")
    for i in range(4):
        assert httpx.post(pool.url + "/v1/chat/completions", timeout=30, json={  # streamed: the TTFT chart's
            "model": "quick", "messages": [{"role": "user", "content": f"hi {i}"}], "stream": True}).status_code == 200
    for chart in ("ttft", "duration", "queued"):
        wait_for(lambda: int(page.locator(f"#chart-{chart}").get_attribute("data-points") or 0) >= 2, 10,
                 what=f"the {chart} chart drawn with samples")
    figures = wait_for(lambda: (s := pool.http.get("/admin/requests", params={"limit": 10}).json()["requests"])
                       and len(s) == 4 and s, 5, what="the rows")
    ttft = sorted(r["ttft_ms"] for r in figures)
    # the caption: p50 / p95 of the window's requests (nearest rank: the 2nd and the 4th of 4), each
    # within a millisecond of the row's figure (the page rounds its own unrounded figure: 94.5 -> 95)
    def caption_matches() -> bool:
        shown = re.search(r"quick (\d+) ms / (\d+) ms", page.locator("#now-ttft").inner_text())
        return bool(shown) and abs(int(shown[1]) - ttft[1]) <= 1 and abs(int(shown[2]) - ttft[3]) <= 1
    wait_for(caption_matches, 10, what=f"the caption's p50 / p95 near {ttft[1]} / {ttft[3]} ms")
    assert ui.errors == []
