"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against
`sluice demo` run as a user runs it, in its own process on free ports: every panel shows live,
changing numbers and draws its charts, nothing is logged to the console as an error, the
switch changes the policy that `/api/snapshot` reports and a second open page shows it, and
the request log filters; with the naive inline tokenizer, a burst from the page's button makes
the loop stall and a stall row opens its stack; and the page says so when Sluice goes away and
reconnects by itself when it is back. In front of one simulated backend per engine metrics
style, each publishing KV events, the backends table shows each engine's name, every number
the snapshot has from it, and that each backend's index follows its events. In front of a
fleet of two models on three engines (`sluice serve --config fleet.toml`), the backends are
grouped by model under each pool's own row (health, engines' load, window), and the request
log filters by model.

Every wait is on the page's own signals, never on the clock: the connection's state, the
number of snapshots the page has rendered (`body[data-snapshot-seq]`), the request log's rows
(`tr[data-id]`, `tr[data-kind]`), the stall rows' keys, the switch's `data-value`. Something
that must happen is made to happen by the test (a request with an id of its own, a burst) and
waited for by what identifies it; whatever can only be seen over time is checked again at
each snapshot the page renders. Timeouts are outer bounds, minutes long, that only make a
broken test fail: on a loaded machine everything may be slow, nothing may be missed.

With SLUICE_UPDATE_SCREENSHOT=1 the screenshot is also written to static/dashboard.png (the
one the README shows); otherwise it only goes to pytest's temporary directory.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
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
PANELS = ("loop", "caches", "tokenize", "backends", "requests")
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


@pytest.fixture
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=WAIT_MS
        )
        yield launched
        launched.close()


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


# The backends table's columns filled from each backend's `engine` block in the snapshot.
ENGINE_COLUMNS = {
    "engine": "name",
    "running / waiting": "running",
    "KV cache": "kv_cache_usage",
    "prefix hits": "prefix_cache_hit_rate",
}
ENGINE_STYLES = ("vllm", "sglang", "llamacpp", "tgi")


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
