"""A model's saturation on the dashboard in a real headless Chromium, against `sluice serve`
and a simulated engine of one sequence in their own processes: while requests are held for
it, the pool row's "saturation" reads 1 and more (its engine full, held requests over its
room of one), marked down, with its parts in the tooltip; once they are answered, 0.00.
How the tests wait: tests/dashboard_page.py.
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
    fetch_snapshot,
    launched_browser,
    open_page,
    until,
)

FIELD = '.pool-stat[data-field="pool-saturation"]'


@pytest.fixture
def browser() -> Iterator[Any]:
    with launched_browser() as launched:
        yield launched


def chat(proxy_url: str, tokens: int, statuses: list[int]) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": tokens}
    request = urllib.request.Request(
        proxy_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
        statuses.append(answer.status)


def held(dashboard_url: str) -> int:
    models = fetch_snapshot(dashboard_url)["admission"]["models"]
    return sum(int(model["held"]) for model in models.values())


def test_the_pool_row_shows_saturation_rise_with_held_requests_and_fall(browser: Any) -> None:
    started: list[Sluice] = []
    threads: list[threading.Thread] = []
    try:
        engine = Sluice(
            ["sim-backend", "--port", "0", "--max-num-seqs", "1", "--metrics-style", "sglang",
             "--inter-token-latency", "0.02"],
            "Simulated backend:",
        )  # fmt: skip
        started.append(engine)
        arguments = ["serve", "--port", "0", "--dashboard-port", "0", "--admission-timeout", "60"]
        sluice = Sluice(
            [*arguments, "--backend", engine.urls["Simulated backend:"]],
            "Sluice proxy:",
            "Sluice dashboard:",
        )
        started.append(sluice)
        proxy_url, dashboard_url = sluice.urls["Sluice proxy:"], sluice.urls["Sluice dashboard:"]
        problems: list[str] = []
        page = open_page(browser, dashboard_url, problems)
        statuses: list[int] = []
        chat(proxy_url, 1, statuses)  # the engine's first report: its room is stated
        for tokens in (150, 2, 2, 2, 2):  # ~3 s on the one sequence, and four behind it
            threads.append(threading.Thread(target=chat, args=(proxy_url, tokens, statuses)))
            threads[-1].start()
        until(page, lambda: None if held(dashboard_url) >= 2 else "fewer than 2 held")

        def saturated() -> str | None:
            field = page.locator(FIELD).first
            text = field.inner_text().replace("saturation", "").strip()
            if "down" not in (field.get_attribute("class") or "") or float(text) < 1.0:
                return f"not saturated: {text!r}"
            return None

        until(page, saturated)
        tooltip = page.locator(FIELD).first.get_attribute("title") or ""
        assert "of the engines saturated" in tooltip and "room of 1" in tooltip
        for thread in threads:
            thread.join(HTTP_TIMEOUT_S)
        assert statuses == [200] * 6
        until(page, lambda: None if "0.00" in page.locator(FIELD).first.inner_text() else "busy")
        assert problems == []
    finally:
        for process in started:
            process.stop()
