"""The decision, as both doors ask it: a request's facts in; the endpoints it goes to, primary
first, or why not, out. No HTTP and no gRPC inside.

The proxy (app/proxy/) and the endpoint picker (app/epp/) each turn what arrived into
`RequestFacts` and a `RequestContext`, then call, in this order:

    decision = await decider.decide(facts)     # held here while every engine is full
    decider.started(decision)                  # the answer's first byte: the engine runs it
    decider.served_by(decision, backend)       # a fallback served it (a retry, theirs or ours)
    decider.complete(context)                  # the answer ended, with the usage it reported

`decide` takes the prompt's tokens from the key's budget, makes sure a LoRA adapter loaded on
demand is on an engine (`AdapterLoading`, app/fleet/adapter_loader.py), then asks the router
(the gate's admission, fair queue and late binding, the routing policy), and orders up to
`FALLBACKS` other backends of the pool behind the chosen one: those with room first, the
least loaded first. Only the primary is reserved; whichever endpoint serves the request takes the
reservation over. A refusal is raised (`Refused`: 429 over a budget or shed, 503 nothing to
serve it); each door answers it in its own protocol through `app.errors.answer_for`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from app.fleet.backends import Backend
from app.fleet.pool import BackendPool
from app.observe.request_trace import RequestTrace
from app.observe.spans import TraceContext
from app.observe.timing import Timing
from app.routing.admission import ANYONE, Admission
from app.routing.decision import Decision, RouteRequest
from app.routing.refusal import no_backend
from app.routing.router import Router
from app.routing.usage import Usage

# Endpoints named behind the primary: Envoy tries them in order when the primary fails.
FALLBACKS = 2


@dataclass(slots=True, kw_only=True)
class RequestFacts:
    """What the decision knows of a request. `route`: its model, prompt (token ids or
    text), session and the backends it may go to; `admission`: its tenant (the key's label),
    weight, priority band and deadline; `prompt_tokens`: what its prompt takes from the key's
    budget (0 when Sluice counted no prompt: the engine's usage is charged at the end)."""

    route: RouteRequest
    admission: Admission = ANYONE
    tokens_per_minute: int | None = None  # the key's own limit (None: --tokens-per-minute)
    prompt_tokens: int = 0
    prompt_admitted: bool = True  # the prompt's tokens were Sluice's count, taken at admission

    @property
    def model(self) -> str | None:
        return self.route.model


@dataclass(slots=True, kw_only=True)
class RequestContext:
    """One request from arrival to the end of its answer, whichever door it came by: its
    phases' timing, its record for the dashboard and its trace, then what was decided and
    what the answer reported."""

    timing: Timing
    trace: RequestTrace
    span: TraceContext | None = None  # its trace with --otlp-endpoint
    arrived_at: float = 0.0  # Trio's clock: its admission deadline counts from here
    request_id: bytes = b""
    facts: RequestFacts | None = None
    decision: Decision | None = None
    usage: Usage | None = None


class AdapterLoading(Protocol):
    """Loads a LoRA adapter no engine has, before its request is routed."""

    async def ready(self, model: str | None, has_room: Callable[[Backend], bool]) -> None: ...


class Decider:
    def __init__(
        self, router: Router, pool: BackendPool, adapters: AdapterLoading | None = None
    ) -> None:
        """`adapters`: with --lora-load-on-demand."""
        self.router = router
        self.pool = pool
        self.adapters = adapters

    async def decide(self, facts: RequestFacts, exclude: tuple[Backend, ...] = ()) -> Decision:
        """A decision reserved on its primary, with its fallbacks. Raises `Refused`."""
        route = facts.route
        if not exclude:
            self.router.admit(
                facts.admission.tenant, route.model, facts.prompt_tokens, facts.tokens_per_minute
            )
            if self.adapters is not None:
                await self.adapters.ready(route.model, self._has_room)
        decision = await self.router.choose(route, exclude, facts.admission)
        if decision is None:
            raise no_backend(route.model, self.pool.tokenizer_refusals())
        decision.fallbacks = self._fallbacks(decision.backend, route, exclude)
        return decision

    def _has_room(self, backend: Backend) -> bool:
        return not self.router.gate.full(backend, trio.current_time())

    def _fallbacks(
        self, primary: Backend, route: RouteRequest, exclude: tuple[Backend, ...]
    ) -> tuple[Backend, ...]:
        candidates = [
            b
            for b in self.pool.available(trio.current_time(), (*exclude, primary), route.model)
            if route.only is None or b in route.only
        ]
        with_room = set(self.router.gate.with_room(candidates))
        candidates.sort(key=lambda b: (b not in with_room, b.inflight))
        return tuple(candidates[:FALLBACKS])

    def started(self, decision: Decision) -> None:
        self.router.started(decision)

    def served_by(self, decision: Decision, backend: Backend) -> Decision:
        """`backend` (one of `decision`'s fallbacks) serves the request in its primary's place:
        the reservation moves there. The same decision when it is the primary."""
        if backend is decision.backend:
            return decision
        moved = self.router.moved(decision, backend)
        moved.fallbacks = tuple(b for b in decision.fallbacks if b is not backend)
        return moved

    def complete(self, context: RequestContext) -> None:
        """The answer ended (however it ended): the reservation is given back, the usage it
        reported charged to the key's budget and checked against the policy's prediction."""
        decision, facts = context.decision, context.facts
        if decision is None or facts is None:
            return
        self.router.release(
            decision,
            context.usage,
            facts.admission.tenant,
            facts.tokens_per_minute,
            facts.prompt_admitted,
        )
