"""`cache_aware`: send a prompt where its prefix is already in KV cache, while load allows. Pure.

For a request with token ids (SMG's parameter names, Sluice's own defaults):
1. Holders: the backends whose held prefix (`BlockIndex`) covers more than
   `cache_threshold` of the prompt.
2. Prefix hit: among holders not too busy (`Balance`), the longest prefix wins; holders
   within a tenth of it count as equal and the least loaded of those takes it.
3. Spread: when every holder is too busy, one more holder, chosen by rendezvous hashing with
   bounded load on the held prefix's tokens, so replicas pick the same one.
4. New prefix: its first holder is chosen by rendezvous hashing with bounded load on its
   first `PLACEMENT_BLOCKS` blocks, so replicas place it alike without sharing anything.
Without token ids (bail-out): rendezvous hash of the rendered prompt's start (`hashing.py`);
prompts shorter than one block: the least-loaded backend.

Index entries are held by (model, backend) in one `BlockIndex` under one bound; a backend's
first model is held under the backend's bare id, where its engine's KV events land
(`app/kv_events/index.py`: they carry no model).

Routing stays O(1) in the prompt's length on the loop: a chain of more than
`RECORD_INLINE_BLOCKS` blocks is queued and `record_pending` records it a slice at a time,
tail first, between other work. Until its head is recorded, a request for the same prefix is
placed the way its first was, by the hash of its first blocks.

`feedback`: a backend that served clearly fewer cached tokens than predicted evicted blocks
Sluice thought it held, and under LRU everything it used before them: those entries go.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from app.fleet.backends import Backend
from app.routing.balance import Balance, least_loaded
from app.routing.block_index import BLOCK_SIZE, BlockIndex, block_hashes
from app.routing.decision import Decision, Prediction, RouteRequest
from app.routing.hashing import route_without_tokens
from app.routing.rendezvous import first_fit

# A reported hit this much (as a share of the prompt) below the prediction means an eviction.
CORRECTION_MARGIN = 0.1
# A new prefix is placed by its first 128 tokens (as `hashing.py` keys on ~128 tokens of
# text): a chat template's preamble and the start of the system prompt, which is what
# requests that can share a KV-cache prefix have in common.
PLACEMENT_BLOCKS = 8
OUTCOMES = ("hit", "miss", "false-hit", "surprise-hit", "unreported")
# Blocks recorded in one piece (~0.3 ms): a longer chain is recorded in slices of this many.
RECORD_SLICE_BLOCKS = 256
# A chain longer than this (~40 us to record) is recorded behind its request, not before its
# endpoint goes out: recording a 4k-token prompt's 256 blocks was most of a decision's time.
RECORD_INLINE_BLOCKS = 32


def _backend_id(backend: Backend) -> str:
    return backend.id


def index_holder(backend: Backend, model: str | None) -> Hashable:
    """Whose blocks the index keeps: the backend's, for one model (its first model's under
    its bare id)."""
    return backend.id if model is None or model == backend.primary else (model, backend.id)


def _holder_backend(holder: Hashable) -> str:
    return holder[1] if isinstance(holder, tuple) else str(holder)


def _hashes(request: RouteRequest, tokens: Sequence[int]) -> Sequence[int]:
    return request.block_hashes if request.block_hashes is not None else block_hashes(tokens)


def _spread_key(tokens: Sequence[int], held_blocks: int) -> bytes:
    """What names a held prefix for rendezvous hashing, the same in every replica and of a
    bounded size: its first blocks, its last block and its length."""
    head = tokens[: PLACEMENT_BLOCKS * BLOCK_SIZE]
    last = tokens[(held_blocks - 1) * BLOCK_SIZE : held_blocks * BLOCK_SIZE]
    return _token_bytes(head) + _token_bytes(last) + b"%d" % held_blocks


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """The same bytes for the same ids in every replica, whatever sequence type holds them."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    try:
        return array("I", token_ids).tobytes()
    except OverflowError:
        return b",".join(str(token).encode() for token in token_ids)


@dataclass(slots=True)
class _Pending:
    """A chain routed and not recorded yet: `hashes[:end]` are still to go in."""

    holder: Hashable
    hashes: Sequence[int]
    end: int


@dataclass
class PredictionTally:
    """cache_aware's predictions against what the backends reported, summed (`feedback`)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    predicted_tokens: int = 0
    reported_cached_tokens: int = 0
    # Shares of the prompt, summed over reported answers: unit-free, so comparable even
    # when the backend counts tokens with another tokenizer.
    predicted_share_total: float = 0.0
    reported_share_total: float = 0.0
    reported: int = 0
    corrections: int = 0  # reported hits that showed an eviction: the index corrected
    corrected_blocks: int = 0

    def snapshot(self) -> PredictionStats:
        reported = max(self.reported, 1)
        return {
            "outcomes": {outcome: self.outcomes[outcome] for outcome in OUTCOMES},
            "predicted_cached_tokens": self.predicted_tokens,
            "reported_cached_tokens": self.reported_cached_tokens,
            "mean_predicted_hit": self.predicted_share_total / reported,
            "mean_reported_hit": self.reported_share_total / reported,
            "corrections": self.corrections,
            "corrected_blocks": self.corrected_blocks,
        }


class CacheAware:
    name = "cache_aware"

    def __init__(self, cache_threshold: float, balance: Balance, max_index_blocks: int) -> None:
        self.cache_threshold = cache_threshold
        self.balance = balance
        self.index = BlockIndex(max_index_blocks)
        self._turn = 0  # shares keyless work among equally loaded backends
        self.predictions = PredictionTally()
        self.pending: deque[_Pending] = deque()  # long chains to record, oldest first
        self._pending_blocks = 0

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        tokens = request.token_ids
        self._turn += 1
        if tokens is None:
            return route_without_tokens(candidates, request, self.balance, self._turn)
        hashes = _hashes(request, tokens)
        if not hashes:  # shorter than one block: nothing any backend could cache
            return Decision(least_loaded(candidates, turn=self._turn), "least-load")
        model = request.model
        min_load = min(b.load for b in candidates)
        needed = self.cache_threshold * len(tokens)
        holders: list[tuple[int, Backend]] = []
        for backend in candidates:
            blocks = self.index.match(index_holder(backend, model), hashes)
            if blocks and blocks * BLOCK_SIZE > needed:
                holders.append((blocks, backend))

        allowed = [h for h in holders if not self.balance.overloaded(h[1].load, min_load)]
        if allowed:
            best = max(blocks for blocks, _ in allowed)
            near = [h for h in allowed if h[0] >= best - max(1, best // 10)]
            blocks, backend = min(near, key=lambda h: (h[1].load, -h[0]))
            reason = "prefix-hit"
        elif holders:
            best = max(blocks for blocks, _ in holders)
            holding = {id(b) for _, b in holders}
            others = [b for b in candidates if id(b) not in holding]
            key = _spread_key(tokens, best)
            backend, _ = first_fit(
                key, others, _backend_id, lambda b: not self.balance.overloaded(b.load, min_load)
            )
            blocks = self.index.match(index_holder(backend, model), hashes)
            reason = "spread"
        else:
            key = _token_bytes(tokens[: min(len(hashes), PLACEMENT_BLOCKS) * BLOCK_SIZE])
            backend, _ = first_fit(
                key,
                candidates,
                _backend_id,
                lambda b: not self.balance.overloaded(b.load, min_load),
            )
            blocks = self.index.match(index_holder(backend, model), hashes)
            reason = "new-prefix"
        holder = index_holder(backend, model)
        stamps = tuple(self.index.stamps(holder, hashes[:blocks]))
        if len(hashes) <= RECORD_INLINE_BLOCKS:
            self.index.record(holder, hashes)
        else:
            self._queue(_Pending(holder, hashes, len(hashes)))
        return Decision(backend, reason, Prediction(len(tokens), blocks, stamps, holder))

    def _queue(self, chain: _Pending) -> None:
        # Bounded like the index: past it, the oldest chains are dropped unrecorded (a hint
        # lost, as an eviction would lose it).
        self.pending.append(chain)
        self._pending_blocks += chain.end
        while self._pending_blocks > self.index.max_blocks:
            self._pending_blocks -= self.pending.popleft().end

    def record_pending(self, most: int = RECORD_SLICE_BLOCKS) -> bool:
        """Record up to `most` blocks of the queued chains, oldest chain first; whether any
        are left."""
        while most > 0 and self.pending:
            chain = self.pending[0]
            start = self.index.record_tail(chain.holder, chain.hashes, chain.end, most)
            most -= chain.end - start
            self._pending_blocks -= chain.end - start
            chain.end = start
            if not start:
                self.pending.popleft()
        return bool(self.pending)

    def holder(self, candidates: Sequence[Backend], request: RouteRequest) -> Backend | None:
        """The candidate holding the longest prefix of the prompt over the threshold,
        however busy: where a request held at the proxy would rather go."""
        tokens = request.token_ids
        if tokens is None:
            return None
        hashes = _hashes(request, tokens)
        needed = self.cache_threshold * len(tokens)
        best, found = 0, None
        for backend in candidates:
            blocks = self.index.match(index_holder(backend, request.model), hashes)
            if blocks > best and blocks * BLOCK_SIZE > needed:
                best, found = blocks, backend
        return found

    def record(self, backend: Backend, request: RouteRequest) -> None:
        """`backend` holds the prompt's blocks now, though the policy did not send it there:
        a decode engine the prefill's KV cache was transferred to."""
        tokens = request.token_ids
        if tokens is None:
            return
        hashes = _hashes(request, tokens)
        holder = index_holder(backend, request.model)
        if len(hashes) <= RECORD_INLINE_BLOCKS:
            self.index.record(holder, hashes)
        else:
            self._queue(_Pending(holder, hashes, len(hashes)))

    def held_tokens(self, candidates: Sequence[Backend], request: RouteRequest) -> int:
        """The longest prefix of the prompt one of the candidates is believed to hold, in
        tokens (0 without token ids): what a prefill there would not compute."""
        tokens = request.token_ids
        if tokens is None:
            return 0
        hashes = _hashes(request, tokens)
        blocks = max(
            (self.index.match(index_holder(b, request.model), hashes) for b in candidates),
            default=0,
        )
        return min(blocks * BLOCK_SIZE, len(tokens))

    def feedback(
        self, decision: Decision, cached_tokens: int | None, reported_prompt_tokens: int | None
    ) -> str:
        """Compare a backend's reported prefix hit with the prediction; correct the index.

        Token counts are compared as shares of the prompt: the backend may count tokens with
        another tokenizer than Sluice's. Returns the outcome (one of `OUTCOMES`).
        """
        prediction, tally = decision.prediction, self.predictions
        if prediction is None or cached_tokens is None or not reported_prompt_tokens:
            tally.outcomes["unreported"] += 1
            return "unreported"
        predicted = prediction.cached_tokens
        tally.predicted_tokens += predicted
        tally.reported_cached_tokens += cached_tokens
        if predicted and cached_tokens:
            outcome = "hit"
        elif predicted:
            outcome = "false-hit"
        else:
            outcome = "surprise-hit" if cached_tokens else "miss"
        tally.outcomes[outcome] += 1

        actual_share = min(cached_tokens / reported_prompt_tokens, 1.0)
        predicted_share = predicted / prediction.prompt_tokens
        tally.predicted_share_total += predicted_share
        tally.reported_share_total += actual_share
        tally.reported += 1
        kept = int(actual_share * prediction.prompt_tokens) // BLOCK_SIZE
        if actual_share < predicted_share - CORRECTION_MARGIN and kept < len(prediction.stamps):
            holder = prediction.holder or decision.backend.id
            removed = self.index.forget_before(holder, prediction.stamps[kept])
            tally.corrections += 1
            tally.corrected_blocks += removed
        return outcome

    def forget(self, backend: Backend) -> None:
        """Every model's blocks of a backend that left the pool."""
        for chain in [c for c in self.pending if _holder_backend(c.holder) == backend.id]:
            self.pending.remove(chain)
            self._pending_blocks -= chain.end
        for holder in self.index.backends():
            if _holder_backend(holder) == backend.id:
                self.index.remove_backend(holder)

    def _blocks_by_backend(self) -> dict[str, int]:
        """Index entries by backend id, every model's together."""
        totals: dict[str, int] = {}
        for holder in self.index.backends():
            name = _holder_backend(holder)
            totals[name] = totals.get(name, 0) + self.index.blocks(holder)
        return totals

    def snapshot(self) -> CacheAwareSnapshot:
        return {
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance.abs_threshold,
            "balance_rel_threshold": self.balance.rel_threshold,
            "index": {
                "blocks": len(self.index),
                "max_blocks": self.index.max_blocks,
                "block_size": BLOCK_SIZE,
                "evictions": self.index.evictions,
                "by_backend": self._blocks_by_backend(),
            },
            "prediction": self.predictions.snapshot(),
        }


class IndexStats(TypedDict):
    blocks: int
    max_blocks: int
    block_size: int
    evictions: int
    by_backend: dict[str, int]  # entries by backend id, every model's together


class PredictionStats(TypedDict):
    outcomes: dict[str, int]  # hit, miss, false-hit, surprise-hit, unreported
    predicted_cached_tokens: int
    reported_cached_tokens: int
    mean_predicted_hit: float
    mean_reported_hit: float
    corrections: int
    corrected_blocks: int


class CacheAwareSnapshot(TypedDict):
    """`routing.cache_aware` in the dashboard's snapshot: the index and its predictions."""

    cache_threshold: float
    balance_abs_threshold: float
    balance_rel_threshold: float
    index: IndexStats
    prediction: PredictionStats
