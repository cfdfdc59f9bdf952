"""The proxy's one door into routing: admit, choose (waiting for a free slot), release.

Everything is per model pool: `admit` applies the tokens-per-minute limit of the request's (API
key, model) before anything is forwarded. `choose` asks the policy among the backends of the
request's model that take traffic and are under `--max-inflight-per-backend`; when every one is
at that limit, the request waits in its pool's bounded `SlotQueue` (or is refused with
`Overloaded`, a 429). The chosen backend's in-flight count and pending prompt tokens are
reserved at once (no await in between, so two requests never both see the last free slot), and
`release` gives them back, wakes one waiter and feeds the backend's reported usage to the policy
(cache_aware checks its prediction) and to the token limiter (completion tokens). A backend in
several pools wakes a waiter of each. Backends added or removed at run time go through here too,
so the index forgets a removed backend.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

import trio

from app.budgets.buckets import TokenBuckets
from app.budgets.shared import SharedBudgets
from app.config import Settings
from app.fleet.backends import Backend, BackendPool
from app.observe.metrics import Metrics
from app.routing.admission import Overloaded, SlotQueue
from app.routing.cache_aware import CacheAware
from app.routing.decision import Decision, Policy, RouteRequest
from app.routing.policies import RoutingParams, make_policy
from app.routing.usage import Usage

log = logging.getLogger("sluice.router")

# A waiter re-checks this often even unwoken: backends also free up by becoming healthy.
QUEUE_POLL = 0.5
# Without token ids, prompt tokens are estimated at four characters a token.
CHARS_PER_TOKEN = 4


def routing_params(settings: Settings) -> RoutingParams:
    return RoutingParams(
        cache_threshold=settings.cache_threshold,
        balance_abs_threshold=settings.balance_abs_threshold,
        balance_rel_threshold=settings.balance_rel_threshold,
        max_index_blocks=settings.max_index_blocks,
    )


def estimated_tokens(request: RouteRequest) -> int:
    if request.token_ids is not None:
        return len(request.token_ids)
    return len(request.text or "") // CHARS_PER_TOKEN


def budgets_for(settings: Settings) -> TokenBuckets | SharedBudgets:
    """Every (key, model) budget, as deep as the key's own limit (--api-keys) or
    --tokens-per-minute: a process's own buckets, as ever; the shared layer with
    --redis-url, or with --workers N alone (each worker then holds 1/N of every budget)."""
    if settings.redis_url is None and settings.workers == 1:
        return TokenBuckets()
    return SharedBudgets(
        settings.tokens_per_minute,
        local_replicas=settings.workers,
        shared=settings.redis_url is not None,
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
        settings: Settings,
        pool: BackendPool,
        metrics: Metrics,
        policy: Policy | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.policy = policy or make_policy(settings.policy, params=routing_params(settings))
        self.max_inflight = settings.max_inflight_per_backend
        self.reservations = 0  # requests sent to a backend so far: whether traffic flows
        self.max_waiting = settings.admission_queue
        self.queue_timeout = settings.admission_timeout
        # One per pool (model), made at its first request: at most MAX_MODELS + 1 (no model).
        self.queues: dict[str | None, SlotQueue] = {}
        self.tokens_per_minute = settings.tokens_per_minute
        self.buckets = budgets_for(settings)
        self.rejected: dict[str, int] = {}
        # By backend URL, for backends whose engine's KV events feed the index: they are
        # told when a request goes there that will make the engine store blocks (silence
        # while such requests flow is a publisher gone).
        self.kv_events: dict[str, EngineEvents] = {}
        metrics.admission_waiting.set_function(lambda: self.waiting)
        metrics.backend_inflight.set_function(
            lambda: [(backend.url, backend.inflight) for backend in pool.backends]
        )
        if isinstance(self.policy, CacheAware):
            index = self.policy.index
            metrics.route_index_blocks.set_function(lambda: len(index))

    @property
    def waiting(self) -> int:
        return sum(queue.waiting for queue in self.queues.values())

    def _queue(self, model: str | None) -> SlotQueue:
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = SlotQueue(self.max_waiting, self.queue_timeout)
        return queue

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
            self._refuse(
                Overloaded(
                    "request_too_large",
                    f"This request's {prompt_tokens} prompt tokens exceed the limit of "
                    f"{limit} tokens per minute for {scope}.",
                    60.0,
                )
            )
        self._refuse(
            Overloaded(
                "tokens_per_minute",
                f"Rate limit reached: {limit} tokens per minute for {scope}; retry in {wait:.1f}s.",
                wait,
            )
        )

    async def choose(
        self, request: RouteRequest, exclude: tuple[Backend, ...] = ()
    ) -> Decision | None:
        """A reserved decision among the backends of `request.model` (all of them when it is
        None); None when none takes traffic at all."""
        deadline: float | None = None
        queue = self._queue(request.model)
        while True:
            candidates = self.pool.available(trio.current_time(), exclude, request.model)
            if not candidates:
                return None
            open_ = [b for b in candidates if b.inflight < self.max_inflight]
            # Newcomers queue behind waiters; a waiter that was woken may take the slot.
            if open_ and (deadline is not None or not queue.waiting):
                return self._reserve(self.policy.choose(open_, request), request)
            if deadline is None:
                deadline = trio.current_time() + queue.timeout
            try:
                await queue.wait(deadline, QUEUE_POLL)
            except Overloaded as exc:
                self._refuse(exc)

    def _reserve(self, decision: Decision, request: RouteRequest) -> Decision:
        prediction = decision.prediction
        cached = prediction.cached_tokens if prediction is not None else 0
        pending = max(estimated_tokens(request) - cached, 0)
        backend = decision.backend
        backend.inflight += 1
        backend.pending_tokens += pending
        self.reservations += 1
        events = self.kv_events.get(backend.url)
        if events is not None and prediction is not None and prediction.stores_blocks:
            events.request_sent(trio.current_time())
        return Decision(backend, decision.reason, prediction, pending, request.model)

    def release(
        self,
        decision: Decision,
        usage: Usage | None,
        api_key: str | None = None,
        per_minute: int | None = None,
    ) -> None:
        """The exchange with `decision.backend` is over; `usage` is what its answer reported."""
        backend = decision.backend
        backend.inflight -= 1
        backend.pending_tokens -= decision.pending_tokens
        for model in (None, *backend.served):
            queue = self.queues.get(model)
            if queue is not None:
                queue.wake_one()
        limit = self.budget(per_minute)
        if usage is not None and usage.completion_tokens and limit and api_key:
            key = (api_key, decision.model)
            self.buckets.charge(key, usage.completion_tokens, trio.current_time(), limit)
        if isinstance(self.policy, CacheAware) and decision.prediction is not None:
            self._check_prediction(self.policy, decision, usage)

    def _check_prediction(
        self, policy: CacheAware, decision: Decision, usage: Usage | None
    ) -> None:
        cached = usage.cached_tokens if usage is not None else None
        prompt = usage.prompt_tokens if usage is not None else None
        corrections = policy.corrections
        outcome = policy.feedback(decision, cached, prompt)
        metrics, url = self.metrics, decision.backend.url
        metrics.route_predictions.labels(outcome=outcome).inc()
        if outcome == "unreported":
            return
        assert decision.prediction is not None and cached is not None and prompt is not None
        metrics.route_predicted_tokens.labels(backend=url).inc(decision.prediction.cached_tokens)
        metrics.route_reported_cached_tokens.labels(backend=url).inc(cached)
        metrics.route_reported_prompt_tokens.labels(backend=url).inc(prompt)
        if policy.corrections != corrections:
            metrics.route_index_corrections.inc()
            log.info(
                "backend %s served %d of %d prompt tokens from cache where %d were predicted: "
                "index corrected",
                url,
                cached,
                prompt,
                decision.prediction.cached_tokens,
            )

    def add_backend(self, url: str) -> Backend:
        return self.pool.add(url)

    def remove_backend(self, backend: Backend) -> None:
        self.pool.remove(backend)
        if isinstance(self.policy, CacheAware):
            self.policy.forget(backend)
        events = self.kv_events.get(backend.url)
        if events is not None:
            events.clear()
        self.metrics.forget_backend(backend.url)

    def _refuse(self, exc: Overloaded) -> None:
        self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
        self.metrics.admission_rejected.labels(reason=exc.reason).inc()
        raise exc

    def snapshot(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = {
            "policy": self.policy.name,
            "admission": {
                "max_inflight_per_backend": self.max_inflight,
                "waiting": self.waiting,
                "waiting_by_model": {
                    model: queue.waiting for model, queue in self.queues.items() if model
                },
                "max_waiting": self.max_waiting,
                "tokens_per_minute": self.tokens_per_minute or None,
                "api_keys": len(self.buckets),
                "rejected": dict(self.rejected),
            },
        }
        if isinstance(self.policy, CacheAware):
            snapshot["cache_aware"] = self.policy.snapshot()
        return snapshot
