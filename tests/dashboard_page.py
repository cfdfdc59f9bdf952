"""Sluice in its own process and its dashboard in a real headless Chromium (Debian's, driven by
Playwright), shared by the test_dashboard_browser*.py files; importing it skips a module when
Playwright or Chromium is missing (outside CI).

Every wait is on the page's own signals, never on the clock: the connection's state, the
number of snapshots the page has rendered (`body[data-snapshot-seq]`), the request log's rows
(`tr[data-id]`, `tr[data-kind]`), the stall rows' keys, the switch's `data-value`. Something
that must happen is made to happen by the test (a request with an id of its own, a burst) and
waited for by what identifies it; whatever can only be seen over time is checked again at
each snapshot the page renders (`until`). Timeouts are outer bounds, minutes long, that only
make a broken test fail: on a loaded machine everything may be slow, nothing may be missed.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from app.sim.settings import DEFAULT_MODEL

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
ROOT = Path(__file__).resolve().parents[1]
# Outer bounds only, to fail a broken test: nothing waits for them to pass.
WAIT_MS = 180_000  # any one wait for the page, or Playwright action
DEADLINE_S = 180.0  # a condition checked again at each snapshot or request; a start, a stop
HTTP_TIMEOUT_S = 60.0  # one HTTP exchange with Sluice

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
    pytest.skip(f"needs {CHROMIUM} (apt-get install -y chromium)", allow_module_level=True)


class Sluice:
    """`python -m app ARGUMENTS` in its own process; `urls` maps each line prefix asked for to
    the URL it printed on that line."""

    def __init__(self, arguments: list[str], *prefixes: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app", *arguments],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        assert self.process.stdout is not None
        stdout = self.process.stdout

        def read() -> None:
            for line in stdout:
                lines.put(line)
            lines.put("")  # it exited

        threading.Thread(target=read, daemon=True).start()
        self.urls: dict[str, str] = {}
        while len(self.urls) < len(prefixes):
            line = lines.get(timeout=DEADLINE_S)
            if not line:
                raise RuntimeError(f"{arguments} exited with {self.process.wait()}")
            for prefix in prefixes:
                if line.startswith(prefix):
                    self.urls[prefix] = line.split()[-1]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def fetch_snapshot(dashboard_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(dashboard_url + "/api/snapshot", timeout=HTTP_TIMEOUT_S) as answer:
        result: dict[str, Any] = json.load(answer)
        return result


class Demo(Sluice):
    """`sluice demo` as a user runs it."""

    def __init__(self, dashboard_port: int = 0, *flags: str) -> None:
        arguments = ["demo", "--port", "0", "--dashboard-port", str(dashboard_port), *flags]
        prefixes = ("Sluice proxy:", "Sluice dashboard:")
        super().__init__([*arguments, "--demo-burst-interval", "0"], *prefixes)
        self.proxy_url = self.urls["Sluice proxy:"]
        self.dashboard_url = self.urls["Sluice dashboard:"]

    def snapshot(self) -> dict[str, Any]:
        return fetch_snapshot(self.dashboard_url)


@contextmanager
def launched_browser() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright."""
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=WAIT_MS
        )
        yield launched
        launched.close()


def open_page(browser: Any, url: str, problems: list[str]) -> Any:
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(WAIT_MS)
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(url)
    # The page says "live" as it renders its first snapshot, in the same task.
    wait_for(page, '#connection[data-state="live"]')
    wait_for(page, "body[data-snapshot-seq]")
    return page


def wait_for(page: Any, selector: str) -> None:
    """Until `selector` matches. (The page's CSP forbids eval, so no wait_for_function.)"""
    page.wait_for_selector(selector, state="attached", timeout=WAIT_MS)


def until(page: Any, wrong: Callable[[], Any]) -> None:
    """`wrong()` (what is not yet as it should be) again each time the page has rendered a
    newer snapshot, until it finds nothing."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        seen = page.get_attribute("body", "data-snapshot-seq")
        found = wrong()
        if not found:
            return
        assert time.monotonic() < deadline, found
        wait_for(page, f'body:not([data-snapshot-seq="{seen}"])')


def attribute_selector(name: str, value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'[{name}="{escaped}"]'


def ask(
    proxy_url: str, question: int, model: str = DEFAULT_MODEL, request_id: str | None = None
) -> int:
    """A chat for `model` (with `request_id` as its x-request-id); the answer's status. The
    question first: each is a new prefix, placed by its hash on any of the backends."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": f"Question {question}. " + "Answer in haiku. " * 30},
            {"role": "user", "content": f"Question {question}?"},
        ],
        "max_tokens": 2,
    }
    headers = {"content-type": "application/json"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    request = urllib.request.Request(
        proxy_url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return int(refused.code)
