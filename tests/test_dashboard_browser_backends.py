"""The dashboard's backends table in a real headless Chromium, against `sluice serve` in its own
process. In front of one simulated backend per engine metrics style, each publishing KV events,
the table shows each engine's name, every number the snapshot has from it, each engine's room
and its basis, and that each backend's index follows its events. In front of a fleet of two
models on three engines (`sluice serve --config fleet.toml`), the backends are grouped by model
under each pool's own row (health, engines' load, window), and the request log filters by
model. How the tests wait: tests/dashboard_page.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard_page import (
    DEADLINE_S,
    ROOT,
    Sluice,
    ask,
    fetch_snapshot,
    launched_browser,
    open_page,
    until,
    wait_for,
)


@pytest.fixture
def browser() -> Iterator[Any]:
    with launched_browser() as launched:
        yield launched


# The backends table's columns filled from each backend's `engine` block in the snapshot.
ENGINE_COLUMNS = {
    "engine": "name",
    "running / waiting": "running",
    "KV cache": "kv_cache_usage",
    "prefix hits": "prefix_cache_hit_rate",
}
ENGINE_STYLES = ("vllm", "sglang", "llamacpp", "tgi")


def engine_numbers_known(snapshot: dict[str, Any]) -> bool:
    """Every engine named, and every number its style reports known (a vLLM hit rate needs
    prompts between two scrapes)."""
    engines = {b["engine"]["name"]: b["engine"] for b in snapshot["backends"] if b.get("engine")}
    if set(engines) != set(ENGINE_STYLES):
        return False
    reported = [engines[name]["kv_cache_usage"] for name in ("vllm", "sglang", "llamacpp")]
    reported += [engines[name]["prefix_cache_hit_rate"] for name in ("vllm", "sglang")]
    return all(value is not None for value in reported)


def events_flowing(snapshot: dict[str, Any]) -> bool:
    return all((b["kv_events"] or {}).get("source") == "events" for b in snapshot["backends"])


def rooms_stated(snapshot: dict[str, Any]) -> bool:
    """The engines that state their limit (SGLang, llama.cpp) have it as their room."""
    bases = {(b["engine"] or {}).get("name"): b["room"]["basis"] for b in snapshot["backends"]}
    return bases.get("sglang") == bases.get("llamacpp") == "stated"


def engine_cells_mismatched(page: Any, snapshot: dict[str, Any]) -> list[str]:
    """Cells that show "—" where the snapshot has a number, or a number where it has none,
    KV index cells that do not say the backend's index follows its events, room cells that
    do not show the engine's room as judged and its basis, and time held while it had room
    other than none."""
    table = page.evaluate(
        "() => ({"
        " heads: [...document.querySelectorAll('#panel-backends table.backends th')]"
        ".map(th => th.textContent),"
        " rows: [...document.querySelectorAll('#panel-backends table.backends tr[data-backend]')]"
        ".map(tr => [tr.dataset.backend, [...tr.cells].map(td => td.textContent)])})"
    )
    engines = {b["url"]: b["engine"] or {} for b in snapshot["backends"]}
    rooms = {b["url"]: b["room"] for b in snapshot["backends"]}
    mismatched = []
    for url, cells in table["rows"]:
        for head, field in ENGINE_COLUMNS.items():
            cell = cells[table["heads"].index(head)]
            known = engines[url].get(field) is not None
            if known == ("—" in cell) or (field == "name" and cell != engines[url]["name"]):
                mismatched.append(f"{url} {head}: {cell!r}, snapshot {engines[url]}")
        kv_index = cells[table["heads"].index("KV index")]
        if not kv_index.startswith("events"):
            mismatched.append(f"{url} KV index: {kv_index!r}")
        room = rooms[url]
        shown = f"{'∞' if room['room'] is None else room['room']} {room['basis']}"
        if not cells[table["heads"].index("room")].startswith(shown):
            mismatched.append(f"{url} room: {cells[table['heads'].index('room')]!r} not {shown}")
        if cells[table["heads"].index("held with room")] != "0.0 ms":
            mismatched.append(
                f"{url} held with room: {cells[table['heads'].index('held with room')]!r}"
            )
    return mismatched or ([] if table["rows"] else ["no rows"])


def test_the_backends_table_shows_what_each_engine_reports(browser: Any) -> None:
    started: list[Sluice] = []
    try:
        for style in ENGINE_STYLES:
            arguments = ["sim-backend", "--port", "0", "--metrics-style", style]
            events = ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
            started.append(Sluice([*arguments, *events], "Simulated backend:", "KV events:"))
        backends = []
        for sim in started:
            url = sim.urls["Simulated backend:"]
            backends += [f"--backend={url}", f"--kv-events={url}={sim.urls['KV events:']}"]
        arguments = ["serve", "--port", "0", "--dashboard-port", "0"]
        sluice = Sluice([*arguments, *backends], "Sluice proxy:", "Sluice dashboard:")
        started.append(sluice)
        proxy_url, dashboard_url = sluice.urls["Sluice proxy:"], sluice.urls["Sluice dashboard:"]

        # Prompts for every backend, over several scrapes, until each engine's numbers are in
        # and each backend's events flow.
        deadline = time.monotonic() + DEADLINE_S
        question = 0

        def all_known() -> bool:
            snapshot = fetch_snapshot(dashboard_url)
            known = engine_numbers_known(snapshot) and events_flowing(snapshot)
            return known and rooms_stated(snapshot)

        while not all_known():
            assert time.monotonic() < deadline, fetch_snapshot(dashboard_url)["backends"]
            assert ask(proxy_url, question) == 200
            question += 1

        page = open_page(browser, dashboard_url, [])
        until(page, lambda: engine_cells_mismatched(page, fetch_snapshot(dashboard_url)))
    finally:
        for process in started:
            process.stop()


# --- a fleet of two models in front of three engines --------------------------------------------

FLEET = """
[[models]]
name = "big"
backends = ["{vllm}", "{sglang}"]
aliases = ["chat-default"]

[[models]]
name = "small"
backends = ["{llamacpp}"]
tokenizer = "words/tokenizer.json"
max_model_len = 2000
"""

# Each pool stat on the page and what stands behind it in the snapshot's model row.
POOL_FIELDS = {
    "engines": lambda m: m["pool"]["engines"] or None,
    "queue": lambda m: m["pool"]["engine_running"],
    "kv": lambda m: m["pool"]["engine_kv_cache_usage"],
    "prefix": lambda m: m["pool"]["engine_prefix_cache_hit_rate"],
    "window": lambda m: m["max_model_len"],
}


def pools_known(snapshot: dict[str, Any]) -> bool:
    pools = {m["name"]: m["pool"] for m in snapshot.get("models", [])}
    if set(pools) != {"big", "small"}:
        return False
    return (
        pools["big"]["engines"] == ["sglang", "vllm"]
        and pools["big"]["engine_prefix_cache_hit_rate"] is not None
        and pools["small"]["engine_kv_cache_usage"] is not None
    )


def pool_cells_mismatched(page: Any, snapshot: dict[str, Any]) -> list[str]:
    shown = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll("
        "'#panel-backends tr.pool[data-model]')].map(tr => [tr.dataset.model,"
        " Object.fromEntries([...tr.querySelectorAll('[data-field]')].map("
        "s => [s.dataset.field, s.lastChild.textContent]))]))"
    )
    mismatched = []
    for model in snapshot["models"]:
        cells = shown.get(model["name"])
        if cells is None:
            mismatched.append(f"no pool row for {model['name']}")
            continue
        for field, known in POOL_FIELDS.items():
            if (known(model) is not None) == ("—" in cells[field]):
                mismatched.append(f"{model['name']} {field}: {cells[field]!r}")
    return mismatched


def test_a_fleet_groups_its_backends_by_model_and_filters_its_log_by_model(
    browser: Any, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fakes import write_word_tokenizer

    write_word_tokenizer(tmp_path / "words", ["Question", "Answer", "in", "haiku."])
    started: list[Sluice] = []
    try:
        sims = {}
        for style, model in (("vllm", "big"), ("sglang", "big"), ("llamacpp", "small")):
            arguments = ["sim-backend", "--port", "0", "--model", model, "--metrics-style", style]
            started.append(Sluice(arguments, "Simulated backend:"))
            sims[style] = started[-1].urls["Simulated backend:"]
        config = tmp_path / "fleet.toml"
        config.write_text(FLEET.format(**sims))
        arguments = ["serve", "--port", "0", "--dashboard-port", "0", "--config", str(config)]
        sluice = Sluice(arguments, "Sluice proxy:", "Sluice dashboard:")
        started.append(sluice)
        proxy_url, dashboard_url = sluice.urls["Sluice proxy:"], sluice.urls["Sluice dashboard:"]

        # Prompts for both models (one by its alias), over several scrapes, until every
        # engine's numbers are in.
        deadline = time.monotonic() + DEADLINE_S
        question = 0
        while question < 3 or not pools_known(fetch_snapshot(dashboard_url)):
            assert time.monotonic() < deadline, fetch_snapshot(dashboard_url)["models"]
            for model in ("big", "small", "chat-default"):
                assert ask(proxy_url, question, model) == 200
            question += 1
        assert ask(proxy_url, 0, "no-such-model") == 404

        page = open_page(browser, dashboard_url, [])
        until(page, lambda: pool_cells_mismatched(page, fetch_snapshot(dashboard_url)))
        panel = page.locator("#panel-backends")
        assert (
            panel.locator('tr.pool[data-model="big"] [data-field="health"]')
            .inner_text()
            .endswith("2/2 up")
        )
        assert panel.locator('tr[data-backend][data-model="big"]').count() == 2
        assert panel.locator('tr[data-backend][data-model="small"]').count() == 1
        assert "chat-default" in panel.locator('tr.pool[data-model="big"]').inner_text()

        log = page.locator("#panel-requests")
        rows = "#panel-requests table.requests tbody tr"
        for model in ("small", "big"):
            log.locator("select.filter-model").select_option(model)
            visible = page.evaluate(
                f"() => [...document.querySelectorAll('{rows}:not([hidden])')]"
                ".map(tr => tr.cells[1].textContent)"
            )
            assert visible and set(visible) == {model}, visible
        log.locator("select.filter-model").select_option("all")
        wait_for(page, '#panel-requests .u-legend:has-text("small")')
    finally:
        for process in started:
            process.stop()
