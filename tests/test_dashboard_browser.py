"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against
`sluice demo` run as a user runs it, in its own process on free ports: every panel shows live,
changing numbers and draws its charts, nothing is logged to the console as an error, a burst
from the page's button makes the loop stall and a stall row opens its stack, the switch
changes the policy that `/api/snapshot` reports and a second open page shows it, and the page
says so when Sluice goes away and reconnects by itself when it is back.

With SLUICE_UPDATE_SCREENSHOT=1 the screenshot is also written to static/dashboard.png (the
one the README shows); otherwise it only goes to pytest's temporary directory.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PANELS = ("loop", "caches", "tokenize", "backends", "requests")
ROOT = Path(__file__).resolve().parents[1]
WAIT_MS = 30_000

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
    pytest.skip(f"needs {CHROMIUM} (apt-get install -y chromium)", allow_module_level=True)


class Demo:
    """`sluice demo` in its own process; the URLs come from what it prints."""

    def __init__(self, dashboard_port: int = 0, *flags: str) -> None:
        command = [sys.executable, "-m", "app", "demo", "--port", "0", *flags]
        command += ["--dashboard-port", str(dashboard_port), "--demo-burst-interval", "0"]
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        lines: queue.Queue[str] = queue.Queue()
        assert self.process.stdout is not None
        stdout = self.process.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        self.dashboard_url = ""
        while not self.dashboard_url:
            line = lines.get(timeout=60)
            if line.startswith("Sluice dashboard:"):
                self.dashboard_url = line.split()[-1]

    def snapshot(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.dashboard_url + "/api/snapshot", timeout=10) as answer:
            result: dict[str, Any] = json.load(answer)
            return result

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def demo() -> Iterator[Demo]:
    # The naive baseline, so that a burst stalls the loop: the default no longer does.
    running = Demo(0, "--tokenize-mode", "inline")
    yield running
    running.stop()


def open_page(browser: Any, url: str, problems: list[str]) -> Any:
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(url)
    wait_for(page, '#connection[data-state="live"]')
    return page


def wait_for(page: Any, selector: str) -> None:
    """Until `selector` matches. (The page's CSP forbids eval, so no wait_for_function.)"""
    page.wait_for_selector(selector, state="attached", timeout=WAIT_MS)


def poll(page: Any, script: str, arg: Any = None, timeout_ms: int = WAIT_MS) -> None:
    """Until `script` (a function of `arg`, run by evaluate) is true; the page ticks once a
    second, so check four times a second."""
    for _ in range(timeout_ms // 250):
        if page.evaluate(script, arg):
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"never true: {script}")


def test_a_live_dashboard_a_stall_stack_and_a_switch_seen_by_every_page(
    browser: Any, demo: Demo, tmp_path: Path
) -> None:
    problems: list[str] = []
    page = open_page(browser, demo.dashboard_url, problems)

    # Every panel: numbers that change while we watch, and charts drawn.
    page.evaluate(
        "names => { window.before = Object.fromEntries(names.map("
        "n => [n, document.querySelector('#panel-' + n).innerText])); }",
        list(PANELS),
    )
    poll(
        page,
        "names => names.every(n => document.querySelector('#panel-' + n).innerText"
        " !== window.before[n])",
        list(PANELS),
    )
    for name in PANELS:
        panel = page.locator(f"#panel-{name}")
        assert panel.locator(".plot canvas").count() >= 1, name
        assert any(ch.isdigit() for ch in panel.inner_text()), name

    # A burst from the page's own button (demo only) stalls the inline loop; a stall opens
    # its stack.
    burst = page.locator("#burst-button")
    assert burst.is_visible()
    burst.click()
    first_stall = page.locator("#panel-loop tr.stall-row").first
    first_stall.wait_for(timeout=WAIT_MS)
    first_stall.click()
    stack = page.locator("#panel-loop tr.stall-stack:not([hidden]) pre").first
    stack.wait_for(timeout=WAIT_MS)
    assert first_stall.get_attribute("aria-expanded") == "true"
    frames = stack.inner_text()
    if demo.snapshot()["loop"]["stacks"]:
        assert ".py:" in frames or "No stack" in frames, frames
    else:
        assert "Stacks are off" in frames

    # The switch: the policy the API reports changes, and a second page shows it too.
    toggle = page.locator("#saturation-switch")
    assert toggle.get_attribute("data-value") == "wait"
    other = open_page(browser, demo.dashboard_url, problems)
    assert other.locator("#saturation-switch").get_attribute("data-value") == "wait"
    toggle.click()
    wait_for(page, '#saturation-switch[data-value="bail-out"]')
    assert demo.snapshot()["preprocess"]["saturation"] == "bail-out"
    wait_for(other, '#saturation-switch[data-value="bail-out"]')
    other.locator("#saturation-switch").click()
    wait_for(page, '#saturation-switch[data-value="wait"]')
    assert demo.snapshot()["preprocess"]["saturation"] == "wait"

    # The request log filters.
    log = page.locator("#panel-requests")
    log.locator("input.filter-text").fill("no-such-request-anywhere")
    assert log.locator("table.requests tbody tr:not([hidden])").count() == 0
    log.locator("input.filter-text").fill("")
    assert log.locator("table.requests tbody tr:not([hidden])").count() > 0

    screenshot = tmp_path / "dashboard.png"
    if os.environ.get("SLUICE_UPDATE_SCREENSHOT"):
        # For the README: a minute and a half of history, a second burst, its stack open.
        script = "() => document.querySelectorAll('#panel-requests table.requests tr').length > 150"
        poll(page, script, timeout_ms=180_000)
        burst.click()
        newest = page.locator("#panel-loop tr.stall-row").first
        newest.wait_for(timeout=WAIT_MS)
        if newest.get_attribute("aria-expanded") != "true":
            newest.click()
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(screenshot), full_page=True)
    if os.environ.get("SLUICE_UPDATE_SCREENSHOT"):
        shutil.copy(screenshot, ROOT / "static" / "dashboard.png")
    assert not problems, problems


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
    finally:
        first.stop()
    wait_for(page, '#connection[data-state="lost"]')
    assert "reconnecting" in page.inner_text("#connection")
    second = Demo(port)
    try:
        wait_for(page, '#connection[data-state="reconnected"]')
        assert "reconnected" in page.inner_text("#connection")
    finally:
        second.stop()
