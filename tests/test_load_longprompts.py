"""`python -m load bench longprompts` (load/bench/longprompts.py): every chat it sends is
unique from its first characters on, at about the size it claims (a 3,000-message
conversation too); the stall seconds Sluice exports by stage and cause are read back from
its /metrics text and differenced between two scrapes; its tables give Sluice's throughput
over direct's round by round and the pooled stall time per request by stage (under
`compare REV --bench longprompts` each version's, and each figure this/REV read off a recorded
result); and one round against a real `sluice serve` measures throughput, CPU, the loop
thread's CPU and /health."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from app.cli.rooms import RoomMetrics
from load import compare, harness
from load.bench import longprompts
from load.bench.longprompts import SHAPES, Shape, Target
from load.processes import Stack
from load.workloads import CHARS_PER_TOKEN, Corpus


def test_every_chat_is_unique_from_its_start_and_of_its_shape() -> None:
    rng, corpus = random.Random(0), Corpus.default()
    one_message, conversation = SHAPES[0], SHAPES[-1]
    chats = [json.loads(longprompts.body(one_message, rng, corpus)) for _ in range(20)]
    texts = [chat["messages"][0]["content"] for chat in chats]
    assert len({text[:14] for text in texts}) == len(texts)  # the nonce, first
    assert all(abs(len(t) / CHARS_PER_TOKEN - one_message.tokens) < 100 for t in texts)
    assert {chat["max_tokens"] for chat in chats} == {longprompts.ANSWER_TOKENS}

    chat = json.loads(longprompts.body(conversation, rng, corpus))
    assert len(chat["messages"]) == longprompts.CHAT_MESSAGES
    assert chat["messages"][0]["role"] == "system" and chat["messages"][-1]["role"] == "user"


def test_stall_seconds_by_stage_are_read_from_sluices_metrics_and_differenced() -> None:
    metrics = RoomMetrics.create()
    stages = metrics.loop.loop_stall_stage_seconds
    stages.labels("app.routing.block_index:chain_hashes", "blocking").observe(0.02)
    before = longprompts.stage_seconds(
        harness.parse_metrics(generate_latest(metrics.registry).decode())
    )
    stages.labels("app.routing.block_index:chain_hashes", "blocking").observe(0.03)
    stages.labels("(no stack)", "gil-wait").observe(0.015)
    after = longprompts.stage_seconds(
        harness.parse_metrics(generate_latest(metrics.registry).decode())
    )

    delta = longprompts.stage_delta(before, after)
    assert delta.keys() == {"blocking", "gil-wait"}
    assert math.isclose(delta["blocking"]["app.routing.block_index:chain_hashes"], 0.03)
    assert math.isclose(delta["gil-wait"]["(no stack)"], 0.015)


def round_row(variant: str, number: int, per_s: float, stalls: dict[str, Any]) -> dict[str, Any]:
    measured = variant == "sluice"
    return {
        "round": number, "variant": variant, "requests": 10, "errors": 0,
        "requests_per_s": per_s, "cpu_ms_per_request": 30.0 if measured else math.nan,
        "loop_ms_per_request": 3.0 if measured else math.nan, "health_p50_ms": 1.0,
        "health_p99_ms": 4.0, "health_max_ms": 9.0 + number, "stall_s": stalls,
        "prompt_tokens": 7900.0 if measured else math.nan,
    }  # fmt: skip


def test_tables_give_the_ratio_by_round_and_stalls_per_request_over_all_rounds() -> None:
    rows = [
        round_row("direct", 1, 4.0, {}),
        round_row("sluice", 1, 3.0, {"blocking": {"app.x:f": 0.05}}),
        round_row("sluice", 2, 4.0, {"blocking": {"app.x:f": 0.15}, "gil-wait": {"a": 0.02}}),
        round_row("direct", 2, 4.0, {}),
    ]
    result = {"rounds": 2, "clients": 8, "shapes": {"8k": longprompts.summarize(rows)}}

    main, stages = longprompts.tables(result)
    [row] = main.rows
    assert row[:2] == ["8k", "7,900"]
    assert row[4].value == 0.875  # the median of Sluice's 0.75 and 1.0 of direct's
    assert (row[7], row[10], row[11]) == (3.0 / 0.79, 11.0, "4.0 / 11.0")  # max: the worst
    assert row[12] == 11.0  # (50 + 150 + 20) ms over 20 requests
    assert stages.rows == [["app.x:f", 10.0], ["(gil-wait, any stage)", 1.0]]


def test_compared_versions_each_get_their_rows_and_stage_columns() -> None:
    rows = [
        round_row("direct", 1, 4.0, {}),
        round_row("sluice", 1, 3.0, {"blocking": {"app.x:f": 0.05}}),
        {**round_row("sluice", 1, 2.0, {}), "variant": "sluice@REV"},
    ]
    result = {"rounds": 1, "clients": 8, "shapes": {"8k": longprompts.summarize(rows)}}

    main, stages = longprompts.tables(result)
    assert [(row[0], row[4].value) for row in main.rows] == [
        ("8k (sluice)", 0.75), ("8k (sluice@REV)", 0.5)
    ]  # fmt: skip
    assert stages.headers == ["stage", "8k (sluice)", "8k (sluice@REV)"]
    assert stages.rows == [["app.x:f", 5.0, 0.0]]


def test_compare_reads_each_shapes_figures_off_a_recorded_result() -> None:
    """The reference result's Sluice rounds stand in for REV's, with twice the stalls."""
    path = Path(longprompts.__file__).parent.parent / "reference" / "longprompts.json"
    result = json.loads(path.read_text())["result"]
    for name, blob in result["shapes"].items():
        theirs = [
            {**r, "variant": "sluice@REV",
             "stall_s": {c: {s: 2 * v for s, v in st.items()} for c, st in r["stall_s"].items()}}
            for r in blob["rounds"] if r["variant"] == "sluice"
        ]  # fmt: skip
        result["shapes"][name] = longprompts.summarize(blob["rounds"] + theirs)

    rows = compare.FIGURES["longprompts"](result, "sluice", "sluice@REV")
    by_figure = {row[0]: row for row in rows}
    assert len(rows) == 7 * len(result["shapes"]) and all(len(row) == 5 for row in rows)
    per_s = by_figure["40k: requests/s"]
    assert per_s[1] == per_s[2] and per_s[3:] == ["1.000", "higher"]
    stalls = by_figure["8k: blocking stalls ms/request"]
    assert stalls[1] > 0 and stalls[3:] == ["0.500", "lower"]


async def test_one_round_measures_a_running_sluice() -> None:
    shape = Shape("1k", 1000, 1, 1)
    rng, corpus = random.Random(1), Corpus.default()
    async with Stack() as stack:
        sim = await stack.sim(*longprompts.WINDOW, instant=True)
        proxy = await stack.proxy(sim, *longprompts.WINDOW)
        await harness.wait_healthy(proxy)
        bodies = [longprompts.body(shape, rng, corpus) for _ in range(4)]
        row = await longprompts.one_round(Target(proxy, stack.pids[proxy]), bodies)

    assert (row["requests"], row["errors"]) == (4, 0)
    assert row["requests_per_s"] > 0
    assert row["cpu_ms_per_request"] > 0 and row["loop_ms_per_request"] >= 0
    assert 0 < row["health_p50_ms"] <= row["health_p99_ms"] <= row["health_max_ms"]
    assert 900 < row["prompt_tokens"] < 1100
