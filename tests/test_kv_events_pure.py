"""vLLM's KV events without sockets: the wire format decoded from msgpack bytes written out by
hand (the positional encoding of vLLM < #42892 and SGLang, and the by-name one of current
vLLM, with fields newer engines add), every truncation and a pile of garbage refused with
`BadMessage`, the replay socket's frames; then the events applied to the prefix index: an
engine's chain mapped onto Sluice's block hashes for engine blocks of 16, 1 (SGLang's pages),
32 and 24 tokens, removals (counted per engine block), clears, stores Sluice's hash cannot
stand for, the bound on the engine-block map, sequence gaps and restarts, and silence; and
the simulated backend's cache as a publisher, against an index fed by nothing else."""

from __future__ import annotations

import random

import pytest

from app.kv_events.index import (
    SILENT_AFTER_REQUESTS,
    SILENT_AFTER_SECONDS,
    UNMATCHED_AFTER_REQUESTS,
    BackendKvEvents,
)
from app.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BadMessage,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    OtherEvent,
    decode_batch,
    encode_batch,
    publish_frames,
    replay_request,
    split_frames,
    split_replay_frames,
)
from app.routing.block_index import BLOCK_SIZE, BlockIndex, block_hashes
from app.routing.decision import Prediction
from app.sim.kv_cache import PrefixKVCache, chained_block_hashes

# --- the wire ---------------------------------------------------------------------------------

# vLLM < #42892 (msgspec array_like=True), SGLang: [ts, [event], data_parallel_rank].
POSITIONAL_BATCH = b"".join(
    [
        b"\x93",  # array of 3: ts, events, data_parallel_rank
        b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00",  # float64 1.5
        b"\x91",  # array of 1 event
        b"\x97",  # array of 7: tag + 6 fields (later ones left out: defaults)
        b"\xabBlockStored",  # str of 11
        b"\x91\xcd\x12\x34",  # block_hashes [0x1234]
        b"\xc0",  # parent_block_hash nil
        b"\xdc\x00\x10" + bytes(range(16)),  # token_ids 0..15 (array 16 of fixints)
        b"\x10",  # block_size 16
        b"\xc0",  # lora_id nil
        b"\xa3GPU",  # medium
        b"\x00",  # data_parallel_rank 0
    ]
)

SHA = bytes(range(32))

# Current vLLM: the batch positional, each event a map tagged under "type", with the fields
# vLLM 0.26 sends (extra_keys, group_idx, kv_cache_spec_kind) and one no version has yet.
BY_NAME_BATCH = b"".join(
    [
        b"\x93",
        b"\xcb\x41\xda\xa9\x5f\x80\x00\x00\x00",  # float64 1789230592.0
        b"\x93",  # three events
        b"\x8d",  # map of 13
        b"\xa4type\xabBlockStored",
        b"\xacblock_hashes\x91\xc4\x20" + SHA,  # [bin 32]
        b"\xb1parent_block_hash\xc0",
        b"\xa9token_ids\xdc\x00\x10" + bytes(range(16)),
        b"\xaablock_size\x10",
        b"\xa7lora_id\xc0",
        b"\xa6medium\xa3GPU",
        b"\xa9lora_name\xc0",
        b"\xaaextra_keys\x91\xc0",  # [nil]: nothing but tokens in the hash
        b"\xa9group_idx\x00",
        b"\xb2kv_cache_spec_kind\xaefull_attention",
        b"\xbckv_cache_spec_sliding_window\xc0",
        b"\xa9next_year\x2a",  # a field this decoder has never heard of
        b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\xc4\x20" + SHA + b"\xa6medium\xa3GPU",
        b"\x81\xa4type\xb0AllBlocksCleared",
        b"\x01",  # data_parallel_rank 1
    ]
)


def test_the_positional_encoding_decodes_field_by_field() -> None:
    batch = decode_batch(POSITIONAL_BATCH)
    assert batch == EventBatch(
        1.5,
        (BlockStored((0x1234,), None, tuple(range(16)), 16, None, "GPU"),),
        data_parallel_rank=0,
    )


def test_the_by_name_encoding_of_current_vllm_decodes_and_ignores_new_fields() -> None:
    batch = decode_batch(BY_NAME_BATCH)
    assert batch.ts == 1789230592.0 and batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        (SHA,), None, tuple(range(16)), 16, None, "GPU", None, (None,), 0, "full_attention"
    )
    assert removed == BlockRemoved((SHA,), "GPU")
    assert cleared == AllBlocksCleared()


def test_a_batch_as_a_map_without_rank_and_an_unknown_event_kind() -> None:
    # {"ts": 2, "events": [["BlockMoved", 1]]}
    payload = b"\x82\xa2ts\x02\xa6events\x91\x92\xaaBlockMoved\x01"
    assert decode_batch(payload) == EventBatch(2.0, (OtherEvent("BlockMoved"),))


def test_what_the_simulated_backend_encodes_decodes_to_the_same_batch() -> None:
    batch = EventBatch(
        3.25,
        (
            BlockStored((7, 8), 6, tuple(range(32)), 16, None, "GPU", None, (None, None), 0),
            BlockRemoved((b"\x01" * 8,), "GPU", 0),
            AllBlocksCleared(),
        ),
        data_parallel_rank=0,
    )
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize("payload", [POSITIONAL_BATCH, BY_NAME_BATCH])
def test_every_truncation_is_a_bad_message_not_a_crash(payload: bytes) -> None:
    for end in range(len(payload)):
        with pytest.raises(BadMessage):
            decode_batch(payload[:end])


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        b"\x91" * 100_000 + b"\x00",  # nested 100,000 deep
        b"\x92\xa2ts\x90",  # ts a string
        b"\x92\x01\x01",  # events not a list
        b"\x92\x01\x91\x01",  # an event that is an int
        b"\x92\x01\x91\x91\x01",  # a tag that is an int
        b"\x92\x01\x91\x95\xabBlockStored\x90\xc0\x91\x01\x10",  # 1 token for 0 blocks
        b"\x92\x01\x91\x95\xabBlockStored\x91\x01\xc0\x91\xff\x01",  # -1 as a token id
        b"\x92\x01\x91\x95\xabBlockStored\x91\xa1x\xc0\x91\x01\x01",  # a str hash
        b"\x92\x01\x91\x95\xabBlockStored\x91\x01\xc0\x91\x01\x00",  # block_size 0
        b"\x92\x01\x91\x93\xacBlockRemoved\x91\x01\x07",  # medium an int
        b"\x92\x01\x90\xc1",  # trailing garbage
        b"\x92\x01\x91\x92\xa4\xff\xfe\xfd\xfc\x01",  # a tag that is not UTF-8
    ],
)
def test_garbage_is_a_bad_message(payload: bytes) -> None:
    with pytest.raises(BadMessage):
        decode_batch(payload)


def test_frames_of_the_pub_and_replay_sockets() -> None:
    frames = publish_frames(b"kv-events", 258, b"payload")
    assert frames == [b"kv-events", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"payload"]
    assert split_frames(frames) == (b"kv-events", 258, b"payload")
    for bad in ([b"", b"\x00" * 8], [b"", b"\x00" * 7, b"x"], [b"", b"", b"", b""]):
        with pytest.raises(BadMessage):
            split_frames(bad)
    assert replay_request(5) == [b"", b"\x00\x00\x00\x00\x00\x00\x00\x05"]
    assert split_replay_frames([b"", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")
    assert split_replay_frames([b"", END_SEQ, b""]) is None
    assert END_SEQ == b"\xff" * 8
    with pytest.raises(BadMessage):
        split_replay_frames([b"x", END_SEQ, b""])


# --- events applied to the index --------------------------------------------------------------


def tokens(count: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + count))


def stored(
    hashes: list[int], parent: int | None, ids: tuple[int, ...], size: int = 16, **extra: object
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, ids, size, **extra)  # type: ignore[arg-type]


class Engine:
    """A backend's events applied one batch at a time, with sequence numbers counted."""

    def __init__(self, index: BlockIndex | None = None, max_mapped: int = 1000) -> None:
        self.index = index or BlockIndex(10_000)
        self.events = BackendKvEvents(self.index, "gpu", max_mapped)
        self.seq = 0

    def send(self, *events: object) -> None:
        self.events.apply(self.seq, EventBatch(100.0, events), 5.0, 100.25)  # type: ignore[arg-type]
        self.seq += 1

    def held(self, ids: tuple[int, ...]) -> int:
        return self.index.match("gpu", block_hashes(ids))


def test_an_engine_chain_is_found_under_sluices_own_hashes() -> None:
    engine = Engine()
    prompt = tokens(48)
    engine.send(stored([101, 102], None, prompt[:32]))
    assert engine.held(prompt) == 2
    engine.send(stored([103], 102, prompt[32:]))  # the next chunk, chained to its parent
    assert engine.held(prompt) == 3
    assert engine.held(tokens(48, start=1)) == 0
    assert engine.events.blocks == {"learned": 3}
    assert engine.events.last_lag == 0.25 and engine.events.last_seq == 1


def test_a_predicted_block_is_confirmed_not_learned() -> None:
    engine = Engine()
    engine.index.record("gpu", block_hashes(tokens(32)))
    engine.send(stored([1, 2, 3], None, tokens(48)))
    assert engine.events.blocks == {"confirmed": 2, "learned": 1}


@pytest.mark.parametrize("size", [1, 4, 16, 24, 32])
def test_engine_blocks_of_any_size_group_into_blocks_of_sixteen(size: int) -> None:
    engine = Engine()
    prompt = tokens(96)
    whole = 96 // size
    # One event per engine block, each chained to the one before (SGLang's pages).
    for i in range(whole):
        parent = None if i == 0 else 1000 + i - 1
        engine.send(stored([1000 + i], parent, prompt[i * size : (i + 1) * size], size))
    assert engine.held(prompt) == whole * size // BLOCK_SIZE
    # Removing the last engine block drops the Sluice blocks it completed, and only those.
    last = 1000 + whole - 1
    engine.send(BlockRemoved((last,)))
    covered = (whole - 1) * size // BLOCK_SIZE
    assert engine.held(prompt) == covered
    assert engine.events.blocks["removed"] == 1


def test_removed_blocks_leave_and_a_block_two_engine_blocks_complete_stays_for_the_other() -> None:
    engine = Engine()
    prompt = tokens(32)
    engine.send(stored([1, 2], None, prompt, group_idx=0))
    engine.send(stored([1, 2], None, prompt, group_idx=1))  # a second full-attention group
    engine.send(BlockRemoved((2,), group_idx=0))
    assert engine.held(prompt) == 2
    engine.send(BlockRemoved((2,), group_idx=1))
    assert engine.held(prompt) == 1
    engine.send(BlockRemoved((99,)))
    assert engine.events.blocks["unknown"] == 1


def test_all_blocks_cleared_empties_this_backend_predictions_included() -> None:
    engine = Engine()
    engine.index.record("other", block_hashes(tokens(32)))
    engine.index.record("gpu", block_hashes(tokens(64, start=500)))
    engine.send(stored([1, 2], None, tokens(32)))
    engine.send(AllBlocksCleared())
    assert engine.index.blocks("gpu") == 0 and len(engine.events) == 0
    assert engine.index.blocks("other") == 2
    # The engine starts over: a store chained to a cleared block cannot be placed.
    engine.send(stored([3], 2, tokens(16, start=32)))
    assert engine.events.blocks["unmapped"] == 1 and engine.index.blocks("gpu") == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"medium": "CPU"},
        {"lora_id": 3},
        {"lora_name": "sql-adapter"},
        {"extra_keys": (("image-sha", 0),)},
        {"kv_cache_spec_kind": "sliding_window"},
    ],
)
def test_stores_sluices_token_hash_cannot_stand_for_are_skipped(extra: dict[str, object]) -> None:
    engine = Engine()
    engine.send(stored([1], None, tokens(16), **extra))
    assert engine.index.blocks("gpu") == 0
    assert engine.events.blocks == {"skipped": 1}
    engine.send(BlockRemoved((1,), medium="CPU"))
    assert engine.events.blocks == {"skipped": 2}


def test_the_engine_block_map_is_bounded_and_what_it_drops_leaves_the_index() -> None:
    engine = Engine(max_mapped=4)
    for chain in range(3):
        ids = tokens(32, start=1000 * chain)
        engine.send(stored([10 * chain, 10 * chain + 1], None, ids))
    assert len(engine.events) == 4
    assert engine.held(tokens(32)) == 0  # the oldest chain, no longer followed
    assert engine.held(tokens(32, start=2000)) == 2


def test_sequence_numbers_tell_gaps_from_restarts() -> None:
    engine = Engine()
    events = engine.events
    assert events.continuity(7) == "first"
    engine.seq = 7
    engine.send(stored([1], None, tokens(16)))
    assert events.continuity(8) == "next"
    assert events.continuity(11) == "gap" and events.missing(11) == range(8, 11)
    assert events.continuity(3) == "restart" and events.continuity(7) == "restart"
    events.restart()
    assert engine.index.blocks("gpu") == 0 and events.last_seq is None and events.restarts == 1
    engine.send(stored([1], None, tokens(16)))
    events.rebuild()
    assert engine.index.blocks("gpu") == 0 and events.gaps == {"rebuilt": 1}


def test_silence_while_requests_flow_falls_back_to_prediction() -> None:
    events = Engine().events
    assert events.source(0.0) == "predicted" and events.silence(0.0) == "no event yet"
    events.events_seen()
    assert events.source(0.0) == "events"
    for i in range(SILENT_AFTER_REQUESTS):
        events.request_sent(float(i))
    assert events.source(SILENT_AFTER_SECONDS - 1) == "events"  # not long enough
    assert events.source(SILENT_AFTER_SECONDS) == "predicted"
    assert "silent" in (events.silence(SILENT_AFTER_SECONDS) or "")
    events.events_seen()
    assert events.source(SILENT_AFTER_SECONDS) == "events"
    events.request_sent(0.0)
    assert events.source(1000.0) == "events"  # one quiet request proves nothing


def test_events_that_never_name_a_block_sluice_sent_are_unmatched() -> None:
    engine = Engine()
    events = engine.events
    for i in range(UNMATCHED_AFTER_REQUESTS):
        events.request_sent(float(i))
        engine.index.record("gpu", block_hashes(tokens(80, start=1000 * i)))
        # The engine stores the same prompts under ids of its own.
        engine.send(stored([10 * i + n for n in range(5)], None, tokens(80, start=500_000 + i)))
    assert events.blocks == {"learned": 5 * UNMATCHED_AFTER_REQUESTS}
    assert events.source(20.0) == "predicted"
    assert "unmatched" in (events.silence(20.0) or "")
    # One block it stores is one Sluice sent: its ids are Sluice's after all.
    engine.send(stored([9999], None, tokens(16, start=0)))
    assert events.source(20.0) == "events"


# --- the simulated backend's cache as a publisher ---------------------------------------------


def test_the_sims_cache_tells_what_it_holds_and_an_index_fed_by_it_agrees_at_every_step() -> None:
    """Random prompts sharing prefixes, released or not, through a small cache that must
    evict: after each step the index built from the events alone matches, for every prompt,
    the prefix the cache would serve."""
    cache = PrefixKVCache(num_blocks=24, block_size=16)
    index = BlockIndex(10_000)
    events = BackendKvEvents(index, "gpu", 10_000)
    seq = 0

    def tell(told: list[KVEvent]) -> None:
        nonlocal seq
        events.apply(seq, EventBatch(1.0, tuple(told)), 0.0, 1.0)
        seq += 1

    cache.on_events = tell
    rng = random.Random(7)
    prompts = [tokens(16 * rng.randrange(1, 6), start=100 * rng.randrange(4)) for _ in range(12)]
    held = []
    for step in range(300):
        if step % 97 == 96:
            for allocation in held:
                cache.release(allocation)
            held = []
            cache.evict_all()
        else:
            held.append(cache.allocate(rng.choice(prompts) + tokens(rng.randrange(40), 9000), 4))
            if len(held) > 2:
                cache.release(held.pop(0))
        for prompt in prompts:
            served = len(cache._cached_prefix_blocks(chained_block_hashes(prompt, 16)))
            assert index.match("gpu", block_hashes(prompt)) == served, step
    assert events.events["removed"] and events.events["cleared"] and events.events["stored"]


def test_only_requests_that_make_the_engine_store_blocks_count_towards_silence() -> None:
    assert Prediction(100, 5, ()).stores_blocks  # 6 full blocks, 5 held: one to store
    assert not Prediction(100, 6, ()).stores_blocks  # all held: maybe no event at all
    assert not Prediction(15, 0, ()).stores_blocks  # no full block
