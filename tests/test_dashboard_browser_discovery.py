"""Where each backend came from, and a backend draining, on the dashboard in a real headless
Chromium, against `sluice serve` and simulated engines in their own processes. A backend the
admin API added is tagged with its source (and when it joined, in the tooltip); removed
while a slow stream runs on it, its row says "draining" with the requests it still has, and
leaves the table once that stream ended whole. How the tests wait: tests/dashboard_page.py.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard_page import (
    HTTP_TIMEOUT_S,
    Sluice,
    attribute_selector,
    fetch_snapshot,
    launched_browser,
    open_page,
    until,
    wait_for,
)

TOKEN = "drain-test"
SLOW_MODEL = "slow-model"  # served by the slow engine only: the stream goes there


@pytest.fixture
def browser() -> Iterator[Any]:
    with launched_browser() as launched:
        yield launched


def admin(method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def slow_stream(proxy_url: str, lines: list[str]) -> None:
    """A slow streamed chat; its data lines, or the error it met, in `lines`."""
    try:
        _slow_stream(proxy_url, lines)
    except Exception as exc:  # the thread's failure is the test's: shown by the assert
        lines.append(f"failed: {exc!r}")


def _slow_stream(proxy_url: str, lines: list[str]) -> None:
    body = {
        "model": SLOW_MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 60,
        "stream": True,
    }
    request = urllib.request.Request(
        proxy_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
        lines.extend(line.decode().strip() for line in answer if line.startswith(b"data:"))


def in_flight(dashboard_url: str, url: str) -> int:
    rows = fetch_snapshot(dashboard_url)["backends"]
    return sum(int(row["inflight"]) for row in rows if row["url"] == url)


def test_an_added_backend_is_tagged_and_a_removed_one_drains_on_the_page(browser: Any) -> None:
    started: list[Sluice] = []
    try:
        static = Sluice(["sim-backend", "--port", "0"], "Simulated backend:")
        started.append(static)
        slow = Sluice(
            ["sim-backend", "--port", "0", "--model", SLOW_MODEL, "--inter-token-latency", "0.05"],
            "Simulated backend:",
        )
        started.append(slow)
        static_url, slow_url = (s.urls["Simulated backend:"] for s in (static, slow))
        arguments = ["serve", "--port", "0", "--dashboard-port", "0", "--backend", static_url]
        sluice = Sluice([*arguments, "--admin-token", TOKEN], "Sluice proxy:", "Sluice dashboard:")
        started.append(sluice)
        proxy_url, dashboard_url = sluice.urls["Sluice proxy:"], sluice.urls["Sluice dashboard:"]
        problems: list[str] = []
        page = open_page(browser, dashboard_url, problems)

        added = admin("POST", dashboard_url + "/api/backends", {"url": slow_url})["backend"]
        row = f"tr{attribute_selector('data-backend', slow_url)}"
        wait_for(page, f'{row} .source-tag[data-source="api"]')
        assert "joined" in page.locator(f"{row} .source-tag").first.get_attribute("title")
        assert (
            page.locator(f"tr{attribute_selector('data-backend', static_url)} .source-tag").count()
            == 0
        )

        lines: list[str] = []
        streaming = threading.Thread(target=slow_stream, args=(proxy_url, lines))
        streaming.start()
        until(page, lambda: None if in_flight(dashboard_url, slow_url) else f"no stream: {lines}")
        admin("DELETE", f"{dashboard_url}/api/backends/{added['id']}")
        wait_for(page, f'{row}[data-draining="1"]')
        assert "draining (1 in flight)" in page.locator(row).first.inner_text()
        streaming.join(HTTP_TIMEOUT_S)
        assert lines[-1] == "data: [DONE]"
        until(page, lambda: "still shown" if page.locator(row).count() else None)
        assert problems == []
    finally:
        for process in started:
            process.stop()
