"""README.md as a newcomer reads it: its reference tables are what the code generates now
(`python -m app.cli.reference --write`), its hand-written part stays short, its links stay
inside the repository, and its map of `app/` lists the rooms in the layers' order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.cli import reference
from tests.test_house import LAYERS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_WRITTEN_LINES = 350
# Either generator's regions: this module's and `python -m load report`'s.
GENERATED = re.compile(
    r"<!-- (?P<tool>report|reference):(?P<name>[\w-]+)[^>]*-->\n.*?<!-- /(?P=tool):(?P=name) -->",
    re.DOTALL,
)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)|<(?P<auto>https?://[^>]+)>")


def test_the_readme_holds_what_the_code_generates_now() -> None:
    text = README.read_text()
    assert {m["name"] for m in reference.MARKER.finditer(text)} == set(reference.REFERENCES)
    generated = reference.fill(text, reference.generate())
    assert generated == text, "README.md is stale: run `python -m app.cli.reference --write`"


def test_fill_replaces_only_the_marked_regions_and_refuses_unknown_ones() -> None:
    text = "a\n<!-- reference:x -->\nold\n<!-- /reference:x -->\nb\n"
    assert reference.fill(text, {"x": "new"}) == (
        "a\n<!-- reference:x -->\nnew\n<!-- /reference:x -->\nb\n"
    )
    with pytest.raises(LookupError, match="'x'"):
        reference.fill(text, {"y": "new"})


def test_a_route_without_words_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    words = dict(reference.INFERENCE_WORDS)
    del words["chat"]
    monkeypatch.setattr(reference, "INFERENCE_WORDS", words)
    with pytest.raises(LookupError, match="chat"):
        reference.proxy_routes()


def test_every_metric_a_running_proxy_registers_is_in_the_table() -> None:
    rows = reference.metric_rows(reference.exported_registry())
    names = [name for name, *_ in rows]
    assert len(names) == len(set(names))
    assert {"sluice_requests_total", "sluice_worker_up", "sluice_trace_spans_total"} <= set(names)
    labels = {name: labels for name, _, labels, _ in rows}
    assert labels["sluice_requests_total"] == "model, code, endpoint"
    assert labels["sluice_kv_events_blocks_total"] == "backend, outcome"


def test_the_hand_written_part_is_short_and_links_stay_in_the_repository() -> None:
    text = README.read_text()
    written = GENERATED.sub("", text)
    assert len(written.splitlines()) <= MAX_WRITTEN_LINES
    for document in (README, ROOT / "app" / "README.md"):
        for link in LINK.finditer(GENERATED.sub("", document.read_text())):
            target = link["target"] or link["auto"]
            assert "://" not in target, f"{document.name}: {target}"
            path = (document.parent / target.partition("#")[0]).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{document.name}: {target}"


def test_the_layout_lists_the_rooms_in_the_layers_order() -> None:
    text = README.read_text()
    block = text.partition("## Layout")[2].partition("```\napp/\n")[2].partition("```")[0]
    rooms = re.findall(r"^  (\w+)(?:/|\.py)", block, re.MULTILINE)
    assert rooms == [room for room in LAYERS if room != "__main__"]
