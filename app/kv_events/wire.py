"""vLLM's KV-cache events on the wire (SGLang publishes the same), decoded and encoded. Pure.

An engine started with `--kv-events-config` publishes on a ZMQ PUB socket one multipart
message per scheduler step: `[topic, seq, payload]`, where `seq` is an 8-byte big-endian
counter from 0 and `payload` a msgpack `EventBatch` (vllm/distributed/kv_events.py):
`[ts, events, data_parallel_rank]`, the last one optional. Each event is tagged by its class
name, in one of two encodings:

- positional (vLLM before #42892 and SGLang until 2026: msgspec `array_like=True`):
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`,
  trailing fields left out when they hold their default;
- by name (vLLM since #42892): `{"type": "BlockStored", "block_hashes": ..., ...}`.

Both are read, any field a newer engine adds is ignored, and a batch may itself be a map
(`{"ts", "events", "data_parallel_rank"}`). Block hashes are opaque: ints (SGLang, vLLM with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) or bytes (vLLM's sha256 digests by default).

The replay socket (ROUTER) answers a request `[b"", start_seq]` from a DEALER with
`[b"", seq, payload]` for each buffered message from `start_seq` on, then
`[b"", END_SEQ, b""]`.

Anything malformed raises `BadMessage`; an event of a kind Sluice does not know is kept as
`OtherEvent` (newer engines may add kinds), so one odd event never costs its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

from app.errors import WireError

EngineHash = int | bytes
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MEDIUM_GPU = "GPU"


class BadMessage(WireError, ValueError):
    """A message or an event that is not vLLM's KV-event format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Per block: what besides token ids went into its hash (images, LoRA name, cache salt).
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class OtherEvent:
    kind: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | OtherEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


def split_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """`[topic, seq, payload]` from the PUB socket -> (topic, seq, payload)."""
    if len(frames) != 3:
        raise BadMessage(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), _seq(seq), bytes(payload)


def split_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """`[b"", seq, payload]` from the replay socket -> (seq, payload); None at the end."""
    if len(frames) != 3 or frames[0]:
        raise BadMessage(f"expected a replay answer [b'', seq, payload], got {len(frames)} frames")
    if bytes(frames[1]) == END_SEQ:
        return None
    return _seq(frames[1]), bytes(frames[2])


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay ROUTER to get every buffered message from `start_seq`."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


def _seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise BadMessage(f"sequence number of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError) as exc:  # msgpack's errors subclass ValueError
        raise BadMessage(f"not msgpack: {exc}") from None
    fields = _fields(raw, _BATCH_FIELDS, "batch")
    ts, events = fields.get("ts"), fields.get("events")
    if not _is_number(ts) or not isinstance(events, list):
        raise BadMessage("a batch is [ts, events, data_parallel_rank]")
    rank = fields.get("data_parallel_rank")
    return EventBatch(float(ts), tuple(_event(e) for e in events), rank if _is_int(rank) else None)


def _fields(raw: Any, names: Sequence[str], what: str) -> dict[str, Any]:
    """A struct encoded by position or by name, as {name: value} (absent ones left out)."""
    if isinstance(raw, list):
        return dict(zip(names, raw, strict=False))
    if isinstance(raw, dict):
        return raw
    raise BadMessage(f"a {what} must be an array or a map, not {type(raw).__name__}")


def _event(raw: Any) -> KVEvent:
    body: list[Any] | dict[Any, Any]
    if isinstance(raw, list) and raw:
        kind, body = raw[0], raw[1:]
    elif isinstance(raw, dict):
        kind, body = raw.get("type"), raw
    else:
        raise BadMessage("an event must be a tagged array or map")
    if not isinstance(kind, str):
        raise BadMessage("an event's tag must be a string")
    if kind == "BlockStored":
        return _stored(_fields(body, _STORED_FIELDS, kind))
    if kind == "BlockRemoved":
        fields = _fields(body, _REMOVED_FIELDS, kind)
        return BlockRemoved(
            _hashes(fields.get("block_hashes")),
            _optional_str(fields.get("medium")),
            _optional_int(fields.get("group_idx")),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return OtherEvent(kind[:64])


def _stored(fields: dict[str, Any]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    token_ids = fields.get("token_ids")
    block_size = fields.get("block_size")
    if not _is_int(block_size) or block_size < 1:
        raise BadMessage("BlockStored needs a positive block_size")
    if not isinstance(token_ids, list) or not all(_is_int(t) and t >= 0 for t in token_ids):
        raise BadMessage("BlockStored token_ids must be a list of non-negative ints")
    if len(token_ids) != len(hashes) * block_size:
        raise BadMessage(
            f"BlockStored has {len(token_ids)} token ids for {len(hashes)} blocks of {block_size}"
        )
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    return BlockStored(
        hashes,
        None if parent is None else _hash(parent),
        tuple(token_ids),
        block_size,
        _optional_int(fields.get("lora_id")),
        _optional_str(fields.get("medium")),
        _optional_str(fields.get("lora_name")),
        tuple(extra) if isinstance(extra, list) else None,
        _optional_int(fields.get("group_idx")),
        _optional_str(fields.get("kv_cache_spec_kind")),
    )


def _hashes(raw: Any) -> tuple[EngineHash, ...]:
    if not isinstance(raw, list):
        raise BadMessage("block_hashes must be a list")
    return tuple(_hash(h) for h in raw)


def _hash(raw: Any) -> EngineHash:
    if _is_int(raw) or isinstance(raw, bytes):
        return raw
    raise BadMessage(f"a block hash is an int or bytes, not {type(raw).__name__}")


def _optional_int(raw: Any) -> int | None:
    if raw is None or _is_int(raw):
        return raw
    raise BadMessage(f"expected an int or nil, got {type(raw).__name__}")


def _optional_str(raw: Any) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    raise BadMessage(f"expected a string or nil, got {type(raw).__name__}")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- encoding, as current vLLM does (the simulated backend publishes with it) -----------------


def encode_batch(batch: EventBatch) -> bytes:
    """The batch as vLLM since #42892 writes it: the batch positional, each event a map with
    its tag under "type", fields without a default always written (msgspec's omit_defaults)."""
    events = [_event_map(event) for event in batch.events]
    body: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def _event_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = list(event.extra_keys)
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        if event.kv_cache_spec_kind is not None:
            out["kv_cache_spec_kind"] = event.kv_cache_spec_kind
        return out
    if isinstance(event, BlockRemoved):
        removed: dict[str, Any] = {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    return {"type": event.kind}


def publish_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq.to_bytes(SEQ_BYTES, "big"), payload]
