"""`python -m load report`: a scenario's reference JSON rendered as Markdown by the
scenario's own tables (its ratios computed from the JSON, under a line of provenance), and
`--write` replacing only the marked regions of a README, leaving every other byte alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from load import report
from load.stats import by_group

README = Path(__file__).resolve().parent.parent / "load" / "README.md"


def submit_blob(quick: bool = False) -> dict[str, Any]:
    """A small result of `bench submit`, as the harness writes it: two rounds per variant."""
    rows = [
        {"round": r, "variant": v, "errors": 0, "short_ttft_p50_ms": 10.0 * k,
         "short_ttft_p99_ms": 40.0 * k, "long_ttft_p50_ms": 50.0, "long_ttft_p99_ms": 90.0,
         "submit_wall_ms": 100.0 * k + r, "tokenize_p50_ms": 5.0}
        for r in (1, 2)
        for v, k in (("inline", 4), ("offload", 1))
    ]  # fmt: skip
    columns = ("short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
               "submit_wall_ms", "tokenize_p50_ms")  # fmt: skip
    return {
        "scenario": "submit",
        "reproduces": "seed 003",
        "date": "2026-01-02 03:04 UTC",
        "commit": "abc1234",
        "machine": {"cpus": 2, "load_average": 0.5, "python": "3.11", "platform": "Linux"},
        "quick": quick,
        "seconds": 12.3,
        "result": {"summary": by_group(rows, "variant", columns), "rounds": rows},
    }


def test_a_result_renders_as_markdown_with_its_provenance_and_ratios() -> None:
    text = report.render("submit", submit_blob(quick=True), link="reference/submit.json")
    first, *table = text.splitlines()
    assert first.startswith(
        "**2026-01-02 03:04 UTC**, commit abc1234, 2 CPUs, load average 0.5 at the end, 12 s, "
        "`--quick` ([JSON](reference/submit.json)). 32 unique ~4k-token"
    )
    # The headline ratios come from the JSON: 401.5 / 101.5 and 160 / 40.
    assert "submit wall inline / offload 3.96x, short TTFT p99 inline / offload 4.00x" in first
    assert table[0].startswith("| tokenize | short TTFT p50 | short p99 |")
    assert table[1] == "| " + " | ".join(["---"] * 8) + " |"
    assert table[2] == ("| inline | 40.0 | 160.0 | 50.0 | 90.0 | 401.5 (401.0-402.0) | 5.0 | 0 |")
    assert table[3].startswith("| offload | 10.0 | 40.0 |")
    assert len(table) == 4


def test_the_markers_choose_tables_and_leave_unknown_regions_alone() -> None:
    text = (
        "a\n<!-- report:x tables=2,3 -->\nold\n<!-- /report:x -->\n"
        "b\n<!-- report:y -->\nkept\n<!-- /report:y -->\nc\n"
    )
    asked: list[tuple[str, Any]] = []

    def render_one(name: str, tables: Any) -> str | None:
        asked.append((name, tables))
        return "new\n" if name == "x" else None

    assert report.fill(text, render_one) == (
        "a\n<!-- report:x tables=2,3 -->\nnew\n\n<!-- /report:x -->\n"
        "b\n<!-- report:y -->\nkept\n<!-- /report:y -->\nc\n"
    )
    assert asked == [("x", [2, 3]), ("y", None)]
    assert report.marked(text) == ["x", "y"]


def test_write_replaces_only_the_marked_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text())
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "submit.json").write_text(json.dumps(submit_blob()))
    monkeypatch.setattr(report, "READMES", (readme,))
    before = readme.read_text()
    args = argparse.Namespace(names=["submit"], write=True, reference=reference)

    report.main(args)

    after = readme.read_text()
    opening, closing = "<!-- report:submit -->\n", "<!-- /report:submit -->"
    head, _, rest = before.partition(opening)
    _, _, tail = rest.partition(closing)
    assert after.startswith(head + opening)  # every byte before the region
    assert after.endswith(closing + tail)  # and after it
    region = after[len(head + opening) : len(after) - len(closing + tail)]
    assert region == report.render("submit", submit_blob(), link="reference/submit.json") + "\n"
    assert "| inline | 40.0 | 160.0 |" in region
    assert f"{readme}: submit" in capsys.readouterr().out
    report.main(args)
    assert readme.read_text() == after  # a second run changes nothing


def test_every_readme_region_names_a_scenario_with_a_reference_result() -> None:
    text = README.read_text()
    names = report.marked(text)
    assert names and len(names) == len(set(names))
    for name in names:
        assert (report.REFERENCE / f"{name}.json").exists(), name
    assert len(text.splitlines()) <= 300
