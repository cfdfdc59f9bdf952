"""A disaggregated model on the dashboard, in a real headless Chromium, against `sluice serve`
with `--prefill`, `--decode` and `--backend` simulated engines in their own processes.

The simulated engines here have role `both` (they ignore the transfer fields), which is enough
for what the page shows: with SGLang's flow both legs are sent at once and answered, so a long
prompt takes two hops and a short one is served whole by the `both` engine (`short`); with
vLLM's flow the prefill's answer names no transfer, so every request takes one hop (`no
transfer`). The page must show, under the model's pool, a row per role's pool and the
requests by how they were served, each backend's role (and the SGLang prefill's bootstrap
port), and in the request log each request's way, with its prefill engine and time when it
took two hops. How the tests wait: tests/dashboard_page.py.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from app.sim.settings import DEFAULT_MODEL
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

BOOTSTRAP_PORT = 9123
THRESHOLD = 64  # --disaggregate-above: a long prompt is far over it, a short one far under


@pytest.fixture
def browser() -> Iterator[Any]:
    with launched_browser() as launched:
        yield launched


@contextmanager
def disaggregated_fleet(flow: str) -> Iterator[Sluice]:
    """A prefill, a decode and a `both` simulated engine behind `sluice serve`."""
    started: list[Sluice] = []
    try:
        urls = []
        for _ in range(3):
            started.append(Sluice(["sim-backend", "--port", "0"], "Simulated backend:"))
            urls.append(started[-1].urls["Simulated backend:"])
        prefill, decode, both = urls
        if flow == "sglang":
            prefill += f"={BOOTSTRAP_PORT}"
        roles = [f"--prefill={prefill}", f"--decode={decode}", f"--backend={both}"]
        pd = ["--pd-protocol", flow, "--disaggregate-above", str(THRESHOLD)]
        arguments = ["serve", "--port", "0", "--dashboard-port", "0", *roles, *pd]
        started.append(Sluice(arguments, "Sluice proxy:", "Sluice dashboard:"))
        yield started[-1]
    finally:
        for process in started:
            process.stop()


@contextmanager
def fleet_page(browser: Any, flow: str) -> Iterator[tuple[str, str, Any]]:
    """The fleet, and its dashboard open once every role's engine shows up; the page logged
    no error by the end."""
    with disaggregated_fleet(flow) as sluice:
        proxy_url, dashboard_url = sluice.urls["Sluice proxy:"], sluice.urls["Sluice dashboard:"]
        problems: list[str] = []
        page = open_page(browser, dashboard_url, problems)
        pools_up(page)
        yield proxy_url, dashboard_url, page
        assert problems == []


def chat(proxy_url: str, question: int, words: int, request_id: str) -> dict[str, str]:
    """A chat of `words` words, new from its first (each question its own prefix); the
    answer's headers."""
    text = f"Question {question}. " + "Tell me about the river. " * (words // 5)
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": text}]}
    headers = {"content-type": "application/json", "x-request-id": request_id}
    request = urllib.request.Request(
        proxy_url + "/v1/chat/completions",
        data=json.dumps({**body, "max_tokens": 2}).encode(),
        headers=headers,
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
        assert answer.status == 200
        return {name.lower(): value for name, value in answer.headers.items()}


def pd_rows(page: Any) -> dict[str, dict[str, str]]:
    """The disaggregation rows under the model's pool: by role ("ways" for the requests'
    row), each stat's text by its field."""
    found: dict[str, dict[str, str]] = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('#panel-backends tr.pd')]"
        ".map(tr => [tr.dataset.role || 'ways', Object.fromEntries([...tr.querySelectorAll("
        "'[data-field]')].map(s => [s.dataset.field, s.lastChild.textContent]))]))"
    )
    return found


def role_tags(page: Any) -> dict[str, str]:
    """Each backend row's role tag, by the backend's URL."""
    found: dict[str, str] = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll("
        "'#panel-backends tr[data-backend]')].map(tr => [tr.dataset.backend,"
        " tr.querySelector('.role-tag')?.textContent ?? '']))"
    )
    return found


def pools_up(page: Any) -> None:
    """Until the page shows every role's engine up (its first health check passed)."""

    def down() -> Any:
        rows = pd_rows(page)
        roles = {"prefill", "decode", "both"}
        return [] if all(rows.get(r, {}).get("health") == "1/1 up" for r in roles) else rows

    until(page, down)


def shows(page: Any, field: str, text: str) -> None:
    """Until the requests' row shows `text` for `field` (the counters are read at each
    snapshot)."""
    until(page, lambda: [] if pd_rows(page).get("ways", {}).get(field) == text else pd_rows(page))


def legs_line(page: Any, request_id: str) -> str:
    row = "#panel-requests tr" + attribute_selector("data-id", request_id)
    wait_for(page, row)
    return str(page.locator(row + " .legs").inner_text())


def test_sglang_flow_shows_both_pools_two_hops_and_each_requests_legs(browser: Any) -> None:
    with fleet_page(browser, "sglang") as (proxy_url, dashboard_url, page):
        long = chat(proxy_url, 1, 400, "pd-long")
        assert long["x-sluice-pd"] == "disaggregated"
        short = chat(proxy_url, 2, 5, "pd-short")
        assert short["x-sluice-pd"] == "aggregated (short)"
        chat(proxy_url, 3, 400, "pd-long-2")
        backends = {b["role"]: b["url"] for b in fetch_snapshot(dashboard_url)["backends"]}

        shows(page, "two-hops", "2 (67 %)")
        assert set(pd_rows(page)) == {"prefill", "decode", "both", "ways"}
        ways = pd_rows(page)["ways"]
        assert ways["one-hop"] == "short 1"
        assert ways["leg-failures"] == "prefill 0 · decode 0"
        assert "—" not in ways["prefill-time"]  # the log's two prefill legs
        assert role_tags(page) == {
            backends["prefill"]: f"prefill · bootstrap {BOOTSTRAP_PORT}",
            backends["decode"]: "decode",
            backends["both"]: "both",
        }

        two_hops = legs_line(page, "pd-long")
        assert two_hops.startswith(f"disaggregated · prefill {backends['prefill']} · ")
        assert not two_hops.endswith("—")  # its prefill leg's time
        assert long["x-sluice-backend"] == backends["decode"]
        row = "#panel-requests tr" + attribute_selector("data-id", "pd-long")
        assert page.locator(row).inner_text().count(backends["decode"]) == 1
        assert legs_line(page, "pd-short") == "aggregated (short)"
        # The request log's filter finds a request by its way.
        page.locator("#panel-requests input.filter-text").fill("disaggregated")
        shown = page.evaluate(
            "() => [...document.querySelectorAll("
            "'#panel-requests table.requests tbody tr:not([hidden])')]"
            ".map(tr => tr.dataset.id).sort()"
        )
        assert shown == ["pd-long", "pd-long-2"]


def test_vllm_flow_without_a_transfer_counts_one_hop_no_transfer(browser: Any) -> None:
    with fleet_page(browser, "vllm") as (proxy_url, dashboard_url, page):
        answered = chat(proxy_url, 1, 400, "pd-untransferred")
        assert answered["x-sluice-pd"] == "aggregated (no transfer)"
        backends = {b["role"]: b["url"] for b in fetch_snapshot(dashboard_url)["backends"]}

        shows(page, "one-hop", "no transfer 1")
        ways = pd_rows(page)["ways"]
        assert ways["two-hops"] == "0 (0 %)"
        assert ways["prefill-time"] == "— / —"
        # vLLM's flow: no bootstrap port to show.
        assert role_tags(page)[backends["prefill"]] == "prefill"
        assert legs_line(page, "pd-untransferred") == "aggregated (no transfer)"
