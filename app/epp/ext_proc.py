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


# Protobuf's wire format for the one message of the hot path, a streamed body chunk: field
# tags (number << 3 | 2 for bytes and messages, | 0 for varints) of ext_proc's messages.
_ANSWER_PHASE_TAG = {"request_body": b"\x1a", "response_body": b"\x22"}  # ProcessingResponse
_RESPONSE_BODY_TAG = 0x2A  # ProcessingRequest.response_body (5)
_BODY_TAG, _END_TAG = 0x0A, 0x10  # HttpBody.body (1), .end_of_stream (2)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    """A varint at `at`, and where it ends; IndexError past the data."""
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def streamed(phase: str, body: bytes, end: bool) -> bytes:
    """A body chunk given back in full-duplex streaming mode (`request_body`/`response_body`):
    in that mode Envoy sends on only what the processor returns. Written by hand, as
    protobuf would (ProcessingResponse.<phase>.response.body_mutation.streamed_response):
    every chunk of every answer is one, and building it through protobuf cost several times
    more."""
    chunk = (b"\x0a" + _varint(len(body)) + body if body else b"") + (b"\x10\x01" if end else b"")
    mutation = b"\x1a" + _varint(len(chunk)) + chunk  # BodyMutation.streamed_response (3)
    common = b"\x1a" + _varint(len(mutation)) + mutation  # CommonResponse.body_mutation (3)
    response = b"\x0a" + _varint(len(common)) + common  # BodyResponse.response (1)
    return _ANSWER_PHASE_TAG[phase] + _varint(len(response)) + response


def response_body_chunk(data: bytes) -> tuple[bytes, bool] | None:
    """(body, end_of_stream) of a ProcessingRequest that is a response body chunk and
    nothing else, read without protobuf; None for any other message (parse it whole)."""
    try:
        if not data or data[0] != _RESPONSE_BODY_TAG:
            return None
        length, at = _read_varint(data, 1)
        if at + length != len(data):
            return None  # other fields beside it
        body, end = b"", False
        while at < len(data):
            tag = data[at]
            if tag == _BODY_TAG:
                length, at = _read_varint(data, at + 1)
                body, at = data[at : at + length], at + length
            elif tag == _END_TAG:
                value, at = _read_varint(data, at + 1)
                end = bool(value)
            else:
                return None  # a field this reader does not know
        return (body, end) if at == len(data) else None
    except IndexError:
        return None


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
