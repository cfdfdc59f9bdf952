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

# Message name -> its fields: (name, number, type, repeated, oneof index or None). A type that
# is not a scalar names a message of this file, or google.protobuf.Struct.
_MESSAGES: dict[str, list[tuple[str, int, str, bool, int | None]]] = {
    "HeaderValue": [("key", 1, "string", False, None), ("raw_value", 3, "bytes", False, None)],
    "HeaderMap": [("headers", 1, "HeaderValue", True, None)],
    "HeaderValueOption": [("header", 1, "HeaderValue", False, None)],
    "MetadataEntry": [
        ("key", 1, "string", False, None),
        ("value", 2, ".google.protobuf.Struct", False, None),
    ],
    "Metadata": [("filter_metadata", 1, "MetadataEntry", True, None)],
    "AttributesEntry": [
        ("key", 1, "string", False, None),
        ("value", 2, ".google.protobuf.Struct", False, None),
    ],
    "HttpHeaders": [
        ("headers", 1, "HeaderMap", False, None),
        ("end_of_stream", 3, "bool", False, None),
    ],
    "HttpBody": [("body", 1, "bytes", False, None), ("end_of_stream", 2, "bool", False, None)],
    "HttpTrailers": [("trailers", 1, "HeaderMap", False, None)],
    "ProcessingRequest": [
        ("request_headers", 2, "HttpHeaders", False, 0),
        ("response_headers", 3, "HttpHeaders", False, 0),
        ("request_body", 4, "HttpBody", False, 0),
        ("response_body", 5, "HttpBody", False, 0),
        ("request_trailers", 6, "HttpTrailers", False, 0),
        ("response_trailers", 7, "HttpTrailers", False, 0),
        ("metadata_context", 8, "Metadata", False, None),
        ("attributes", 9, "AttributesEntry", True, None),
        ("protocol_config", 11, "ProtocolConfiguration", False, None),
    ],
    # The filter's body modes, sent on a stream's first message (BodySendMode numbers).
    "ProtocolConfiguration": [
        ("request_body_mode", 1, "enum", False, None),
        ("response_body_mode", 2, "enum", False, None),
    ],
    "HeaderMutation": [
        ("set_headers", 1, "HeaderValueOption", True, None),
        ("remove_headers", 2, "string", True, None),
    ],
    "StreamedBodyResponse": [
        ("body", 1, "bytes", False, None),
        ("end_of_stream", 2, "bool", False, None),
    ],
    "BodyMutation": [
        ("body", 1, "bytes", False, 0),
        ("clear_body", 2, "bool", False, 0),
        ("streamed_response", 3, "StreamedBodyResponse", False, 0),
    ],
    "CommonResponse": [
        ("status", 1, "enum", False, None),  # 0 CONTINUE, 1 CONTINUE_AND_REPLACE
        ("header_mutation", 2, "HeaderMutation", False, None),
        ("body_mutation", 3, "BodyMutation", False, None),
        ("clear_route_cache", 5, "bool", False, None),
    ],
    "HeadersResponse": [("response", 1, "CommonResponse", False, None)],
    "BodyResponse": [("response", 1, "CommonResponse", False, None)],
    "TrailersResponse": [("header_mutation", 1, "HeaderMutation", False, None)],
    "HttpStatus": [("code", 1, "enum", False, None)],
    "ImmediateResponse": [
        ("status", 1, "HttpStatus", False, None),
        ("headers", 2, "HeaderMutation", False, None),
        ("body", 3, "bytes", False, None),
        ("details", 5, "string", False, None),
    ],
    "ProcessingResponse": [
        ("request_headers", 1, "HeadersResponse", False, 0),
        ("response_headers", 2, "HeadersResponse", False, 0),
        ("request_body", 3, "BodyResponse", False, 0),
        ("response_body", 4, "BodyResponse", False, 0),
        ("request_trailers", 5, "TrailersResponse", False, 0),
        ("response_trailers", 6, "TrailersResponse", False, 0),
        ("immediate_response", 7, "ImmediateResponse", False, 0),
        ("dynamic_metadata", 8, ".google.protobuf.Struct", False, None),
    ],
    "HealthCheckRequest": [("service", 1, "string", False, None)],
    "HealthCheckResponse": [("status", 1, "enum", False, None)],
}
# Messages whose first member is a oneof: its name.
_ONEOFS = {
    "ProcessingRequest": "request",
    "BodyMutation": "mutation",
    "ProcessingResponse": "response",
}
# Map fields are repeated entries marked as such: protobuf then reads them as a mapping.
_MAP_ENTRIES = {"MetadataEntry": "Metadata", "AttributesEntry": "ProcessingRequest"}


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
        for field_name, number, type_name, repeated, oneof in fields:
            field = message.field.add(
                name=field_name, number=number, label=_REPEATED if repeated else _OPTIONAL
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
            if oneof is not None:
                field.oneof_index = oneof
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
