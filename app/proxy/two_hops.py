"""A request of a disaggregated model: its prefill leg, then (or beside it) its decode leg.

`TwoHops.open` is `Forwarder.open` for a pool with prefill and decode engines: the decision
(app/routing/disaggregation.py) says one hop or two. One hop is forwarded as any request,
its `x-sluice-pd` header naming why. Two hops:

- vLLM's flow: the prefill leg (leg_bodies.py's `prefill_body`) is read whole within
  `--prefill-timeout`; its `kv_transfer_params` go into the decode leg as they came, under
  the same `X-Request-Id`, and the decode's answer is the client's.
- SGLang's flow: both legs leave at once with the prefill engine's bootstrap address and one
  room; the decode's answer is the client's once the prefill's has come. Either failing
  cancels the other at once (one nursery holds both).

Failures: a prefill leg that fails is tried on another prefill engine, then the request
goes one hop (`prefill failed`); a prefill engine that answers without `kv_transfer_params`
(no KV connector) sends it one hop too (`no transfer`); a decode leg that fails before its
first byte is tried on the next decode engine with a fresh prefill. A client that leaves
cancels whatever leg is running, and its engine sees the connection close.

Accounting: the decode's answer carries the prefill's `cached_tokens` (prefill_usage.py);
the prefill's reservation is given back with its own usage, so the prefix index is checked
against the engine that computed the prompt; the key's budget is charged once, by the
decode's answer, as for any request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from urllib.parse import urlsplit

import trio

from app.config import SGLANG_BOOTSTRAP_PORT
from app.errors import Refused, UpstreamError, UpstreamFault
from app.fleet.backends import ANY_MODEL, FAULT_STATUSES, Backend
from app.http.reply import error_reply, whole
from app.preprocess.workers import in_thread
from app.proxy import leg_bodies
from app.proxy.metrics import PdMetrics
from app.proxy.prefill_usage import PrefillFigure
from app.proxy.to_backend import Forwarder, Opened, Outgoing
from app.routing.decider import RequestContext, RequestFacts
from app.routing.decision import Decision
from app.routing.disaggregation import TWO_HOPS, Disaggregation, Way
from app.routing.usage import TAIL_BYTES, usage_from_tail

log = logging.getLogger("sluice.pd")

# Bodies up to this size are rewritten for the prefill leg on the loop (tens of
# microseconds); larger ones in a thread, like the reception's parse of large bodies.
INLINE_REWRITE_BYTES = 64 * 1024
TWO_HOP_KINDS = frozenset({"chat", "completion", "responses"})


@dataclass(slots=True)
class Prefilled:
    """A prefill leg's outcome: the transfer parameters its answer named (None: none) and
    its cached prompt tokens; or the client's error reply when the engine refused the
    request itself (a 4xx: the decode would refuse it too)."""

    params: dict[str, object] | None = None
    figure: PrefillFigure = field(default_factory=PrefillFigure)
    refused: Opened | None = None
    seconds: float = 0.0


class PrefillFailed(UpstreamError):
    """Every prefill engine failed the leg, or none was left to try."""

    def __init__(self) -> None:
        super().__init__(UpstreamFault.CONNECT, "no prefill engine prefilled the request")


class TwoHops:
    def __init__(
        self, forwarder: Forwarder, disaggregation: Disaggregation, metrics: PdMetrics
    ) -> None:
        self.forwarder = forwarder
        self.disaggregation = disaggregation
        self.router = disaggregation.router
        self.metrics = metrics
        self.settings = disaggregation.settings

    async def open(self, outgoing: Outgoing, context: RequestContext) -> Opened:
        facts = _facts(context)
        route_started = context.timing.routing_at = time.perf_counter()
        n = outgoing.fields.get("n")
        try:
            if outgoing.endpoint.kind not in TWO_HOP_KINDS:
                way = Way(await self.disaggregation.one_hop(facts), None, "api")
            else:
                way = await self.disaggregation.decide(facts, n if type(n) is int else 1)
        except Refused as refusal:
            return Opened(error_reply(refusal))
        self.forwarder.decided(way.decision, route_started, context)
        if way.prefill is None:
            return await self._one_hop(way.decision, outgoing, context, way.reason)
        return await self._two_hops(way.decision, way.prefill, outgoing, context)

    async def _one_hop(
        self, decision: Decision, outgoing: Outgoing, context: RequestContext, reason: str
    ) -> Opened:
        self._count(decision, "aggregated", reason)
        mode = f"aggregated ({reason})"
        context.trace.legs(mode, None, None)
        outgoing.extra_headers.append((b"x-sluice-pd", mode.encode()))
        return await self.forwarder.open_decided(decision, outgoing, context)

    def _count(self, decision: Decision, mode: str, reason: str) -> None:
        model = decision.model or ANY_MODEL
        self.metrics.requests.labels(model=model, mode=mode, reason=reason).inc()

    def _two_hops_taken(
        self, decode: Decision, prefill: Decision, seconds: float, context: RequestContext
    ) -> None:
        self._count(decode, TWO_HOPS, TWO_HOPS)
        context.trace.legs(TWO_HOPS, prefill.backend.url, seconds)

    async def _two_hops(
        self, decode: Decision, prefill: Decision, outgoing: Outgoing, context: RequestContext
    ) -> Opened:
        """On up to two decode engines, each with a fresh prefill."""
        for retried in (False, True):
            try:
                opened = await self._legs(decode, prefill, outgoing, context)
            except PrefillFailed:
                log.warning("no prefill engine prefilled request %s", context.request_id.decode())
                return await self._without_prefill(decode, outgoing, context)
            except UpstreamError as exc:
                self.metrics.leg_failures.labels(leg="decode").inc()
                log.warning("decode engine %s failed before answering: %s", decode.backend.url, exc)
                moved = None if retried else self.disaggregation.next_decode(decode)
                if moved is None:
                    return Opened(error_reply(exc))
                decode = context.decision = moved
                chosen = await self.disaggregation.prefill(_facts(context), ())
                if chosen is None:
                    return await self._without_prefill(decode, outgoing, context)
                prefill = chosen
                continue
            return opened
        raise AssertionError("unreachable: the second try returns")

    async def _without_prefill(
        self, decode: Decision, outgoing: Outgoing, context: RequestContext
    ) -> Opened:
        """One hop after every prefill failed: the decode engine prefills it itself (vLLM),
        or an engine that serves it whole takes the reservation over (SGLang)."""
        if self.settings.pd_protocol == "sglang":
            instead = self.disaggregation.one_hop_instead(_facts(context), decode)
            if instead is None:
                failure = UpstreamError(UpstreamFault.CONNECT, "no prefill engine answered")
                return Opened(error_reply(failure))
            decode = context.decision = instead
        return await self._one_hop(decode, outgoing, context, "prefill failed")

    async def _legs(
        self, decode: Decision, prefill: Decision, outgoing: Outgoing, context: RequestContext
    ) -> Opened:
        if self.settings.pd_protocol == "sglang":
            return await self._sglang_legs(decode, prefill, outgoing, context)
        prefilled, prefill = await self._vllm_prefill(prefill, outgoing, context)
        if prefilled.refused is not None:
            return prefilled.refused
        if prefilled.params is None:
            return await self._one_hop(decode, outgoing, context, "no transfer")
        members = {"kv_transfer_params": prefilled.params}
        body = leg_bodies.with_members(outgoing.body, members, outgoing.fields)
        leg = self._decode_leg(outgoing, body, prefill, prefilled.figure)
        self._two_hops_taken(decode, prefill, prefilled.seconds, context)
        opened = await self.forwarder.open_on(decode, leg, context)
        # The proxy's own time between the legs: the prefill's answer read to the decode's
        # request sent.
        timing = context.timing
        self.metrics.handoff_seconds.observe(timing.sent_at - timing.prefilled_at)
        return opened

    @staticmethod
    def _decode_leg(
        outgoing: Outgoing, body: bytes, prefill: Decision, figure: PrefillFigure
    ) -> Outgoing:
        extra = [
            *outgoing.extra_headers,
            (b"x-sluice-pd", TWO_HOPS.encode()),
            (b"x-sluice-prefill", prefill.backend.url.encode()),
        ]
        return replace(outgoing, body=body, extra_headers=extra, prefill_figure=figure)

    async def _vllm_prefill(
        self, prefill: Decision, outgoing: Outgoing, context: RequestContext
    ) -> tuple[Prefilled, Decision]:
        """The prefill leg on `prefill`'s engine, then on others as they fail, and the one
        that did it; `PrefillFailed` when none is left."""
        kind = outgoing.endpoint.kind
        if len(outgoing.body) <= INLINE_REWRITE_BYTES:
            body = leg_bodies.prefill_body(outgoing.body, kind)
        else:
            body = await in_thread(partial(leg_bodies.prefill_body, outgoing.body, kind))
        tried: list[Backend] = []
        while True:
            try:
                return await self._prefill_on(prefill, outgoing, body, context), prefill
            except UpstreamError as exc:
                self.metrics.leg_failures.labels(leg="prefill").inc()
                log.warning("prefill engine %s failed: %s", prefill.backend.url, exc)
                tried.append(prefill.backend)
                chosen = await self.disaggregation.prefill(_facts(context), tuple(tried))
                if chosen is None:
                    raise PrefillFailed() from exc
                prefill = chosen

    async def _prefill_on(
        self, prefill: Decision, outgoing: Outgoing, body: bytes, context: RequestContext
    ) -> Prefilled:
        """One prefill leg, its answer read whole within --prefill-timeout; its reservation
        given back however it ends (with its usage: the prefix index's check)."""
        forwarder, backend = self.forwarder, prefill.backend
        model = prefill.model or ANY_MODEL
        started = context.timing.prefill_at = time.perf_counter()
        status, answer = 0, b""
        try:
            with trio.fail_after(self.settings.prefill_timeout):
                response = await forwarder.upstream.request(
                    backend.url, outgoing.path, outgoing.headers, body
                )
                try:
                    status = response.status_code
                    answer = await response.read_rest(
                        forwarder.idle_timeout, leg_bodies.MAX_PREFILL_ANSWER
                    )
                    context.timing.prefilled_at = time.perf_counter()
                finally:
                    await response.release()
        except (UpstreamError, trio.TooSlowError) as exc:
            failure = _as_upstream_error(exc, self.settings.prefill_timeout)
            forwarder.count(backend, str(status) if status else "error", failure, model)
            self.router.release(prefill, None)
            raise failure from None
        except BaseException:
            self.router.release(prefill, None)
            raise
        seconds = time.perf_counter() - started
        self.metrics.prefill_seconds.observe(seconds)
        usage = usage_from_tail(answer[-TAIL_BYTES:]) if status == 200 else None
        self.router.release(prefill, usage)
        if status in FAULT_STATUSES:
            failure = UpstreamError(UpstreamFault.STATUS, f"the prefill answered {status}")
            forwarder.count(backend, str(status), failure, model)
            raise failure
        forwarder.count(backend, str(status), None, model)
        if status != 200:
            headers = [(b"content-type", b"application/json"), (b"x-sluice-pd", TWO_HOPS.encode())]
            return Prefilled(refused=Opened(whole(status, headers, answer)))
        figure = PrefillFigure(usage.cached_tokens if usage is not None else None)
        return Prefilled(leg_bodies.transfer_params_of(answer), figure, seconds=seconds)

    async def _sglang_legs(
        self, decode: Decision, prefill: Decision, outgoing: Outgoing, context: RequestContext
    ) -> Opened:
        """Both legs at once, on other prefill engines as they fail; the decode's answer
        once the prefill's has come. `PrefillFailed` when none is left."""
        tried: list[Backend] = []
        while True:
            backend = prefill.backend
            port = backend.bootstrap_port or SGLANG_BOOTSTRAP_PORT
            members = leg_bodies.bootstrap_members(urlsplit(backend.url).hostname or "", port)
            body = leg_bodies.with_members(outgoing.body, members, outgoing.fields)
            prefilled = Prefilled()
            failed: list[UpstreamError] = []
            opened: Opened | None = None
            decode_failure: UpstreamError | None = None
            async with trio.open_nursery() as nursery:
                both = nursery.cancel_scope
                nursery.start_soon(
                    self._beside, prefill, outgoing, body, context, prefilled, failed, both
                )
                leg = self._decode_leg(outgoing, body, prefill, prefilled.figure)
                try:
                    opened = await self.forwarder.open_on(decode, leg, context)
                except UpstreamError as exc:
                    decode_failure = exc
                    both.cancel()  # the prefill's room would wait for nobody
            if decode_failure is not None:
                raise decode_failure
            if not failed:
                assert opened is not None
                self._two_hops_taken(decode, prefill, prefilled.seconds, context)
                return opened
            if opened is not None and opened.passage is not None:
                await opened.passage.release()
            tried.append(backend)
            chosen = await self.disaggregation.prefill(_facts(context), tuple(tried))
            if chosen is None:
                raise PrefillFailed() from failed[0]
            prefill = chosen

    async def _beside(
        self,
        prefill: Decision,
        outgoing: Outgoing,
        body: bytes,
        context: RequestContext,
        prefilled: Prefilled,
        failed: list[UpstreamError],
        both: trio.CancelScope,
    ) -> None:
        """SGLang's prefill leg beside its decode: a failure cancels the decode at once."""
        try:
            outcome = await self._prefill_on(prefill, outgoing, body, context)
        except UpstreamError as exc:
            self.metrics.leg_failures.labels(leg="prefill").inc()
            failed.append(exc)
            both.cancel()
            return
        prefilled.figure.cached_tokens = outcome.figure.cached_tokens
        prefilled.seconds = outcome.seconds


def _facts(context: RequestContext) -> RequestFacts:
    assert context.facts is not None
    return context.facts


def _as_upstream_error(exc: UpstreamError | trio.TooSlowError, timeout: float) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    return UpstreamError(UpstreamFault.TIMEOUT, f"no whole prefill answer within {timeout:g}s")
