"""The proxy's one door into routing: admit, choose, release.

Everything is per model pool: `admit` applies the tokens-per-minute limit of the request's (API
key, model) before anything is forwarded. `choose` goes through the pool's gate (gate.py): the
policy chooses among the backends of the request's model that take traffic and whose engines
have room (for a LoRA adapter, those of the best affinity tier: adapter_affinity.py), or the
request is held, unrouted, until one has (fairly across API keys), or is refused with
`Overloaded` (a 429). The chosen backend's in-flight count and pending prompt tokens are
reserved at once (no await in between, so two requests never both take the last
room); `started` says its answer's first byte came (the engine runs it: it left the engine's
queue, and a held request may take its place there); `release` gives the reservation back,
lets held requests of the backend's pools leave, and
feeds the backend's reported usage to the policy (cache_aware checks its prediction) and to
the token limiter (completion tokens). Backends added or removed at run time go through here
too, so the index forgets a removed backend.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NotRequired, Protocol, TypedDict

import trio

from app.budgets.buckets import TokenBuckets
from app.budgets.shared import SharedBudgets
from app.config import BackendRole
from app.fleet.backends import Backend
from app.fleet.discovery import API_SOURCE
from app.fleet.pool import BackendPool
from app.fleet.saturation import queued_ours
from app.models import NO_MODEL
from app.routing.adapter_affinity import best_tier, is_adapter
from app.routing.admission import ANYONE, Admission
from app.routing.block_index import BLOCK_SIZE, ROOT_HASH, chain_hashes
from app.routing.cache_aware import CacheAware, CacheAwareSnapshot
from app.routing.decision import Decision, Policy, RouteRequest
from app.routing.gate import Gate, GateLimits
from app.routing.metrics import RoutingMetrics
from app.routing.policies import RoutingParams, make_policy
from app.routing.refusal import Overloaded, ShedReason
from app.routing.usage import Usage

log = logging.getLogger("sluice.router")

# Without token ids, prompt tokens are estimated at four characters a token.
CHARS_PER_TOKEN = 4
# A prompt's block hashes are computed on the loop, ~85 us a slice of this many tokens, with
# a checkpoint between slices. A thread was slower: its result waits for the GIL behind a busy
# loop (at 100 req/s of 4k-token prompts the decision's p90 was 4.3 ms through a thread, 0.35
# on the loop).
HASH_SLICE_TOKENS = 512 * BLOCK_SIZE


@dataclass(frozen=True)
class RouterSettings:
    """What the router reads of the configuration (start-up cuts it from the flags)."""

    policy: str  # --policy
    params: RoutingParams
    # The gate's limits (GateLimits, under the flags' names).
    max_inflight_per_backend: int | None
    max_kv_usage: float
    max_queued_per_backend: int
    admission_queue: int
    admission_queue_per_key: int
    admission_timeout: float
    tokens_per_minute: int  # per API key and model, unless a key has its own; 0: no limit
    budget_replicas: int  # processes holding a share of each budget: --workers
    shared_budgets: bool  # --redis-url: budgets shared with other replicas through Redis
    budget_sync_interval: float


def estimated_tokens(request: RouteRequest) -> int:
    if request.token_ids is not None:
        return len(request.token_ids)
    return len(request.text or "") // CHARS_PER_TOKEN


def budgets_for(settings: RouterSettings) -> TokenBuckets | SharedBudgets:
    """Every (key, model) budget, as deep as the key's own limit (--api-keys) or
    --tokens-per-minute: a process's own buckets, as ever; the shared layer with
    --redis-url, or with --workers N alone (each worker then holds 1/N of every budget)."""
    if not settings.shared_budgets and settings.budget_replicas == 1:
        return TokenBuckets()
    return SharedBudgets(
        settings.tokens_per_minute,
        local_replicas=settings.budget_replicas,
        shared=settings.shared_budgets,
        sync_interval=settings.budget_sync_interval,
    )


class EngineEvents(Protocol):
    """A backend's KV events as routing sees them (app/kv_events/index.py keeps them): told
    when a request that stores blocks is sent, cleared when the backend leaves."""

    def request_sent(self, now: float) -> None: ...

    def clear(self) -> None: ...


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        pool: BackendPool,
        metrics: RoutingMetrics,
        policy: Policy | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.policy = policy or make_policy(settings.policy, params=settings.params)
        self.requests = 0  # requests that asked for a backend so far: whether traffic flows
        self._requested = trio.Event()  # set by the next one (`next_request`)
        limits = GateLimits(
            ceiling=settings.max_inflight_per_backend,
            max_kv_usage=settings.max_kv_usage,
            max_queued=settings.max_queued_per_backend,
            max_held=settings.admission_queue,
            max_per_tenant=settings.admission_queue_per_key,
            timeout=settings.admission_timeout,
        )
        holder = self.policy.holder if isinstance(self.policy, CacheAware) else None
        self.gate = Gate(
            pool,
            self._route,
            lambda decision: self.release(decision, None),
            limits,
            metrics.admission,
            prefers=holder,
            refused=self._count_refusal,
        )
        self.tokens_per_minute = settings.tokens_per_minute
        self.buckets = budgets_for(settings)
        self.rejected: dict[str, int] = {}
        # By backend URL, for backends whose engine's KV events feed the index: they are
        # told when a request goes there that will make the engine store blocks (silence
        # while such requests flow is a publisher gone).
        self.kv_events: dict[str, EngineEvents] = {}
        metrics.admission_waiting.set_function(lambda: self.gate.held)
        metrics.admission_held.set_function(
            lambda: [(model or NO_MODEL, len(queue)) for model, queue in self.gate.queues.items()]
        )
        metrics.saturation_signal.set_function(self.gate.signals)
        metrics.backend_inflight.set_function(
            lambda: [(backend.url, backend.inflight) for backend in pool.backends]
        )
        metrics.backend_saturated.set_function(
            lambda: [(b.url, float(self.gate.saturated(b) is not None)) for b in pool.backends]
        )
        metrics.backend_room.set_function(
            lambda: [
                ((b.url, b.room.basis), math.inf if b.room.room is None else b.room.room)
                for b in pool.backends
            ]
        )
        metrics.backend_queued.set_function(
            lambda: [(b.url, queued_ours(b, trio.current_time())) for b in pool.backends]
        )
        self._cache_aware = self.policy if isinstance(self.policy, CacheAware) else None
        self._chain_queued = trio.Event()  # set when a long chain waits to be recorded
        if self._cache_aware is not None:
            index = self._cache_aware.index
            metrics.route_index_blocks.set_function(lambda: len(index))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The gate's watch, and the long prompts' blocks recorded behind their requests."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.gate.run)
            if self._cache_aware is not None:
                nursery.start_soon(self._record_behind, self._cache_aware)
            task_status.started()

    async def _record_behind(self, policy: CacheAware) -> None:
        """A slice at a time (~0.3 ms), other tasks running in between."""
        while True:
            if not policy.pending:
                self._chain_queued = trio.Event()
                await self._chain_queued.wait()
            policy.record_pending()
            await trio.lowlevel.checkpoint()

    def budget(self, per_minute: int | None) -> int:
        """Tokens per minute for a key: its own limit, else --tokens-per-minute (0: none)."""
        return per_minute or self.tokens_per_minute

    def admit(
        self, api_key: str, model: str | None, prompt_tokens: int, per_minute: int | None = None
    ) -> None:
        """Take the prompt's tokens from the (key, model) budget, or raise `Overloaded`."""
        limit = self.budget(per_minute)
        if not limit:
            return
        wait = self.buckets.take((api_key, model), prompt_tokens, trio.current_time(), limit)
        if wait == 0.0:
            return
        scope = "its API key" if model is None else f"its API key and model {model}"
        if math.isinf(wait):
            refusal = Overloaded(
                ShedReason.REQUEST_TOO_LARGE,
                f"This request's {prompt_tokens} prompt tokens exceed the limit of "
                f"{limit} tokens per minute for {scope}.",
                60.0,
            )
        else:
            refusal = Overloaded(
                ShedReason.TOKENS_PER_MINUTE,
                f"Rate limit reached: {limit} tokens per minute for {scope}; retry in {wait:.1f}s.",
                wait,
            )
        self._count_refusal(model, refusal.reason)
        raise refusal

    async def choose(
        self,
        request: RouteRequest,
        exclude: tuple[Backend, ...] = (),
        admission: Admission = ANYONE,
    ) -> Decision | None:
        """A reserved decision among the backends of `request.model` (all of them when it is
        None) whose engines have room, at once or once one has; None when none takes
        traffic at all. `Overloaded` when held too long, or shed."""
        self.requests += 1
        self._requested.set()
        tokens = request.token_ids
        if (
            self._cache_aware is not None
            and tokens is not None
            and len(tokens) > HASH_SLICE_TOKENS
            and request.block_hashes is None
        ):
            request.block_hashes = await block_hashes_in_slices(tokens)
        return await self.gate.enter(request, exclude, admission)

    async def prompt_held(self, request: RouteRequest, candidates: Sequence[Backend]) -> int:
        """Prompt tokens the best of `candidates` is believed to hold already (0 without a
        prefix index): the part of a prefill that costs nothing there."""
        policy, tokens = self._cache_aware, request.token_ids
        if policy is None or tokens is None:
            return 0
        if len(tokens) > HASH_SLICE_TOKENS and request.block_hashes is None:
            request.block_hashes = await block_hashes_in_slices(tokens)
        return policy.held_tokens(candidates, request)

    def holds_prompt(self, backend: Backend, request: RouteRequest) -> None:
        """`backend` was given the prompt's KV cache (a decode engine, by transfer)."""
        if self._cache_aware is not None:
            self._cache_aware.record(backend, request)
            if self._cache_aware.pending:
                self._chain_queued.set()

    def _route(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        adapter = request.model if is_adapter(request.model, candidates) else None
        if adapter is not None:
            candidates, tier = best_tier(candidates, adapter)
            self.metrics.lora_routes.labels(tier=tier).inc()
        decision = self._reserve(self.policy.choose(candidates, request), request)
        if adapter is not None:
            decision.backend.adapters.used((adapter,), trio.current_time())
        if self._cache_aware is not None and self._cache_aware.pending:
            self._chain_queued.set()
        return decision

    def _count_refusal(self, model: str | None, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.metrics.admission_rejected.labels(reason=reason).inc()

    def _reserve(self, decision: Decision, request: RouteRequest) -> Decision:
        prediction = decision.prediction
        cached = prediction.cached_tokens if prediction is not None else 0
        pending = max(estimated_tokens(request) - cached, 0)
        backend = decision.backend
        backend.sent(trio.current_time())
        backend.pending_tokens += pending
        events = self.kv_events.get(backend.url)
        if events is not None and prediction is not None and prediction.stores_blocks:
            events.request_sent(trio.current_time())
        return Decision(backend, decision.reason, prediction, pending, request.model)

    @property
    def busy(self) -> bool:
        """Requests in flight to backends, or held for room."""
        return bool(self.gate.held) or any(backend.inflight for backend in self.pool.backends)

    async def next_request(self) -> None:
        """Return when the next request asks for a backend: idle watchers sleep till then."""
        if self._requested.is_set():
            self._requested = trio.Event()
        await self._requested.wait()

    def started(self, decision: Decision) -> None:
        """The first byte of `decision`'s answer came: its engine runs it, and one of ours
        fewer waits in that engine's queue, so a held request may go."""
        if decision.started:
            return
        decision.started = True
        backend = decision.backend
        backend.started(trio.current_time())
        self.gate.opened((None, *backend.served))

    def moved(self, decision: Decision, backend: Backend) -> Decision:
        """`decision`'s reservation given back unused and made on `backend`, which serves
        the request instead (a retry): the policy's prediction was for the other."""
        now = trio.current_time()
        failed = decision.backend
        failed.ended(now, decision.started)
        failed.pending_tokens -= decision.pending_tokens
        backend.sent(now)
        backend.pending_tokens += decision.pending_tokens
        self.gate.ended((None, *failed.served), None)
        return Decision(
            backend, "retry", None, decision.pending_tokens, decision.model, decision.waited
        )

    def release(
        self,
        decision: Decision,
        usage: Usage | None,
        api_key: str | None = None,
        per_minute: int | None = None,
        prompt_admitted: bool = True,
    ) -> None:
        """The exchange with `decision.backend` is over; `usage` is what its answer reported.
        Its completion tokens are charged to the key's budget, and its prompt's too when
        they were not taken at `admit` (`prompt_admitted`: Sluice counted no prompt)."""
        backend = decision.backend
        backend.ended(trio.current_time(), decision.started)
        backend.pending_tokens -= decision.pending_tokens
        self.gate.ended((None, *backend.served), api_key)
        limit = self.budget(per_minute)
        if usage is not None and limit and api_key:
            tokens = usage.completion_tokens or 0
            if not prompt_admitted:
                tokens += usage.prompt_tokens or 0
            if tokens:
                key = (api_key, decision.model)
                self.buckets.charge(key, tokens, trio.current_time(), limit)
        if isinstance(self.policy, CacheAware) and decision.prediction is not None:
            self._check_prediction(self.policy, decision, usage)

    def _check_prediction(
        self, policy: CacheAware, decision: Decision, usage: Usage | None
    ) -> None:
        cached = usage.cached_tokens if usage is not None else None
        prompt = usage.prompt_tokens if usage is not None else None
        corrections = policy.predictions.corrections
        outcome = policy.feedback(decision, cached, prompt)
        metrics, url = self.metrics, decision.backend.url
        metrics.route_predictions.labels(outcome=outcome).inc()
        if outcome == "unreported":
            return
        assert decision.prediction is not None and cached is not None and prompt is not None
        metrics.route_predicted_tokens.labels(backend=url).inc(decision.prediction.cached_tokens)
        metrics.route_reported_cached_tokens.labels(backend=url).inc(cached)
        metrics.route_reported_prompt_tokens.labels(backend=url).inc(prompt)
        if policy.predictions.corrections != corrections:
            metrics.route_index_corrections.inc()
            log.info(
                "backend %s served %d of %d prompt tokens from cache where %d were predicted: "
                "index corrected",
                url,
                cached,
                prompt,
                decision.prediction.cached_tokens,
            )

    def add_backend(
        self,
        url: str,
        role: BackendRole | None = None,
        models: tuple[str, ...] | None = None,
        source: str = API_SOURCE,
    ) -> Backend:
        return self.pool.add(url, models, role, source=source, now=trio.current_time())

    def drain_backend(self, backend: Backend, timeout: float) -> None:
        """`backend` takes no new request from now on; its prefix-index entries and KV
        events go at once (nothing will be routed to them), its requests in flight have
        `timeout` seconds (`backend_drained` once they ended)."""
        self.pool.drain(backend, trio.current_time(), timeout)
        self._forget(backend)

    def backend_drained(self, backend: Backend) -> None:
        """A drained backend is gone: what its last requests recorded goes too, and its
        metrics, unless its URL joined again meanwhile (the new one's, by the same id)."""
        if self.pool.find(backend.url) is None:
            self._forget(backend)
            self.metrics.forget_backend(backend.url)

    def _forget(self, backend: Backend) -> None:
        if isinstance(self.policy, CacheAware):
            self.policy.forget(backend)
        events = self.kv_events.get(backend.url)
        if events is not None:
            events.clear()

    def snapshot(self) -> RoutingSnapshot:
        gate = self.gate
        limits = gate.limits
        snapshot: RoutingSnapshot = {
            "policy": self.policy.name,
            "admission": {
                "max_inflight_per_backend": limits.ceiling,
                "max_kv_usage": limits.max_kv_usage,
                "max_queued_per_backend": limits.max_queued,
                "held": gate.held,
                "held_by_model": {
                    model or NO_MODEL: len(queue) for model, queue in gate.queues.items()
                },
                "max_held": limits.max_held,
                "max_held_per_key": limits.max_per_tenant,
                "timeout_s": limits.timeout,
                "saturated": {
                    backend.url: reason
                    for backend in self.pool.backends
                    if (reason := gate.saturated(backend)) is not None
                },
                "tokens_per_minute": self.tokens_per_minute or None,
                "api_keys": len(self.buckets),
                "rejected": dict(self.rejected),
            },
        }
        if isinstance(self.policy, CacheAware):
            snapshot["cache_aware"] = self.policy.snapshot()
        return snapshot


async def block_hashes_in_slices(tokens: Sequence[int]) -> list[int]:
    """`block_hashes(tokens)`, a slice at a time, so that a long prompt never holds the loop."""
    hashes: list[int] = []
    for start in range(0, len(tokens), HASH_SLICE_TOKENS):
        if start:
            await trio.lowlevel.checkpoint()
        previous = hashes[-1] if hashes else ROOT_HASH
        hashes += chain_hashes(previous, tokens[start : start + HASH_SLICE_TOKENS])
    return hashes


class GateSnapshot(TypedDict):
    """The gate's limits and what it holds (`routing.admission`)."""

    max_inflight_per_backend: int | None
    max_kv_usage: float
    max_queued_per_backend: int
    held: int
    held_by_model: dict[str, int]
    max_held: int
    max_held_per_key: int
    timeout_s: float
    saturated: dict[str, str]  # by backend URL: why (full, kv, ceiling)
    tokens_per_minute: int | None
    api_keys: int  # (key, model) budgets held
    rejected: dict[str, int]  # by reason


class RoutingSnapshot(TypedDict):
    """The `routing` block of the dashboard's snapshot."""

    policy: str
    admission: GateSnapshot
    cache_aware: NotRequired[CacheAwareSnapshot]  # with that policy only
