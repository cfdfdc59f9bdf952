"""The simulated GPU without HTTP: latency arithmetic, batch admission, the prefix KV cache
(chained block hashes, hits on shared prefixes, LRU eviction, usage) and the trio engine
that plays them out in time, timed exactly under trio's MockClock (`autojump_clock`).
"""

from __future__ import annotations

import dataclasses

import pytest
import trio

from app.sim.engine import SimEngine
from app.sim.kv_cache import PrefixKVCache, chained_block_hashes
from app.sim.latency import BatchAdmission, LatencyModel
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


def test_prefill_costs_overhead_plus_uncached_tokens() -> None:
    assert MODEL.prefill_seconds(0) == pytest.approx(0.010)
    assert MODEL.prefill_seconds(100) == pytest.approx(0.010 + 100 * 0.001)


def test_decode_costs_one_inter_token_latency_per_token_after_the_first() -> None:
    assert MODEL.decode_seconds(0) == 0.0
    assert MODEL.decode_seconds(1) == 0.0
    assert MODEL.decode_seconds(5) == pytest.approx(4 * 0.005)
    gaps = [MODEL.token_gap_seconds(index) for index in range(5)]
    assert gaps[0] == 0.0
    assert sum(gaps) == pytest.approx(MODEL.decode_seconds(5))


# --- batch admission ------------------------------------------------------------------------


def test_admission_runs_up_to_the_limit_then_queues_in_arrival_order() -> None:
    batch = BatchAdmission(max_running=2)
    assert [batch.arrive(seq) for seq in range(5)] == [True, True, False, False, False]
    assert (batch.running, batch.waiting) == (2, 3)
    assert batch.leave(1) == [2]
    assert batch.leave(0) == [3]
    assert (batch.running, batch.waiting) == (2, 1)


def test_a_waiter_that_gives_up_leaves_the_queue_without_admitting_anyone() -> None:
    batch = BatchAdmission(max_running=1)
    for seq in range(3):
        batch.arrive(seq)
    assert batch.leave(1) == []
    assert batch.leave(0) == [2]
    assert (batch.running, batch.waiting) == (1, 0)


def test_newcomers_cannot_overtake_the_queue() -> None:
    batch = BatchAdmission(max_running=1)
    batch.arrive(0)
    batch.arrive(1)
    with pytest.raises(ValueError):
        batch.arrive(1)
    assert batch.leave(0) == [1]
    assert batch.arrive(2) is False


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


async def test_one_request_takes_prefill_plus_decode(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(SETTINGS)
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


async def test_a_cached_prefix_shortens_prefill(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(SETTINGS)

    async def ignore(_index: int) -> None:
        pass

    await engine.generate(tokens(0, 21), 1, ignore)
    start = trio.current_time()
    cached = await engine.generate(tokens(0, 21), 1, ignore)
    assert cached == 20
    assert trio.current_time() - start == pytest.approx(MODEL.prefill_seconds(1))


async def test_requests_beyond_max_num_seqs_wait_their_turn(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(dataclasses.replace(SETTINGS, max_num_seqs=1))
    finished: dict[int, float] = {}

    async def request(number: int) -> None:
        async def ignore(_index: int) -> None:
            pass

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


async def test_cancelling_a_running_request_frees_its_slot_and_blocks(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = SimEngine(dataclasses.replace(SETTINGS, max_num_seqs=1))

    async def ignore(_index: int) -> None:
        pass

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
