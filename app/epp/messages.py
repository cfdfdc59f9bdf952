"""The protobuf messages of Envoy's ext_proc protocol and of gRPC health checking: the fields
an endpoint picker reads and writes, with their numbers from the .proto files
(envoy/service/ext_proc/v3/external_processor.proto, envoy/config/core/v3/base.proto,
envoy/type/v3/http_status.proto, grpc/health/v1/health.proto).

They are declared here rather than taken from `xds-protos`: that wheel ships its own copies of
the `opentelemetry` and `google` proto packages and overwrites the ones opentelemetry-sdk's
exporter needs (measured: `ImportError: cannot import name 'InstrumentationScope'` after
installing it). A message class built here parses and writes the same bytes as Envoy's for
these fields; fields not declared are skipped on parse, as protobuf does for unknown fields.
They live in a pool of their own, so nothing else that declares Envoy's names collides.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

_T = descriptor_pb2.FieldDescriptorProto
_OPTIONAL, _REPEATED = _T.LABEL_OPTIONAL, _T.LABEL_REPEATED
_SCALARS = {
    "string": _T.TYPE_STRING,
    "bytes": _T.TYPE_BYTES,
    "bool": _T.TYPE_BOOL,
    "int32": _T.TYPE_INT32,
    "enum": _T.TYPE_INT32,  # enums are varints on the wire: read and written as numbers
}
PACKAGE = "sluice.epp"

# Message name -> its fields, each written as the .proto files write it:
# "[repeated] TYPE NAME = NUMBER", "oneof" before the ones in the message's oneof (`_ONEOFS`).
# A type that is not a scalar names a message of this file, or google.protobuf.Struct; map
# fields are their entries, repeated (`_MAP_ENTRIES`).
_MESSAGES: dict[str, tuple[str, ...]] = {
    "HeaderValue": ("string key = 1", "bytes raw_value = 3"),
    "HeaderMap": ("repeated HeaderValue headers = 1",),
    "HeaderValueOption": ("HeaderValue header = 1",),
    "MetadataEntry": ("string key = 1", ".google.protobuf.Struct value = 2"),
    "Metadata": ("repeated MetadataEntry filter_metadata = 1",),
    "AttributesEntry": ("string key = 1", ".google.protobuf.Struct value = 2"),
    "HttpHeaders": ("HeaderMap headers = 1", "bool end_of_stream = 3"),
    "HttpBody": ("bytes body = 1", "bool end_of_stream = 2"),
    "HttpTrailers": ("HeaderMap trailers = 1",),
    "ProcessingRequest": (
        "oneof HttpHeaders request_headers = 2",
        "oneof HttpHeaders response_headers = 3",
        "oneof HttpBody request_body = 4",
        "oneof HttpBody response_body = 5",
        "oneof HttpTrailers request_trailers = 6",
        "oneof HttpTrailers response_trailers = 7",
        "Metadata metadata_context = 8",
        "repeated AttributesEntry attributes = 9",
        "ProtocolConfiguration protocol_config = 11",
    ),
    # The filter's body modes, sent on a stream's first message (BodySendMode numbers).
    "ProtocolConfiguration": ("enum request_body_mode = 1", "enum response_body_mode = 2"),
    "HeaderMutation": (
        "repeated HeaderValueOption set_headers = 1",
        "repeated string remove_headers = 2",
    ),
    "StreamedBodyResponse": ("bytes body = 1", "bool end_of_stream = 2"),
    "BodyMutation": (
        "oneof bytes body = 1",
        "oneof bool clear_body = 2",
        "oneof StreamedBodyResponse streamed_response = 3",
    ),
    "CommonResponse": (
        "enum status = 1",  # 0 CONTINUE, 1 CONTINUE_AND_REPLACE
        "HeaderMutation header_mutation = 2",
        "BodyMutation body_mutation = 3",
        "bool clear_route_cache = 5",
    ),
    "HeadersResponse": ("CommonResponse response = 1",),
    "BodyResponse": ("CommonResponse response = 1",),
    "TrailersResponse": ("HeaderMutation header_mutation = 1",),
    "HttpStatus": ("enum code = 1",),
    "ImmediateResponse": (
        "HttpStatus status = 1",
        "HeaderMutation headers = 2",
        "bytes body = 3",
        "string details = 5",
    ),
    "ProcessingResponse": (
        "oneof HeadersResponse request_headers = 1",
        "oneof HeadersResponse response_headers = 2",
        "oneof BodyResponse request_body = 3",
        "oneof BodyResponse response_body = 4",
        "oneof TrailersResponse request_trailers = 5",
        "oneof TrailersResponse response_trailers = 6",
        "oneof ImmediateResponse immediate_response = 7",
        ".google.protobuf.Struct dynamic_metadata = 8",
    ),
    "HealthCheckRequest": ("string service = 1",),
    "HealthCheckResponse": ("enum status = 1",),
}
# Messages with a oneof (their fields marked "oneof"): its name.
_ONEOFS = {
    "ProcessingRequest": "request",
    "BodyMutation": "mutation",
    "ProcessingResponse": "response",
}
# Map fields are repeated entries marked as such: protobuf then reads them as a mapping.
_MAP_ENTRIES = {"MetadataEntry": "Metadata", "AttributesEntry": "ProcessingRequest"}


def _words(field: str) -> tuple[str | None, str, str, int]:
    """A field as `_MESSAGES` writes it: its qualifier (repeated, oneof or none), type, name
    and number."""
    words = field.split()
    qualifier = words.pop(0) if words[0] in ("repeated", "oneof") else None
    type_name, name, _, number = words
    return qualifier, type_name, name, int(number)


def _file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="sluice/epp/messages.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=["google/protobuf/struct.proto"],
    )
    nested: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name, fields in _MESSAGES.items():
        message = descriptor_pb2.DescriptorProto(name=name)
        if name in _ONEOFS:
            message.oneof_decl.add(name=_ONEOFS[name])
        for text in fields:
            qualifier, type_name, field_name, number = _words(text)
            field = message.field.add(
                name=field_name,
                number=number,
                label=_REPEATED if qualifier == "repeated" else _OPTIONAL,
            )
            if type_name in _SCALARS:
                field.type = _SCALARS[type_name]
            else:
                field.type = _T.TYPE_MESSAGE
                outer = _MAP_ENTRIES.get(type_name)
                field.type_name = (
                    type_name
                    if type_name.startswith(".")
                    else f".{PACKAGE}.{outer}.{type_name}"
                    if outer
                    else f".{PACKAGE}.{type_name}"
                )
            if qualifier == "oneof":
                field.oneof_index = 0
        if name in _MAP_ENTRIES:
            message.options.map_entry = True
            nested[name] = message
        else:
            file.message_type.append(message)
    for entry, outer in _MAP_ENTRIES.items():
        for message in file.message_type:
            if message.name == outer:
                message.nested_type.append(nested[entry])
    return file


def _classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    struct_file = descriptor_pb2.FileDescriptorProto()
    struct_pb2.DESCRIPTOR.CopyToProto(struct_file)
    pool.Add(struct_file)
    pool.Add(_file())
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in _MESSAGES
        if name not in _MAP_ENTRIES
    }


_BUILT = _classes()
ProcessingRequest: Any = _BUILT["ProcessingRequest"]
ProcessingResponse: Any = _BUILT["ProcessingResponse"]
HeaderValueOption: Any = _BUILT["HeaderValueOption"]
HealthCheckRequest: Any = _BUILT["HealthCheckRequest"]
HealthCheckResponse: Any = _BUILT["HealthCheckResponse"]

# HealthCheckResponse.status
SERVING, NOT_SERVING = 1, 2
# ProtocolConfiguration's BodySendMode
STREAMED, BUFFERED, FULL_DUPLEX_STREAMED = 1, 2, 4
