"""Reading Envoy's ext_proc messages and writing the endpoint picker's answers. Pure.

The Gateway API Inference Extension's endpoint-picker protocol (v1.0) on top of ext_proc:
- Envoy may name the endpoints a request must go to, the subset hint: metadata
  `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` (a list of `ip:port`).
- The picker answers the endpoints, primary first then fallbacks, comma-separated, twice and
  the same: the header `x-gateway-destination-endpoint` and dynamic metadata `envoy.lb` /
  `x-gateway-destination-endpoint`. Or an ImmediateResponse: 503 when nothing is ready, 429
  (with Retry-After) when admission sheds it, a 4xx for a request that is wrong.
- With the response, Envoy says which endpoint served it: metadata `envoy.lb` /
  `x-gateway-destination-endpoint-served`, or the `upstream.address` attribute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from app.epp.messages import HeaderValueOption, ProcessingResponse

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# GIE's conformance tests ask the picker for an endpoint by this header and check the one
# that served by the response header.
TEST_SELECTION = b"test-epp-endpoint-selection"
TEST_SERVED = "x-conformance-test-served-endpoint"
UPSTREAM_ADDRESS = "upstream.address"
_JSON = [("content-type", b"application/json")]

Headers = list[tuple[bytes, bytes]]


def headers_of(message: Any) -> Headers:
    """An HttpHeaders' fields as the proxy's parser gives them: lowercase names, raw bytes
    (Envoy sends `raw_value`)."""
    return [(h.key.lower().encode(), h.raw_value) for h in message.headers.headers]


def subset_hint(request: Any) -> frozenset[str] | None:
    """The endpoints Envoy allows (`ip:port`), or None when it names none."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    return frozenset(
        str(value.string_value) for value in fields[SUBSET].list_value.values if value.string_value
    )


def served_endpoint(request: Any) -> str | None:
    """The endpoint that served the response (`ip:port`), as Envoy tells it."""
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE in namespaces:
        fields = namespaces[LB_NAMESPACE].fields
        if SERVED in fields and fields[SERVED].string_value:
            return str(fields[SERVED].string_value)
    for attributes in request.attributes.values():
        if UPSTREAM_ADDRESS in attributes.fields:
            return str(attributes.fields[UPSTREAM_ADDRESS].string_value) or None
    return None


def _set_headers(mutation: Any, headers: Sequence[tuple[str, bytes]]) -> None:
    for key, value in headers:
        option = HeaderValueOption()
        option.header.key = key
        option.header.raw_value = value
        mutation.set_headers.append(option)


def picked(endpoints: Sequence[str], extra: Sequence[tuple[str, bytes]], *, phase: str) -> bytes:
    """The answer that routes the request: `phase` is the message it answers
    (`request_headers`, or `request_body` when the body came buffered)."""
    value = ",".join(endpoints)
    response = ProcessingResponse()
    common = getattr(response, phase).response
    _set_headers(common.header_mutation, [(DESTINATION, value.encode()), *extra])
    # The route (and so the cluster's host) is chosen again with the new header.
    common.clear_route_cache = True
    response.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    data: bytes = response.SerializeToString()
    return data


def proceed(phase: str, headers: Sequence[tuple[str, bytes]] = ()) -> bytes:
    """Go on unchanged (with `headers` set): an answer to any message but a streamed body."""
    response = ProcessingResponse()
    if phase in ("request_trailers", "response_trailers"):
        getattr(response, phase).SetInParent()
    else:
        common = getattr(response, phase).response
        common.SetInParent()
        if headers:
            _set_headers(common.header_mutation, headers)
    data: bytes = response.SerializeToString()
    return data


def streamed(phase: str, body: bytes, end: bool) -> bytes:
    """A body chunk given back in full-duplex streaming mode (`request_body`/`response_body`):
    in that mode Envoy sends on only what the processor returns."""
    response = ProcessingResponse()
    chunk = getattr(response, phase).response.body_mutation.streamed_response
    chunk.body = body
    chunk.end_of_stream = end
    data: bytes = response.SerializeToString()
    return data


def immediate(
    status: int, body: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()
) -> bytes:
    """Answer the client from here, without a backend: an OpenAI-shaped error."""
    response = ProcessingResponse()
    answer = response.immediate_response
    answer.status.code = status
    answer.body = json.dumps(body).encode()
    _set_headers(
        answer.headers,
        [*_JSON, *((name.decode("latin-1"), value) for name, value in headers)],
    )
    answer.details = str(body.get("error", {}).get("code", ""))
    data: bytes = response.SerializeToString()
    return data
