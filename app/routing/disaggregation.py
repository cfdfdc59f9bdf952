"""Disaggregated serving's decision: one engine for a request, or a prefill engine and a
decode engine, and which. No HTTP inside: the proxy's two hops (app/proxy/two_hops.py) ask.

Design rules:
1. Only a pool with role engines is asked (`BackendPool.disaggregated`); a fleet without
   `--prefill`/`--decode` never reaches this module, so it costs nothing there.
2. A request of a model whose pool has prefill and decode engines takes two hops, unless one
   serves it better, and the reason is named (and counted by the proxy):
   - `n>1`: one transferred prompt cannot seed several sequences;
   - `short`: the prompt tokens that the best engine serving requests whole does not hold
     are at most `--disaggregate-above`, so the hop would cost more than the prefill it
     moves (a decode engine holds the prompts transferred to it: a conversation's next
     turn is often short there);
   - `prefill saturated`: no prefill engine has room while an engine serving requests
     whole has;
   - `no prefill engine`, `no decode engine`; and, decided by the proxy once a leg ran,
     `prefill failed`, `no transfer` (the prefill engine named no KV transfer), `api`
     (an API that is not generation: Messages, embeddings, ...).
3. One hop goes to an engine that serves a request whole: a `both` engine, or with vLLM's
   flow a decode engine, which prefills locally. SGLang's decode engines need a prefill, so
   a pool of only prefill and decode engines takes two hops whatever the prompt.
4. Two hops: the decode engine is chosen first, through the gate (held, fairly, while every
   decode engine is full: its seat is what the stream keeps), by load, as a request with no
   prompt to place; it is the request's decision, the one the budget and the retries follow.
   Then the prefill engine, through the gate too, by the policy: prefix affinity and load.
   Its reservation is its own, given back when its leg ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from app.config import PdProtocol
from app.fleet.backends import Backend
from app.fleet.pool import BackendPool
from app.routing.decider import Decider, RequestFacts
from app.routing.decision import Decision, RouteRequest
from app.routing.refusal import no_backend
from app.routing.router import estimated_tokens

TWO_HOPS = "disaggregated"


@dataclass(frozen=True)
class DisaggregationSettings:
    """What disaggregated serving reads of the configuration."""

    pd_protocol: PdProtocol
    disaggregate_above: int  # uncached prompt tokens a request must exceed to take two hops
    prefill_timeout: float  # seconds a prefill leg may take, its whole answer


@dataclass(slots=True)
class Way:
    """How a request is served: `decision`, the engine that answers it (a decode engine, or
    one that serves it whole); `prefill`, the prefill engine's reserved decision for two
    hops (None: one hop, for `reason`)."""

    decision: Decision
    prefill: Decision | None
    reason: str


class Disaggregation:
    def __init__(self, settings: DisaggregationSettings, decider: Decider, pool: BackendPool):
        self.settings = settings
        self.decider = decider
        self.router = decider.router
        self.pool = pool

    def whole_engines(self, model: str | None, only: frozenset[Backend] | None) -> list[Backend]:
        """The engines of `model` that take a request whole (rule 3)."""
        roles = ("both", "decode") if self.settings.pd_protocol == "vllm" else ("both",)
        candidates = self.pool.available(trio.current_time(), (), model)
        return [b for b in candidates if b.role in roles and (only is None or b in only)]

    def engines(self, facts: RequestFacts, role: str) -> list[Backend]:
        only = facts.route.only
        candidates = self.pool.available(trio.current_time(), (), facts.model)
        return [b for b in candidates if b.role == role and (only is None or b in only)]

    async def decide(self, facts: RequestFacts, n: int) -> Way:
        """The request's way, its decision reserved (and its budget taken). Raises
        `Refused` as `Decider.decide` does."""
        reason = await self.one_hop_reason(facts, n)
        if reason is not None:
            return Way(await self.one_hop(facts), None, reason)
        decodes = self.engines(facts, "decode")
        decode = await self.decider.decide(self._with_only(facts, decodes, placed=False))
        try:
            prefill = await self.prefill(facts, ())
        except BaseException:
            self.router.release(decode, None)
            raise
        if prefill is not None:
            # The transfer leaves the prompt's blocks in the decode engine's cache too: the
            # conversation's next turn may be short enough to prefill there.
            self.router.holds_prompt(decode.backend, facts.route)
            return Way(decode, prefill, TWO_HOPS)
        if self.settings.pd_protocol == "vllm":  # the decode engine prefills it itself
            return Way(decode, None, "no prefill engine")
        instead = self.one_hop_instead(facts, decode)
        if instead is None:
            self.router.release(decode, None)
            raise no_backend(facts.model, self.pool.tokenizer_refusals())
        return Way(instead, None, "no prefill engine")

    async def one_hop_reason(self, facts: RequestFacts, n: int) -> str | None:
        """Why the request takes one hop (rule 2), or None: two."""
        prefills = self.engines(facts, "prefill")
        if not prefills:
            return "no prefill engine"
        if not self.engines(facts, "decode"):
            return "no decode engine"
        whole = self.whole_engines(facts.model, facts.route.only)
        if not whole:
            return None
        if n > 1:
            return "n>1"
        route = facts.route
        uncached = estimated_tokens(route) - await self.router.prompt_held(route, whole)
        if uncached <= self.settings.disaggregate_above:
            return "short"
        gate = self.router.gate
        if not gate.with_room(prefills) and gate.with_room(whole):
            return "prefill saturated"
        return None

    async def one_hop(self, facts: RequestFacts) -> Decision:
        """A reserved decision among the engines that serve the request whole."""
        whole = self.whole_engines(facts.model, facts.route.only)
        return await self.decider.decide(self._with_only(facts, whole))

    async def prefill(self, facts: RequestFacts, exclude: tuple[Backend, ...]) -> Decision | None:
        """A reserved prefill engine (not one of `exclude`), held while every one is full;
        None when none takes traffic."""
        route = dataclasses.replace(facts.route, only=frozenset(self.engines(facts, "prefill")))
        if not route.only or not set(route.only) - set(exclude):
            return None
        return await self.router.choose(route, exclude, facts.admission)

    def one_hop_instead(self, facts: RequestFacts, decision: Decision) -> Decision | None:
        """`decision`'s reservation moved to the least loaded engine that serves the request
        whole (its prefill could not be done), or None when there is none."""
        whole = self.whole_engines(facts.model, facts.route.only)
        if not whole:
            return None
        with_room = self.router.gate.with_room(whole) or whole
        return self.router.moved(decision, min(with_room, key=lambda b: b.load))

    def next_decode(self, failed: Decision) -> Decision | None:
        """Where the request goes after its decode engine failed it before answering: the
        decision's next fallback (the reservation moves there), or None."""
        if not failed.fallbacks:
            return None
        return self.decider.served_by(failed, failed.fallbacks[0])

    @staticmethod
    def _with_only(
        facts: RequestFacts, backends: Sequence[Backend], *, placed: bool = True
    ) -> RequestFacts:
        """The facts of a request that may go to `backends` only; not `placed`: as a request
        with no prompt to place (a decode leg prefills nothing: its engine is chosen by
        load, and no prompt tokens are reserved on it)."""
        chosen = frozenset(backends)
        if placed:
            route = dataclasses.replace(facts.route, only=chosen)
        else:
            route = RouteRequest(model=facts.route.model, only=chosen)
        return dataclasses.replace(facts, route=route)
