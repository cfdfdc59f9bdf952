"""The dashboard in a real headless Chromium against `sluice demo` run as a user runs it, in its
own process on free ports: every panel shows live, changing numbers and draws its charts,
nothing is logged to the console as an error, the switch changes the policy that
`/api/snapshot` reports and a second open page shows it, and the request log filters; with the
naive inline tokenizer, a burst from the page's button makes the loop stall and a stall row
opens its stack; and the page says so when Sluice goes away and reconnects by itself when it is
back. How the tests wait: tests/dashboard_page.py.

With SLUICE_UPDATE_SCREENSHOT=1 the screenshot is also written to static/dashboard.png (the
one the README shows); otherwise it only goes to pytest's temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard_page import (
    ROOT,
    Demo,
    ask,
    attribute_selector,
    launched_browser,
    open_page,
    until,
    wait_for,
)

PANELS = ("loop", "caches", "tokenize", "backends", "requests")


@pytest.fixture
def browser() -> Iterator[Any]:
    with launched_browser() as launched:
        yield launched


@pytest.fixture
def demo() -> Iterator[Demo]:
    running = Demo(0)
    yield running
    running.stop()


@pytest.fixture
def inline_demo() -> Iterator[Demo]:
    # The naive baseline, so that a burst stalls the loop: the default no longer does. (It
    # has no caches, so its Caches panel has no numbers that change.)
    running = Demo(0, "--tokenize-mode", "inline")
    yield running
    running.stop()


def panel_texts(page: Any) -> dict[str, str]:
    return {name: page.inner_text(f"#panel-{name}") for name in PANELS}


def test_a_live_dashboard_and_a_switch_seen_by_every_page(browser: Any, demo: Demo) -> None:
    problems: list[str] = []
    page = open_page(browser, demo.dashboard_url, problems)

    # Every panel: numbers that change while we watch, and charts drawn. A request of our
    # own moves a number in each (the requests, its tokenize path and cache, its backend);
    # the loop's lag moves by itself.
    before = panel_texts(page)
    request_id = f"browser-{uuid.uuid4().hex[:12]}"
    model = demo.snapshot()["models"][0]["name"]
    assert ask(demo.proxy_url, 0, model, request_id) == 200
    ours = f"#panel-requests table.requests tr{attribute_selector('data-id', request_id)}"
    wait_for(page, ours)
    until(page, lambda: [n for n, text in panel_texts(page).items() if text == before[n]])
    for name in PANELS:
        wait_for(page, f"#panel-{name} .plot canvas")
        assert any(ch.isdigit() for ch in page.inner_text(f"#panel-{name}")), name

    # The series: the feed sends each point once, the page keeps them, and holds what the
    # proxy holds (within the tick between the two reads).
    def series_apart() -> str | None:
        points = int(page.get_attribute("body", "data-series-points") or 0)
        held = len(demo.snapshot()["series"]["t"])
        return None if points >= 3 and abs(held - points) <= 1 else f"page {points}, {held}"

    until(page, series_apart)

    # The switch: the policy the API reports changes, and a second page shows it too. A page
    # shows a new value of its own only once Sluice has answered its write.
    toggle = page.locator("#saturation-switch")
    assert toggle.get_attribute("data-value") == "wait"
    other = open_page(browser, demo.dashboard_url, problems)
    assert other.locator("#saturation-switch").get_attribute("data-value") == "wait"
    toggle.click()
    wait_for(page, '#saturation-switch[data-value="bail-out"]')
    assert demo.snapshot()["preprocess"]["saturation"] == "bail-out"
    wait_for(other, '#saturation-switch[data-value="bail-out"]')
    other.locator("#saturation-switch").click()
    wait_for(other, '#saturation-switch[data-value="wait"]')
    assert demo.snapshot()["preprocess"]["saturation"] == "wait"
    wait_for(page, '#saturation-switch[data-value="wait"]')

    # The request log filters: by our request's id, ours alone.
    log = page.locator("#panel-requests")
    shown = log.locator("table.requests tbody tr:not([hidden])")
    log.locator("input.filter-text").fill("no-such-request-anywhere")
    assert shown.count() == 0
    log.locator("input.filter-text").fill(request_id)
    assert shown.count() == 1
    assert shown.get_attribute("data-id") == request_id
    log.locator("input.filter-text").fill("")
    counted = log.locator(".shown").inner_text()  # "N of M shown", as the filter ran
    assert re.fullmatch(r"(\d+) of \1 shown", counted), counted
    assert not problems, problems


def test_a_burst_from_the_page_stalls_the_inline_loop_and_a_stall_opens_its_stack(
    browser: Any, inline_demo: Demo, tmp_path: Path
) -> None:
    problems: list[str] = []
    page = open_page(browser, inline_demo.dashboard_url, problems)

    # A burst from the page's own button (demo only) stalls the inline loop: its prompts
    # (the demo's only completions; its steady traffic is chats) are each ~12k tokens, tens
    # of milliseconds of encoding on the loop. Once one is in the log, its stall is recorded.
    burst = page.locator("#burst-button")
    assert burst.is_visible()
    burst.click()
    wait_for(page, '#panel-requests table.requests tr[data-kind="completion"]')
    opened = open_newest_stall(page)
    frames = page.inner_text(opened)
    if inline_demo.snapshot()["loop"]["stacks"]:
        assert ".py:" in frames or "No stack" in frames, frames
    else:
        assert "Stacks are off" in frames

    screenshot = tmp_path / "dashboard.png"
    if os.environ.get("SLUICE_UPDATE_SCREENSHOT"):
        # For the README: a minute and a half of history, a second burst, its stack open.
        until(page, lambda: page.locator("#panel-requests table.requests tr").count() <= 150)
        newest_burst = '#panel-requests table.requests tr[data-kind="completion"]'
        first = page.get_attribute(newest_burst, "data-seq")
        burst.click()
        until(page, lambda: page.get_attribute(newest_burst, "data-seq") == first)
        open_newest_stall(page)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(screenshot), full_page=True)
    if os.environ.get("SLUICE_UPDATE_SCREENSHOT"):
        shutil.copy(screenshot, ROOT / "static" / "dashboard.png")
    assert not problems, problems


def open_newest_stall(page: Any) -> str:
    """Opens the newest stall row's stack (by its key: rows are redrawn as stalls come);
    the selector of its stack's text."""
    key = page.get_attribute("#panel-loop tr.stall-row", "data-key")
    row = f"#panel-loop tr.stall-row{attribute_selector('data-key', key)}"
    if page.get_attribute(row, "aria-expanded") != "true":
        page.click(row)
    wait_for(page, f'{row}[aria-expanded="true"]')
    stack = f"{row} + tr.stall-stack:not([hidden]) pre"
    wait_for(page, stack)
    return stack


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_the_page_says_when_sluice_is_gone_and_reconnects_when_it_is_back(browser: Any) -> None:
    port = free_port()
    first = Demo(port)
    try:
        page = open_page(browser, first.dashboard_url, [])
        # "reconnected" shows for a few seconds only: every state the page shows is kept
        # in an attribute of the document, so that none goes unseen on a busy machine.
        page.evaluate(KEEP_CONNECTION_STATES)
    finally:
        first.stop()
    # (It may say "no data for N s" first, also "lost", if the stop took long.)
    wait_for(page, '#connection[data-state="lost"]:has-text("reconnecting")')
    second = Demo(port)
    try:
        wait_for(page, "html[data-said-reconnected]")
        assert "reconnected" in page.get_attribute("html", "data-said-reconnected")
    finally:
        second.stop()


KEEP_CONNECTION_STATES = """() => {
  const status = document.querySelector('#connection');
  new MutationObserver(() => document.documentElement.setAttribute(
    'data-said-' + status.dataset.state, status.textContent))
    .observe(status, {attributes: true, childList: true, characterData: true, subtree: true});
}"""
