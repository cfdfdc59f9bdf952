"""One inference request on the proxy's door, from its body to the end of its answer.

`Inference.answer` reads the body, has the `Reception` preprocess it (shared with the endpoint
picker), makes what its backend gets (`Outgoing`: its path, body and headers, rewritten for
`--forward tokens` or a stored response's follow-up), and has the forwarder open the answer
(decide, send, retry once); then the exchange sends the reply, in one call, and the
forwarder closes the books. Every error before that is a reply too: the exchange is written
to once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from app.errors import ClientError, Refused
from app.fleet.pool import BackendPool
from app.http.exchange import Exchange
from app.http.fields import Headers
from app.http.reply import error_reply
from app.observe.tracing import with_traceparent
from app.preprocess.arrival import Arrival
from app.preprocess.endpoints import RESPONSES, Endpoint
from app.preprocess.pipeline import Prepared
from app.preprocess.reception import Reception
from app.proxy import errors
from app.proxy.forward_tokens import plan_forward
from app.proxy.headers import upstream_headers
from app.proxy.response_ids import untag
from app.proxy.settings import ProxySettings
from app.proxy.to_backend import Forwarder, Opened, Outgoing
from app.proxy.two_hops import TwoHops
from app.routing.decider import RequestContext


@dataclass(eq=False)
class Inference:
    settings: ProxySettings
    reception: Reception
    forwarder: Forwarder
    pool: BackendPool
    two_hops: TwoHops | None = None
    forward_tokens: bool = field(init=False)
    # Request ids this process makes: a random prefix and a count, unique without a system
    # call for 16 random bytes on every request.
    _id_prefix: bytes = field(init=False, default_factory=lambda: os.urandom(8).hex().encode())
    _ids_made: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.forward_tokens = self.settings.forward == "tokens"

    def new_request_id(self) -> bytes:
        self._ids_made += 1
        return b"%b%016x" % (self._id_prefix, self._ids_made)

    async def answer(
        self,
        exchange: Exchange,
        path: str,
        endpoint: Endpoint,
        context: RequestContext,
        head: Arrival,
    ) -> None:
        limit = self.settings.max_body_bytes
        opened: Opened | None = None
        try:
            try:
                grant = self.reception.grant(head)
                prepared, body = await self.reception.prepare(
                    context, head, grant, endpoint.kind, await exchange.read_body(limit)
                )
                outgoing = self._outgoing(path, endpoint, prepared, body, head, context)
            except (ClientError, Refused) as exc:  # bad input; no model known yet
                opened = Opened(error_reply(exc))
            else:
                opened = await self._open(outgoing, context)
            await exchange.send(opened.reply)
        finally:
            # However it ended (a client that left, a backend that failed), once.
            await self.forwarder.close(opened, context)

    async def _open(self, outgoing: Outgoing, context: RequestContext) -> Opened:
        """Forwarded as any request, or in two hops while the pool has prefill or decode
        engines (app/proxy/two_hops.py)."""
        if self.two_hops is not None and self.pool.disaggregated:
            return await self.two_hops.open(outgoing, context)
        return await self.forwarder.open(outgoing, context)

    def _outgoing(
        self,
        path: str,
        endpoint: Endpoint,
        prepared: Prepared,
        body: bytes,
        head: Arrival,
        context: RequestContext,
    ) -> Outgoing:
        """What the backend gets; its request id (the client's x-request-id, or one made
        here) is the context's from now on."""
        known_ids: tuple[str, ...] = ()
        if endpoint is RESPONSES:
            body, known_ids = self._follow_up(prepared, body, context)
        context.request_id = head.request_id or self.new_request_id()
        headers = self.upstream_headers(head, context)
        extra_headers = [(b"x-sluice-prompt-tokens", _prompt_tokens_header(prepared))]
        as_chat = False
        kind = endpoint.kind
        if self.forward_tokens and kind in ("chat", "completion"):
            plan = plan_forward(kind, path, body, prepared)
            path, body, as_chat = plan.path, plan.body, plan.answer_as_chat
            extra_headers.append((b"x-sluice-forward", plan.label.encode()))
        return Outgoing(
            endpoint=endpoint,
            path=path,
            body=body,
            headers=headers,
            extra_headers=extra_headers,
            answer_as_chat=as_chat,
            known_ids=known_ids,
            fields=prepared.fields,
        )

    @staticmethod
    def upstream_headers(head: Arrival, context: RequestContext) -> Headers:
        """The headers the engine gets: the client's, less hop-by-hop ones, with the
        request's id and (with --otlp-endpoint) Sluice's span as the trace's parent."""
        headers = upstream_headers(head.headers, context.request_id)
        return headers if context.span is None else with_traceparent(headers, context.span)

    def _follow_up(
        self, prepared: Prepared, body: bytes, context: RequestContext
    ) -> tuple[bytes, tuple[str, ...]]:
        """A Responses request continuing a stored one (`previous_response_id`) goes to the
        engine that stores it, asked by the engine's own id: the body, and that id."""
        previous = prepared.fields.get("previous_response_id")
        owner = untag(previous) if isinstance(previous, str) else None
        if owner is None or not isinstance(previous, str):
            return body, ()
        engine_id, backend_id = owner
        backend = self.pool.find(backend_id)
        if backend is None:
            raise errors.response_not_found(previous, "previous_response_id")
        assert context.facts is not None
        context.facts.route.only = frozenset((backend,))
        quoted = b'"%b"' % previous.encode()
        return body.replace(quoted, b'"%b"' % engine_id.encode(), 1), (engine_id,)


def _prompt_tokens_header(prepared: Prepared) -> bytes:
    """The prompt's token count, `estimated` when tokenization was skipped (bail-out), or
    `engine` when Sluice has no prompt of its own to count (embeddings, uploads, ...)."""
    if prepared.tokenize_path == "none":
        return b"engine"
    if prepared.token_ids is None:
        return b"estimated"
    return str(len(prepared.token_ids)).encode()
