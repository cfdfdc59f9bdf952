"""The simulated GPU without HTTP: step latency arithmetic (llm-d's formulas, decode slowing
with the batch), the step scheduler (vLLM's token budget, chunked prefill, FCFS admission), the
prefix KV cache (chained block hashes, hits on shared prefixes, LRU eviction, usage) and the
trio engine that plays them out in time, timed exactly under trio's MockClock
(`autojump_clock`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from app.sim.engine import SimEngine
from app.sim.kv_cache import PrefixKVCache, chained_block_hashes
from app.sim.latency import LatencyModel, Step
from app.sim.scheduler import Progress, SeqState, StepScheduler
from app.sim.settings import SimSettings
from app.sim.tokens import WordTokenizer, generated_pieces, render_chat

SETTINGS = SimSettings(
    prefill_overhead=0.010,
    prefill_per_token=0.001,
    inter_token_latency=0.005,
    max_num_seqs=2,
    kv_cache_blocks=64,
    block_size=4,
)
MODEL = LatencyModel.from_settings(SETTINGS)


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


# --- latency arithmetic -------------------------------------------------------------------


def test_alone_a_sequence_sees_llm_d_formula() -> None:
    assert MODEL.prefill_seconds(0) == pytest.approx(0.010)
    assert MODEL.prefill_seconds(100) == pytest.approx(0.010 + 100 * 0.001)
    assert MODEL.decode_seconds(1) == 0.0
    assert MODEL.decode_seconds(5) == pytest.approx(4 * 0.005)
    assert MODEL.step_seconds(Step(((0, 100),), (), 1)) == pytest.approx(MODEL.prefill_seconds(100))
    assert MODEL.step_seconds(Step((), (0,), 0)) == pytest.approx(0.005)


def test_decode_steps_slow_down_linearly_up_to_the_load_factor_at_a_full_batch() -> None:
    model = LatencyModel(0.0, 0.0, 0.010, time_factor_under_load=3.0, max_num_seqs=5)
    assert [model.load_factor(n) for n in range(0, 7)] == pytest.approx(
        [1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]
    )
    assert model.decode_step_seconds(0) == 0.0
    assert model.decode_step_seconds(5) == pytest.approx(0.030)
    # One sequence alone never feels load, whatever the factor.
    assert LatencyModel(0, 0, 0.01, 3.0, 1).load_factor(4) == 1.0


def test_a_mixed_step_pays_for_its_prefill_chunks_and_its_decodes() -> None:
    step = Step(((1, 30), (2, 10)), (3, 4), started=1)
    assert (step.prefill_tokens, step.batched_tokens) == (40, 42)
    decode = 0.005 * MODEL.load_factor(2)
    assert MODEL.step_seconds(step) == pytest.approx(0.010 + 40 * 0.001 + decode)


# --- the step scheduler ---------------------------------------------------------------------


def scheduler(
    max_num_seqs: int = 2, budget: int = 100, uncached: dict[int, int] | None = None
) -> tuple[StepScheduler, list[int]]:
    admitted: list[int] = []

    def admit(seq_id: int) -> int:
        admitted.append(seq_id)
        return (uncached or {}).get(seq_id, 10)

    return StepScheduler(max_num_seqs, budget, admit), admitted


def test_admission_is_first_come_first_served_up_to_max_num_seqs() -> None:
    sched, admitted = scheduler(max_num_seqs=2)
    for seq in range(4):
        sched.arrive(seq, output_tokens=2)
    step = sched.plan()
    assert admitted == [0, 1]
    assert step == Step(((0, 10), (1, 10)), (), 2)
    assert (sched.running, sched.waiting) == (2, 2)
    assert sched.state(2) is SeqState.WAITING
    with pytest.raises(ValueError):
        sched.arrive(3, output_tokens=1)


def test_the_step_that_ends_a_prefill_emits_the_first_token_then_one_per_step() -> None:
    sched, _ = scheduler(max_num_seqs=1)
    sched.arrive(0, output_tokens=3)
    assert sched.complete(sched.plan()) == [Progress(0, 1, False)]
    assert sched.state(0) is SeqState.DECODING
    assert sched.plan() == Step((), (0,), 0)
    assert sched.complete(sched.plan()) == [Progress(0, 2, False)]
    assert sched.complete(sched.plan()) == [Progress(0, 3, True)]
    assert not sched.has_work


def test_a_long_prompt_is_prefilled_in_chunks_that_share_the_budget_with_decodes() -> None:
    sched, _ = scheduler(max_num_seqs=4, budget=100, uncached={0: 5, 1: 250})
    sched.arrive(0, output_tokens=10)
    sched.complete(sched.plan())  # 0 prefilled and decoding
    sched.arrive(1, output_tokens=1)
    chunks = []
    while sched.state(1) is not None:
        step = sched.plan()
        assert step.batched_tokens <= 100
        chunks.append(dict(step.prefill).get(1))
        sched.complete(step)
    # One token of every step goes to sequence 0's decode.
    assert chunks == [99, 99, 52]


def test_budget_left_after_running_sequences_admits_waiting_ones_in_the_same_step() -> None:
    sched, admitted = scheduler(max_num_seqs=3, budget=25, uncached={0: 20, 1: 20, 2: 20})
    for seq in range(3):
        sched.arrive(seq, output_tokens=1)
    assert sched.plan() == Step(((0, 20), (1, 5)), (), 2)
    assert admitted == [0, 1]  # no budget left for 2 this step


def test_aborting_frees_the_slot_and_an_aborted_sequence_is_skipped_on_completion() -> None:
    sched, _ = scheduler(max_num_seqs=1)
    sched.arrive(0, output_tokens=5)
    sched.arrive(1, output_tokens=5)
    step = sched.plan()
    sched.abort(0)
    assert sched.complete(step) == []
    assert sched.plan().prefill == ((1, 10),)
    sched.abort(7)  # unknown or finished: nothing happens
    with pytest.raises(ValueError):
        sched.arrive(9, output_tokens=0)


def test_a_fully_cached_prompt_still_computes_one_token() -> None:
    sched, _ = scheduler(uncached={0: 0})
    sched.arrive(0, output_tokens=1)
    assert sched.plan().prefill == ((0, 1),)


# --- chained block hashes -------------------------------------------------------------------


def test_only_full_blocks_are_hashed_and_equal_prefixes_hash_equally() -> None:
    assert len(chained_block_hashes(tokens(0, 11), 4)) == 2
    first = chained_block_hashes(tokens(0, 12), 4)
    second = chained_block_hashes([*tokens(0, 8), 99, 98, 97, 96], 4)
    assert first[:2] == second[:2]
    assert first[2] != second[2]


def test_a_differing_early_block_changes_every_later_hash() -> None:
    original = chained_block_hashes(tokens(0, 16), 4)
    early_change = chained_block_hashes([42, *tokens(1, 15)], 4)
    assert all(a != b for a, b in zip(original, early_change, strict=True))


# --- prefix KV cache --------------------------------------------------------------------------


def test_a_shared_prefix_hits_and_is_counted_in_tokens() -> None:
    cache = PrefixKVCache(num_blocks=64, block_size=4)
    first = cache.allocate(tokens(0, 13), output_tokens=2)
    assert (first.cached_tokens, first.uncached_tokens) == (0, 13)
    cache.release(first)

    second = cache.allocate([*tokens(0, 12), 500, 501, 502], output_tokens=2)
    assert second.cached_tokens == 12
    assert (cache.query_tokens, cache.hit_tokens) == (13 + 15, 12)


def test_a_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    cache = PrefixKVCache(num_blocks=64, block_size=4)
    cache.release(cache.allocate(tokens(0, 8), output_tokens=0))
    again = cache.allocate(tokens(0, 8), output_tokens=0)
    assert again.cached_tokens == 4
    assert cache.used_blocks == 2


def test_a_differing_first_block_kills_all_later_hits() -> None:
    cache = PrefixKVCache(num_blocks=64, block_size=4)
    cache.release(cache.allocate(tokens(0, 17), output_tokens=0))
    changed = cache.allocate([42, *tokens(1, 16)], output_tokens=0)
    assert changed.cached_tokens == 0


def test_running_sequences_share_prefix_blocks() -> None:
    cache = PrefixKVCache(num_blocks=64, block_size=4)
    first = cache.allocate(tokens(0, 9), output_tokens=0)
    assert cache.used_blocks == 3
    second = cache.allocate(tokens(0, 9), output_tokens=0)
    assert second.cached_tokens == 8
    # Two shared prompt blocks; each sequence holds its own partial last block.
    assert cache.used_blocks == 4
    cache.release(first)
    cache.release(second)
    assert cache.used_blocks == 0


def test_usage_counts_held_blocks_only() -> None:
    cache = PrefixKVCache(num_blocks=8, block_size=4)
    allocation = cache.allocate(tokens(0, 10), output_tokens=2)
    assert cache.usage == pytest.approx(3 / 8)
    cache.release(allocation)
    assert cache.usage == 0.0


def test_least_recently_used_prefix_is_evicted_first() -> None:
    cache = PrefixKVCache(num_blocks=6, block_size=4)
    prompt_a, prompt_b, prompt_c = tokens(0, 9), tokens(100, 9), tokens(200, 9)
    cache.release(cache.allocate(prompt_a, output_tokens=0))
    cache.release(cache.allocate(prompt_b, output_tokens=0))
    # Three fresh blocks: the one that held nothing, the free one, then A's tail block.
    cache.release(cache.allocate(prompt_c, output_tokens=0))

    assert cache.allocate(prompt_b, output_tokens=0).cached_tokens == 8
    assert cache.allocate(prompt_a, output_tokens=0).cached_tokens == 4


def test_a_sequence_larger_than_the_cache_takes_what_is_free() -> None:
    cache = PrefixKVCache(num_blocks=4, block_size=4)
    allocation = cache.allocate(tokens(0, 40), output_tokens=10)
    assert len(allocation.block_ids) == 4
    assert cache.usage == 1.0
    cache.release(allocation)
    assert cache.usage == 0.0


# --- tokens -----------------------------------------------------------------------------------


def test_word_tokens_keep_shared_text_prefixes_as_shared_token_prefixes() -> None:
    tokenizer = WordTokenizer()
    system = {"role": "system", "content": "You are terse. " * 20}
    first = tokenizer.encode(render_chat([system, {"role": "user", "content": "hi"}]))
    second = tokenizer.encode(render_chat([system, {"role": "user", "content": "bye now"}]))
    shared = len(tokenizer.encode(render_chat([system])[: -len("assistant:")]))
    assert shared > 40
    assert first[:shared] == second[:shared]
    assert tokenizer.encode("hello  world ") == tokenizer.encode("hello  world ")


def test_generated_text_is_reproducible_per_prompt_and_seed() -> None:
    def text(prompt: list[int], seed: int) -> list[str]:
        pieces = generated_pieces(prompt, seed)
        return [next(pieces) for _ in range(8)]

    assert text([1, 2, 3], 0) == text([1, 2, 3], 0)
    assert text([1, 2, 3], 0) != text([1, 2, 4], 0)
    assert text([1, 2, 3], 0) != text([1, 2, 3], 1)


# --- the engine in (mock) time ----------------------------------------------------------------


@pytest.fixture
async def engine_for(nursery: trio.Nursery) -> Any:
    async def start(settings: SimSettings = SETTINGS) -> SimEngine:
        engine = SimEngine(settings)
        await nursery.start(engine.run)
        return engine

    return start


async def ignore(_index: int) -> None:
    pass


async def test_generate_needs_the_gpu_task() -> None:
    with pytest.raises(RuntimeError):
        await SimEngine(SETTINGS).generate(tokens(0, 4), 1, ignore)


async def test_one_request_takes_prefill_plus_decode(
    autojump_clock: trio.abc.Clock, engine_for: Any
) -> None:
    engine = await engine_for()
    emitted_at: list[float] = []

    async def emit(_index: int) -> None:
        emitted_at.append(trio.current_time())

    start = trio.current_time()
    cached = await engine.generate(tokens(0, 20), 5, emit)
    assert cached == 0
    assert emitted_at[0] - start == pytest.approx(MODEL.prefill_seconds(20))
    assert emitted_at[-1] - start == pytest.approx(
        MODEL.prefill_seconds(20) + MODEL.decode_seconds(5)
    )
    assert (engine.prompt_tokens_total, engine.generation_tokens_total) == (20, 5)


async def test_a_cached_prefix_shortens_prefill(
    autojump_clock: trio.abc.Clock, engine_for: Any
) -> None:
    engine = await engine_for()
    await engine.generate(tokens(0, 21), 1, ignore)
    start = trio.current_time()
    cached = await engine.generate(tokens(0, 21), 1, ignore)
    assert cached == 20
    assert trio.current_time() - start == pytest.approx(MODEL.prefill_seconds(1))


async def test_requests_beyond_max_num_seqs_wait_their_turn(
    autojump_clock: trio.abc.Clock, engine_for: Any
) -> None:
    engine = await engine_for(dataclasses.replace(SETTINGS, max_num_seqs=1))
    finished: dict[int, float] = {}

    async def request(number: int) -> None:
        await engine.generate(tokens(number * 1000, 10), 3, ignore)
        finished[number] = trio.current_time()

    one_request = MODEL.prefill_seconds(10) + MODEL.decode_seconds(3)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for number in range(3):
            nursery.start_soon(request, number)
            await trio.testing.wait_all_tasks_blocked()
        assert (engine.running, engine.waiting) == (1, 2)
    assert [finished[n] - start for n in range(3)] == pytest.approx(
        [one_request, 2 * one_request, 3 * one_request]
    )
    assert (engine.running, engine.waiting) == (0, 0)


async def test_a_crowded_gpu_is_slower_for_everyone_on_it(
    autojump_clock: trio.abc.Clock, engine_for: Any
) -> None:
    """The same request takes longer beside seven others than alone: decode steps slow down
    with the batch and prefill chunks share the token budget."""
    settings = dataclasses.replace(SETTINGS, max_num_seqs=8, max_num_batched_tokens=64)
    engine = await engine_for(settings)

    async def timed(start_token: int) -> float:
        start = trio.current_time()
        await engine.generate(tokens(start_token, 60), 20, ignore)
        return trio.current_time() - start

    alone = await timed(0)
    durations: list[float] = []

    async def one(number: int) -> None:
        durations.append(await timed(10_000 * (number + 1)))

    async with trio.open_nursery() as nursery:
        for number in range(8):
            nursery.start_soon(one, number)
    assert min(durations) > 1.5 * alone


async def test_cancelling_a_running_request_frees_its_slot_and_blocks(
    autojump_clock: trio.abc.Clock, engine_for: Any
) -> None:
    engine = await engine_for(dataclasses.replace(SETTINGS, max_num_seqs=1))

    async with trio.open_nursery() as nursery:
        doomed = trio.CancelScope()

        async def long_request() -> None:
            with doomed:
                await engine.generate(tokens(0, 10), 1000, ignore)

        nursery.start_soon(long_request)
        await engine.wait_until(lambda: engine.running == 1)
        nursery.start_soon(engine.generate, tokens(500, 10), 2, ignore)
        await engine.wait_until(lambda: engine.waiting == 1)
        assert engine.kv_cache.used_blocks > 0

        doomed.cancel()
        await engine.wait_until(lambda: engine.waiting == 0)
        assert engine.running == 1
    assert (engine.running, engine.waiting, engine.kv_cache.used_blocks) == (0, 0, 0)


def test_evict_all_forgets_free_cached_blocks_but_not_held_ones() -> None:
    cache = PrefixKVCache(num_blocks=16, block_size=4)
    cache.release(cache.allocate(tokens(0, 9), output_tokens=0))
    held = cache.allocate(tokens(100, 9), output_tokens=0)
    assert cache.evict_all() == 2
    assert cache.allocate(tokens(0, 9), output_tokens=0).cached_tokens == 0
    assert cache.allocate(tokens(100, 9), output_tokens=0).cached_tokens == 8
    cache.release(held)
