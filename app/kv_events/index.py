"""One backend's KV events applied to the prefix index, and whether they can be trusted. Pure.

The engine names its blocks by its own hashes (sha256 of the parent's hash, the tokens and
whatever else it keys on); Sluice names them by chained hashes of 16 token ids
(`block_index.py`). A `BlockStored` carries the parent's engine hash and the new blocks'
token ids, so each engine block is mapped to the Sluice chain it ends: the Sluice blocks it
completes, and the tokens past the last complete one (an engine whose blocks are not 16
tokens long, SGLang's pages of 1 for instance, completes a Sluice block every few events).
`BlockRemoved` drops the Sluice blocks its engine blocks completed (counted, since two
engine blocks may complete the same one: the same tokens under two cache salts),
`AllBlocksCleared` and an engine restart drop the backend's whole index. Stores that Sluice's
hash cannot stand for are skipped: other media than the GPU (an offloaded copy), LoRA
adapters, per-block extra keys (images, cache salts), attention groups other than full
attention. Between a routing decision and its events the prediction stands (`record` by the
policy), and what the events add never leaves the bound: the map of engine blocks holds at
most `max_mapped` entries and, least recently stored first, drops what it can no longer
follow from the index too.

Sequence numbers tell a gap (messages lost: replay them, or rebuild) from a restart (the
counter went back). A publisher that says nothing while requests flow to its backend is
silent: the index falls back to prediction alone, and says so, until events come again.
Events that never name a block Sluice sent are unmatched, and said so the same way: the
engine tokenizes or renders prompts otherwise than Sluice, and its blocks cannot be found.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable
from typing import Literal, TypedDict

from app.errors import require_at_least
from app.kv_events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
)
from app.routing.block_index import BLOCK_SIZE, ROOT_HASH, BlockIndex, chain_hashes

# Silent: at least this many requests sent to the backend that make it store blocks (the
# router counts only those whose prompt has full blocks it did not hold), and this long
# since the first of them, without one event.
SILENT_AFTER_REQUESTS = 4
SILENT_AFTER_SECONDS = 10.0
# Unmatched: this many blocks stored and this many requests sent that make the engine store
# blocks, without one stored block being one Sluice predicted: the engine's token ids are
# not Sluice's (another tokenizer, or its own chat template on forwarded text).
UNMATCHED_AFTER_BLOCKS = 100
UNMATCHED_AFTER_REQUESTS = 20
FULL_ATTENTION = "full_attention"

Continuity = Literal["first", "next", "gap", "restart"]
Source = Literal["events", "predicted"]


class KvEventsState(TypedDict):
    """What one backend's KV events did to the index, for the dashboard."""

    source: Source  # what the index of it stands on now
    silence: str | None  # why it stands on prediction alone
    last_seq: int | None
    batches: int
    events: dict[str, int]  # by kind
    blocks: dict[str, int]  # by outcome: learned, confirmed, removed, unknown, ...
    restarts: int
    gaps: dict[str, int]  # replayed, rebuilt
    bad_messages: int
    mapped_blocks: int
    max_mapped_blocks: int
    last_lag_s: float | None  # the last batch's, from the engine's timestamp


# One engine block, followed: (tail, leftover, completed). `tail`: the Sluice hash of the
# last complete 16-token block up to this block's end; `leftover`: the tokens after it,
# fewer than 16; `completed`: the Sluice blocks whose last token is in this block. An
# engine block of 16 tokens that completes one Sluice block, the usual case, is stored as
# that block's hash alone: a map of ints is nothing the garbage collector walks into, and
# hundreds of thousands of tuples would lengthen its full collections (app/README.md).
_Mapped = tuple[int, tuple[int, ...], tuple[int, ...]]
_Key = EngineHash | tuple[int | None, EngineHash]


def _packed(tail: int, leftover: tuple[int, ...], completed: tuple[int, ...]) -> int | _Mapped:
    return tail if not leftover and completed == (tail,) else (tail, leftover, completed)


def _unpacked(value: int | _Mapped) -> _Mapped:
    return (value, (), (value,)) if isinstance(value, int) else value


def _key(group: int | None, engine_hash: EngineHash) -> _Key:
    """Engine hashes of the first (often only) KV-cache group stand for themselves."""
    return engine_hash if not group else (group, engine_hash)


class BackendKvEvents:
    """What one backend's engine published, applied to `index` under the key `backend`."""

    def __init__(self, index: BlockIndex, backend: Hashable, max_mapped: int) -> None:
        require_at_least(1, max_mapped=max_mapped)
        self.index = index
        self.backend = backend
        self.max_mapped = max_mapped
        self._mapped: OrderedDict[_Key, int | _Mapped] = OrderedDict()  # oldest first
        self._holders: dict[int, int] = {}  # Sluice block -> engine blocks completing it
        self.last_seq: int | None = None
        # Counted for metrics and the dashboard.
        self.events: Counter[str] = Counter()  # by kind
        self.blocks: Counter[str] = Counter()  # by outcome
        self.batches = 0
        self.restarts = 0
        self.bad_messages = 0
        self.gaps: Counter[str] = Counter()  # by outcome: replayed, rebuilt
        self.last_lag: float | None = None
        # Silence: requests sent since the last event, and when the first of them went.
        self.received_any = False
        self._unanswered = 0
        self._unanswered_since: float | None = None
        self._storing_sent = 0

    def __len__(self) -> int:
        return len(self._mapped)

    # --- sequence numbers ----------------------------------------------------------------

    def continuity(self, seq: int) -> Continuity:
        last = self.last_seq
        if last is None:
            return "first"
        if seq == last + 1:
            return "next"
        return "gap" if seq > last + 1 else "restart"

    def missing(self, seq: int) -> range:
        """The sequence numbers lost before `seq` (after a "gap")."""
        return range(0 if self.last_seq is None else self.last_seq + 1, seq)

    def restart(self) -> None:
        """The engine restarted (its counter went back): it holds nothing we know of."""
        self.restarts += 1
        self.clear()
        self.last_seq = None

    def rebuild(self) -> None:
        """Lost messages could not be replayed: what the index holds may be wrong."""
        self.gaps["rebuilt"] += 1
        self.clear()

    def clear(self) -> None:
        """Forget the backend's blocks, predicted ones included: prediction and the next
        events rebuild them."""
        self._mapped.clear()
        self._holders.clear()
        self.index.remove_backend(self.backend)

    # --- events --------------------------------------------------------------------------

    def apply(self, seq: int, batch: EventBatch, now: float, wall_time: float) -> None:
        """Apply one batch that arrived at `now` (monotonic) and `wall_time` (the engine's
        `ts` is the wall clock of its host)."""
        self.last_seq = seq
        self.batches += 1
        self.last_lag = max(wall_time - batch.ts, 0.0)
        self.events_seen()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.events["stored"] += 1
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self.events["removed"] += 1
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.events["cleared"] += 1
                self.clear()
            else:
                self.events["other"] += 1

    def _stored(self, event: BlockStored) -> None:
        count = len(event.block_hashes)
        if not _indexable(event):
            self.blocks["skipped"] += count
            return
        group = event.group_idx
        leftover: tuple[int, ...]
        if event.parent_block_hash is None:
            tail, leftover = ROOT_HASH, ()
        else:
            parent = self._mapped.get(_key(group, event.parent_block_hash))
            if parent is None:  # stored before we listened, or beyond the bound
                self.blocks["unmapped"] += count
                return
            tail, leftover, _ = _unpacked(parent)
        size = event.block_size
        added: list[int] = []
        for i, engine_hash in enumerate(event.block_hashes):
            run = leftover + event.token_ids[i * size : (i + 1) * size]
            completed = tuple(chain_hashes(tail, run))
            if completed:
                tail = completed[-1]
                leftover = run[len(completed) * BLOCK_SIZE :]
            else:
                leftover = run
            key = _key(group, engine_hash)
            self._release(self._mapped.pop(key, None))
            self._mapped[key] = _packed(tail, leftover, completed)
            for block in completed:
                self._holders[block] = self._holders.get(block, 0) + 1
            added.extend(completed)
        if added:
            known = len(self.index.stamps(self.backend, added))
            if known:
                self.blocks["confirmed"] += known
            if known < len(added):
                self.blocks["learned"] += len(added) - known
            self.index.record(self.backend, added)
        while len(self._mapped) > self.max_mapped:
            _, oldest = self._mapped.popitem(last=False)
            self._release(oldest)

    def _removed(self, event: BlockRemoved) -> None:
        if not _on_gpu(event.medium):
            self.blocks["skipped"] += len(event.block_hashes)
            return
        for engine_hash in event.block_hashes:
            mapped = self._mapped.pop(_key(event.group_idx, engine_hash), None)
            if mapped is None:
                self.blocks["unknown"] += 1
            else:
                self.blocks["removed"] += 1
                self._release(mapped)

    def _release(self, mapped: int | _Mapped | None) -> None:
        """An engine block is gone (or no longer followed): the Sluice blocks nothing else
        completes leave the index."""
        if mapped is None:
            return
        gone = []
        for block in _unpacked(mapped)[2]:
            left = self._holders[block] - 1
            if left:
                self._holders[block] = left
            else:
                del self._holders[block]
                gone.append(block)
        if gone:
            self.index.discard(self.backend, gone)

    # --- silence -------------------------------------------------------------------------

    def request_sent(self, now: float) -> None:
        if self._unanswered_since is None:
            self._unanswered_since = now
        self._unanswered += 1
        self._storing_sent += 1

    def events_seen(self) -> None:
        self.received_any = True
        self._unanswered = 0
        self._unanswered_since = None

    def source(self, now: float) -> Source:
        return "events" if self.silence(now) is None else "predicted"

    def silence(self, now: float) -> str | None:
        """Why the index stands on prediction alone, or None while events are trusted."""
        if self._unanswered >= SILENT_AFTER_REQUESTS and self._unanswered_since is not None:
            waited = now - self._unanswered_since
            if waited >= SILENT_AFTER_SECONDS:
                return f"silent: {self._unanswered} requests in {waited:.0f}s without an event"
        learned = self.blocks["learned"]
        if (
            not self.blocks["confirmed"]
            and learned >= UNMATCHED_AFTER_BLOCKS
            and self._storing_sent >= UNMATCHED_AFTER_REQUESTS
        ):
            return (
                f"unmatched: {learned} blocks stored, none of them one Sluice sent: the "
                "engine's token ids are not Sluice's (its tokenizer or chat template)"
            )
        if not self.received_any:
            return "no event yet"
        return None

    def snapshot(self, now: float) -> KvEventsState:
        return {
            "source": self.source(now),
            "silence": self.silence(now),
            "last_seq": self.last_seq,
            "batches": self.batches,
            "events": dict(self.events),
            "blocks": dict(self.blocks),
            "restarts": self.restarts,
            "gaps": dict(self.gaps),
            "bad_messages": self.bad_messages,
            "mapped_blocks": len(self._mapped),
            "max_mapped_blocks": self.max_mapped,
            "last_lag_s": self.last_lag,
        }


def _on_gpu(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


def _indexable(event: BlockStored) -> bool:
    """Blocks a request keyed only by its token ids would hit."""
    return (
        _on_gpu(event.medium)
        and event.lora_id is None
        and event.lora_name is None
        and (event.extra_keys is None or all(key is None for key in event.extra_keys))
        and event.kv_cache_spec_kind in (None, FULL_ATTENTION)
    )
