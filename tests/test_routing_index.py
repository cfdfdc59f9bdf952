"""The token-block index alone: chained block hashes, longest held prefix per backend, LRU
eviction under `max_blocks`, forgetting by stamp, purging a backend. Property-tested with
hypothesis against a naive reference (a flat list walked linearly) on random sequences of
operations over prompts that share prefixes, as real traffic does."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.routing.block_index import BLOCK_SIZE, BlockIndex, block_hashes
from app.routing.router import HASH_SLICE_TOKENS, block_hashes_in_slices


def ids(*spec: tuple[int, int]) -> list[int]:
    """Token ids from (start, count) runs."""
    out: list[int] = []
    for start, count in spec:
        out.extend(range(start, start + count))
    return out


# --- hashes -----------------------------------------------------------------------------------


def test_hashes_cover_full_blocks_and_chain_the_prefix() -> None:
    assert block_hashes(ids((0, 15))) == []
    first = block_hashes(ids((0, 40)))
    assert len(first) == 2
    second = block_hashes(ids((0, 16), (900, 30)))
    assert first[0] == second[0] and first[1] != second[1]
    # A change in block 0 changes every later hash: a hash names its whole prefix.
    changed = block_hashes([7, *ids((1, 47))])
    assert all(a != b for a, b in zip(block_hashes(ids((0, 48))), changed, strict=True))


def test_arrays_lists_and_huge_ids_hash_alike_or_at_least_consistently() -> None:
    tokens = ids((5, 64))
    assert block_hashes(array("I", tokens)) == block_hashes(tokens)
    huge = [2**40 + i for i in range(32)]
    assert block_hashes(huge) == block_hashes(list(huge))
    assert len(block_hashes(huge)) == 2


@pytest.mark.parametrize("extra", [-1, 0, 1, BLOCK_SIZE, HASH_SLICE_TOKENS + 7])
async def test_a_long_prompt_hashed_in_slices_hashes_as_whole(extra: int) -> None:
    tokens = array("I", range(2 * HASH_SLICE_TOKENS + extra))
    assert await block_hashes_in_slices(tokens) == block_hashes(tokens)


# --- the index --------------------------------------------------------------------------------


def test_longest_held_prefix_per_backend() -> None:
    index = BlockIndex(max_blocks=100)
    system = ids((0, 64))
    index.record("a", block_hashes(system + ids((1000, 32))))
    index.record("b", block_hashes(system[:32]))
    probe = block_hashes(system + ids((2000, 32)))
    assert (index.match("a", probe), index.match("b", probe), index.match("c", probe)) == (4, 2, 0)
    assert len(index) == 8
    assert index.blocks("a") == 6


def test_least_recently_used_blocks_go_first_and_tails_before_heads() -> None:
    index = BlockIndex(max_blocks=6)
    old, new = block_hashes(ids((0, 64))), block_hashes(ids((500, 48)))
    index.record("a", old)
    index.record("b", new)  # 7 entries: one of `old`'s must go, and it is its tail
    assert index.match("a", old) == 3
    assert index.match("b", new) == 3
    index.record("a", old[:1])  # refresh old's head only
    index.record("b", block_hashes(ids((900, 16))))
    assert index.match("a", old) == 2  # the tail went again, never the head
    assert len(index) == 6 and index.evictions == 2


def test_forget_before_drops_what_an_lru_backend_evicted_before_a_known_eviction() -> None:
    index = BlockIndex(max_blocks=100)
    early, late = block_hashes(ids((0, 32))), block_hashes(ids((100, 32)))
    index.record("a", early)
    index.record("a", late)
    stamp_of_late_tail = index.stamps("a", late)[-1]
    assert index.forget_before("a", stamp_of_late_tail) == 3  # early's two and late's tail
    assert (index.match("a", early), index.match("a", late)) == (0, 1)


def test_removed_backends_are_purged() -> None:
    index = BlockIndex(max_blocks=100)
    chain = block_hashes(ids((0, 48)))
    for backend in ("a", "b", "c"):
        index.record(backend, chain)
    index.remove_backend("b")
    index.retain(["a"])
    assert index.backends() == ["a"] and len(index) == 3
    index.remove_backend("zzz")


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        BlockIndex(0)
    index = BlockIndex(1)
    index.record("a", [])
    index.record("a", block_hashes(ids((0, 64))))
    assert len(index) == 1 and index.match("a", block_hashes(ids((0, 64)))) == 1


# --- against a naive reference ----------------------------------------------------------------


class NaiveIndex:
    """The same contract, written the obvious way: a flat list of (backend, hash, stamp)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.entries: list[tuple[str, int, int]] = []
        self.clock = 0

    def record(self, backend: str, hashes: list[int]) -> None:
        for block_hash in reversed(hashes):
            self.clock += 1
            self.entries = [e for e in self.entries if (e[0], e[1]) != (backend, block_hash)]
            self.entries.append((backend, block_hash, self.clock))
        while len(self.entries) > self.max_blocks:
            self.entries.remove(min(self.entries, key=lambda e: e[2]))

    def match(self, backend: str, hashes: list[int]) -> int:
        held = {h for b, h, _ in self.entries if b == backend}
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def forget_before(self, backend: str, stamp: int) -> None:
        self.entries = [e for e in self.entries if e[0] != backend or e[2] > stamp]

    def remove_backend(self, backend: str) -> None:
        self.entries = [e for e in self.entries if e[0] != backend]


# Prompts as (prefix family, shared blocks, own blocks): families share their first blocks,
# so chains overlap the way system prompts and growing conversations do.
prompt = st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 3), st.integers(0, 5))
backend = st.sampled_from(["a", "b", "c"])
operation = st.one_of(
    st.tuples(st.just("record"), backend, prompt),
    st.tuples(st.just("forget"), backend, st.integers(0, 60)),
    st.tuples(st.just("remove"), backend, st.none()),
)


def chain(spec: tuple[int, int, int, int]) -> list[int]:
    family, shared, variant, own = spec
    tokens = ids(
        (family * 10_000, shared * BLOCK_SIZE),
        (family * 10_000 + 5_000 + variant * 100, own * BLOCK_SIZE),
    )
    return block_hashes(tokens)


@settings(max_examples=300, deadline=None)
@given(max_blocks=st.integers(1, 24), operations=st.lists(operation, max_size=40))
def test_index_agrees_with_the_naive_reference(
    max_blocks: int, operations: list[tuple[str, str, object]]
) -> None:
    index, naive = BlockIndex(max_blocks), NaiveIndex(max_blocks)
    probes = [chain((f, 4, v, 5)) for f in range(4) for v in range(4)]
    for kind, name, argument in operations:
        if kind == "record":
            assert isinstance(argument, tuple)
            hashes = chain(argument)
            index.record(name, hashes)
            naive.record(name, hashes)
        elif kind == "forget":
            assert isinstance(argument, int)
            index.forget_before(name, argument)
            naive.forget_before(name, argument)
        else:
            index.remove_backend(name)
            naive.remove_backend(name)
        assert len(index) == len(naive.entries) <= max_blocks
        for probe in probes:
            for who in ("a", "b", "c"):
                assert index.match(who, probe) == naive.match(who, probe)


@given(st.integers(1, 40), st.integers(0, 3))
def test_a_chain_recorded_in_slices_ends_as_if_recorded_whole(most: int, held_before: int) -> None:
    """Slices from the tail, each newer than the last: the same stamps, the same order and
    the same entries as one `record`, whatever the slice (fed whole, then piece by piece).
    Blocks held before may be evicted between slices and come back with the head's."""
    chain = block_hashes(ids((0, 16 * 30)))
    whole, sliced = BlockIndex(max_blocks=24), BlockIndex(max_blocks=24)
    for index in (whole, sliced):
        index.record("gpu", block_hashes(ids((5000, 16 * 8))))
        index.record("gpu", chain[:held_before])
    whole.record("gpu", chain)
    end = len(chain)
    while end:
        end = sliced.record_tail("gpu", chain, end, most)
    assert sliced._held == whole._held and len(sliced) == len(whole) == 24
    assert whole.evictions <= sliced.evictions <= whole.evictions + held_before


def test_until_its_head_is_in_a_new_chain_matches_nothing() -> None:
    chain = block_hashes(ids((0, 16 * 10)))
    index = BlockIndex(max_blocks=100)
    start = index.record_tail("gpu", chain, len(chain), 4)
    assert start == 6 and index.match("gpu", chain) == 0
    index.record_tail("gpu", chain, start, 6)
    assert index.match("gpu", chain) == 10
