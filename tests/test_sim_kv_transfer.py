"""The pure part of the simulator's prefill/decode disaggregation: the table of KV a prefill
engine holds (taken, refused, expired, bounded), what a request asks of an engine by its role
and flow, the scheduler's prefilled sequences, and, on the engine under an autojump clock,
the DistServe effect: decodes beside long prefills stall on an engine that does both and not
on a decode engine given the prompts' KV; and the sim-backend's flags for all this.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
import trio.testing

from app.cli.command import ConfigExit, parse
from app.sim.engine import SimEngine
from app.sim.kv_cache import KVAllocation
from app.sim.kv_transfer import (
    Aggregated,
    Bootstrap,
    HoldForDecode,
    PdCounters,
    Recompute,
    RemotePrefill,
    TransferTable,
    answer_params,
    bootstrap_fields,
    plan_leg,
)
from app.sim.scheduler import SeqState, StepScheduler
from app.sim.settings import SimSettings
from tests.conftest import FAST_SIM
from tests.sims import KV_TRANSFER_ASK

PREFILL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "sim-1",
    "remote_block_ids": [3, 4],
    "remote_host": "127.0.0.1",
    "remote_port": 9000,
    "tp_size": 1,
}

BAD_PORT = {**PREFILL_ANSWER, "remote_port": "9000"}
REMOTE = RemotePrefill("sim-1", (3, 4), "127.0.0.1", 9000)


def allocation(*blocks: int, prompt: int = 20) -> KVAllocation:
    return KVAllocation(tuple(blocks), prompt, 0)


# --- the table ------------------------------------------------------------------------------


def test_a_holding_is_taken_once_by_whoever_names_it() -> None:
    table = TransferTable(timeout=30, capacity=8, block_size=16)
    held, displaced = table.hold("req", allocation(3, 4, 5), 20, now=0)
    assert displaced == [] and held.block_ids == (3, 4)  # the prompt's blocks, not its output's
    assert held.expires_at == 30
    assert table.take("req", 20, now=1, block_ids=(3, 4)) == held
    assert table.take("req", 20, now=1, block_ids=(3, 4)) is None
    assert len(table) == 0


def test_a_take_that_names_something_else_takes_nothing() -> None:
    table = TransferTable(timeout=30, capacity=8, block_size=16)
    table.hold("req", allocation(3, 4), 20, now=0)
    assert table.take("other", 20, now=1) is None
    assert table.take("req", 21, now=1) is None  # another prompt
    assert table.take("req", 20, now=1, block_ids=(3,)) is None  # other blocks
    assert table.holds("req")  # left to its expiry


def test_holdings_expire_after_the_timeout_and_not_before() -> None:
    table = TransferTable(timeout=10, capacity=8, block_size=16)
    first, _ = table.hold("a", allocation(1), 4, now=0)
    table.hold("b", allocation(2), 4, now=5)
    assert table.next_expiry == 10
    assert table.expire(9.9) == []
    assert table.expire(10) == [first]
    assert table.take("a", 4, now=10) is None
    assert table.take("b", 4, now=15) is None  # expired, though `expire` was not called
    assert [held.block_ids for held in table.expire(15)] == [(2,)]
    assert table.next_expiry is None


def test_the_table_is_bounded_oldest_given_up_first() -> None:
    table = TransferTable(timeout=10, capacity=2, block_size=16)
    oldest, _ = table.hold("a", allocation(1), 4, now=0)
    table.hold("b", allocation(2), 4, now=0)
    _, displaced = table.hold("c", allocation(3), 4, now=0)
    assert displaced == [oldest] and len(table) == 2
    again, displaced = table.hold("b", allocation(4), 4, now=1)
    assert [held.block_ids for held in displaced] == [(2,)]
    assert table.take("b", 4, now=1) == again


def test_counters_count_requests_and_tokens_by_reason() -> None:
    counters = PdCounters()
    counters.recomputed("unusable", 100)
    counters.recomputed("unusable", 20)
    assert counters.recomputed_requests == {"no_params": 0, "unusable": 2}
    assert counters.recomputed_tokens == {"no_params": 0, "unusable": 120}


# --- what a request asks ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "payload", "plan"),
    [
        ("both", {"kv_transfer_params": KV_TRANSFER_ASK}, Aggregated()),
        ("both", {"kv_transfer_params": PREFILL_ANSWER}, Aggregated()),
        ("prefill", {"kv_transfer_params": KV_TRANSFER_ASK}, HoldForDecode()),
        ("prefill", {}, Aggregated()),
        ("prefill", {"kv_transfer_params": PREFILL_ANSWER}, Aggregated()),
        ("decode", {}, Recompute("no_params")),
        ("decode", {"kv_transfer_params": None}, Recompute("no_params")),
        ("decode", {"kv_transfer_params": KV_TRANSFER_ASK}, Recompute("unusable")),
        ("decode", {"kv_transfer_params": BAD_PORT}, Recompute("unusable")),
        ("decode", {"kv_transfer_params": PREFILL_ANSWER}, REMOTE),
    ],
)
def test_vllm_plans_by_role(role: str, payload: dict[str, Any], plan: object) -> None:
    assert plan_leg(role, "vllm", payload, prompts=1) == plan


ROOM = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**62}


@pytest.mark.parametrize(
    ("role", "payload", "plan"),
    [
        ("both", ROOM, Aggregated()),
        ("prefill", ROOM, HoldForDecode(2**62)),
        ("prefill", {}, Aggregated()),
        ("decode", ROOM, Bootstrap("127.0.0.1", 8998, (2**62,))),
        ("decode", {}, Recompute("no_params")),
        ("decode", {**ROOM, "bootstrap_room": -1}, Recompute("unusable")),
        ("decode", {**ROOM, "bootstrap_port": None}, Recompute("unusable")),
    ],
)
def test_sglang_plans_by_role(role: str, payload: dict[str, Any], plan: object) -> None:
    assert plan_leg(role, "sglang", payload, prompts=1) == plan


def test_batched_bootstrap_fields_are_arrays_as_long_as_the_batch() -> None:
    batch = {"bootstrap_host": ["h", "h"], "bootstrap_port": [1, 1], "bootstrap_room": [5, 6]}
    assert bootstrap_fields(batch, 2) == Bootstrap("h", 1, (5, 6))
    assert bootstrap_fields(batch, 1) is None
    assert bootstrap_fields({**batch, "bootstrap_room": [5, 5]}, 2) is None
    assert bootstrap_fields({**batch, "bootstrap_host": [{}, "h"]}, 2) is None
    single = {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}
    assert bootstrap_fields(single, 1) == Bootstrap("h", 1, (5,))


def test_a_prefill_answers_with_what_a_decode_engine_reads_back() -> None:
    table = TransferTable(timeout=30, capacity=8, block_size=16)
    held, _ = table.hold("req", allocation(3, 4, 5), 20, now=0)
    params = answer_params("sim-1", held, "127.0.0.1", 9000)
    assert params == PREFILL_ANSWER
    assert plan_leg("decode", "vllm", {"kv_transfer_params": params}, 1) == REMOTE


# --- the scheduler ----------------------------------------------------------------------------


def test_a_prefilled_sequence_decodes_in_the_step_that_admits_it() -> None:
    admitted: list[int] = []
    scheduler = StepScheduler(2, 100, lambda seq_id: admitted.append(seq_id) or 50)
    scheduler.arrive(0, 3)
    scheduler.arrive_prefilled(1, 3)
    scheduler.arrive_prefilled(2, 3)  # no room: max_num_seqs is 2
    assert scheduler.state(1) is SeqState.WAITING
    step = scheduler.plan()
    assert step.prefill == ((0, 50),) and step.decode == (1,) and step.started == 1
    assert admitted == [0, 1]
    assert scheduler.state(1) is SeqState.DECODING and scheduler.state(2) is SeqState.WAITING
    progress = scheduler.complete(step)
    assert [(p.seq_id, p.produced) for p in progress] == [(0, 1), (1, 1)]


def test_a_prefilled_sequence_needs_one_token_of_budget() -> None:
    scheduler = StepScheduler(8, 1, lambda _seq_id: 0)
    scheduler.arrive_prefilled(0, 1)
    scheduler.arrive_prefilled(1, 1)
    step = scheduler.plan()
    assert (step.prefill, step.decode) == ((), (0,))
    assert [p.finished for p in scheduler.complete(step)] == [True]
    with pytest.raises(ValueError, match="already arrived"):
        scheduler.arrive_prefilled(1, 1)


# --- the engine, in simulated time ------------------------------------------------------------

# A 2048-token prompt chunk costs a step 0.2 s more than its decodes' 0.01-0.02 s.
ENGINE = dataclasses.replace(
    FAST_SIM, prefill_overhead=0.01, prefill_per_token=0.0001, inter_token_latency=0.01
)


async def test_a_prefilled_prompt_costs_no_prefill_and_reports_itself_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimEngine(ENGINE)
    kept: list[KVAllocation] = []
    times: list[float] = []

    async def emit(_index: int) -> None:
        times.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        start = trio.current_time()
        cached = await engine.generate(list(range(4000)), 2, emit, prefilled=True)
        assert cached == 4000
        assert times[0] - start == pytest.approx(0.01)  # one decode step, no prefill at all
        await engine.generate(list(range(100, 200)), 1, emit, keep=kept.append)
        nursery.cancel_scope.cancel()
    assert engine.kv_cache.used_blocks == len(kept[0].block_ids) > 0  # kept, not released


async def decode_gaps(role: str) -> list[float]:
    """Inter-token gaps of 4 long answers while 8k-token prompts keep arriving: prefilled
    (a decode engine given their KV) or computed here (an engine that does both)."""
    engine = SimEngine(dataclasses.replace(ENGINE, kv_cache_blocks=20_000))
    gaps: list[float] = []

    async def answer(number: int) -> None:
        last: list[float] = []

        async def emit(_index: int) -> None:
            now = trio.current_time()
            if last:
                gaps.append(now - last[0])
            last[:] = [now]

        await engine.generate([number, *range(10)], 200, emit)

    async def long_prompt(number: int) -> None:
        prompt = [1000 + number, *range(8000)]
        await engine.generate(prompt, 1, _ignore, prefilled=role == "decode")

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as clients:
            for number in range(4):
                clients.start_soon(answer, number)
            for number in range(10):
                clients.start_soon(long_prompt, number)
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return sorted(gaps)


async def _ignore(_index: int) -> None:
    pass


async def test_decodes_beside_long_prefills_stall_only_where_the_prefills_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    aggregated, disaggregated = await decode_gaps("both"), await decode_gaps("decode")
    p99 = int(len(aggregated) * 0.99)
    # Beside a 2048-token prompt chunk a step costs ~0.2 s more: the aggregated tail is that.
    assert aggregated[p99] > 5 * disaggregated[p99]
    assert max(disaggregated) < 2 * ENGINE.inter_token_latency * ENGINE.time_factor_under_load


# --- the flags -------------------------------------------------------------------------------


def test_the_flags_parse_and_refuse_what_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    _, settings = parse(["sim-backend", "--role", "prefill", "--pd-protocol", "sglang"])
    assert isinstance(settings, SimSettings)
    assert (settings.role, settings.pd_protocol, settings.bootstrap_port) == (
        "prefill",
        "sglang",
        8998,
    )
    refused = {
        ("--bootstrap-port", "70000"): "--bootstrap-port 70000: expected a port from 0 to 65535",
        ("--kv-transfer-timeout", "0"): "--kv-transfer-timeout must be more than 0 seconds",
        ("--kv-transfer-per-token", "-1"): "--kv-transfer-per-token must not be negative",
    }
    for flag, message in refused.items():
        with pytest.raises(ConfigExit, match=message):
            parse(["sim-backend", *flag])
    with pytest.raises(SystemExit):
        parse(["sim-backend", "--role", "middle"])
    assert "invalid choice: 'middle'" in capsys.readouterr().err
