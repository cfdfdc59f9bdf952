"""An Envoy bootstrap that puts Envoy in front of an InferencePool with Sluice as its picker.

Pure: typed parameters in, a JSON-ready dict out (Envoy reads JSON, so no YAML). `sluice
envoy` runs it, tests/envoy.py starts it, benchmarks compare it with the plain round-robin
variant. tests/test_envoy_bootstrap.py keeps each choice true; app/README.md says why the
less obvious ones are needed.

- Picking: the pool's cluster uses `override_host`, which reads the EPP's "primary,fallback,
  ..." from dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint` (else the header),
  sends the request to the first and each retry to the next, and past the list balances
  round robin. A client's own header of that name is dropped before any filter sees it.
  `metadata_options.receiving_namespaces` lists `envoy.lb`, or Envoy drops the metadata.
- The served endpoint: `selected_host_key` writes the host that answered to `envoy.lb` /
  `x-gateway-destination-endpoint-served`, and `forwarding_namespaces` sends it back in the
  response-phase messages' `metadata_context`, as GIE asks.
- Retries: on connect failure, reset or 5xx before the answer's headers went out, up to
  len(pool)-1 times (at most 3), never to a host already tried; bodies kept up to 16 MiB; the
  circuit breakers raised above Envoy's 3 retries in flight. A started stream is not retried.
- FULL_DUPLEX_STREAMED needs the trailer modes set to SEND and ignores `message_timeout`: the
  stream idle timeout (300 s) bounds a wedged EPP. In BUFFERED mode `message_timeout` (35 s,
  above admission's 30 s) holds, and `max_message_timeout` lets an EPP extend it.
- Fail-open: the EPP cluster is health-checked over gRPC (`envoy.service.ext_proc.v3.
  ExternalProcessor`), ejected at its first refused connection, panic routing off, so a dead
  EPP fails the stream before any body is sent and the request is balanced plainly.
  Fail-close answers 503 (Envoy's own would be 500). The route timeout is 0: no cut streams.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any, Literal

BodyMode = Literal["full-duplex", "buffered"]
BODY_MODES: tuple[BodyMode, ...] = ("full-duplex", "buffered")

# GIE's names: the metadata namespace and keys, and the header that mirrors the pick.
LB_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_SERVED = "x-gateway-destination-endpoint-served"
# The gRPC health service an EPP reports SERVING on when it is ready (GIE protocol).
EPP_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "endpoint_picker"
MAX_RETRIES = 3
MAX_BODY_BYTES = 16 * 1024 * 1024
MESSAGE_TIMEOUT_S = 35.0
MAX_MESSAGE_TIMEOUT_S = 300.0
STREAM_IDLE_TIMEOUT_S = 300.0
# Well above any real concurrency: Envoy's defaults (1,024 requests, 3 retries) would make
# Envoy, not the pool, the limit in a benchmark.
CIRCUIT_LIMIT = 1_000_000
CIRCUIT_LIMITS = ("max_connections", "max_pending_requests", "max_requests", "max_retries")

_TYPE = "type.googleapis.com/envoy."


@dataclass(frozen=True)
class EnvoySpec:
    """What the bootstrap describes. `epp` is HOST:PORT of the picker's gRPC door; each
    `pool` entry HOST:PORT of a model server. `round_robin` leaves the picker out."""

    pool: tuple[str, ...]
    epp: str | None = None
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 9901
    failure_mode_allow: bool = False
    body_mode: BodyMode = "full-duplex"
    round_robin: bool = False

    def __post_init__(self) -> None:
        if not self.pool:
            raise ValueError("the pool needs at least one HOST:PORT endpoint")
        for address in (*self.pool, *((self.epp,) if self.epp else ())):
            parse_address(address)
        if not self.round_robin and self.epp is None:
            raise ValueError("give the endpoint picker's HOST:PORT, or choose round robin")
        if self.body_mode not in BODY_MODES:
            raise ValueError(f"body mode must be one of {', '.join(BODY_MODES)}")


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 in brackets) as (host, port); ValueError with the reason."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


def render_bootstrap(spec: EnvoySpec) -> dict[str, Any]:
    """The bootstrap as a dict, ready for `json.dumps`."""
    filters = [] if spec.round_robin else [_ext_proc_filter(spec)]
    filters.append(_typed("envoy.filters.http.router", "extensions.filters.http.router.v3.Router"))
    connection_manager: dict[str, Any] = {
        "@type": _TYPE + "extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "sluice_envoy",
        "stream_idle_timeout": _seconds(STREAM_IDLE_TIMEOUT_S),
        "route_config": {
            "name": "inference_pool",
            "virtual_hosts": [
                {"name": "pool", "domains": ["*"], "routes": [_route(len(spec.pool))]}
            ],
        },
        "http_filters": filters,
    }
    clusters = [_pool_cluster(spec)]
    if not spec.round_robin:
        # Only the picker chooses the pod: a client's own header is dropped before any filter.
        connection_manager["early_header_mutation_extensions"] = [
            _typed(
                "envoy.http.early_header_mutation.header_mutation",
                "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                mutations=[{"remove": DESTINATION}],
            )
        ]
        assert spec.epp is not None  # __post_init__
        clusters.append(_epp_cluster(spec.epp))
    http = {"name": "envoy.filters.network.http_connection_manager"}
    listener = {
        "name": "sluice_envoy",
        "address": _socket_address(spec.listen_host, spec.listen_port),
        "filter_chains": [{"filters": [{**http, "typed_config": connection_manager}]}],
    }
    bootstrap: dict[str, Any] = {
        "static_resources": {"listeners": [listener], "clusters": clusters}
    }
    if spec.admin_port is not None:
        bootstrap["admin"] = {"address": _socket_address(spec.admin_host, spec.admin_port)}
    return bootstrap


def bootstrap_json(spec: EnvoySpec) -> str:
    return json.dumps(render_bootstrap(spec), indent=2)


def _ext_proc_filter(spec: EnvoySpec) -> dict[str, Any]:
    duplex = spec.body_mode == "full-duplex"
    processing_mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
        # The answer streams through the EPP chunk by chunk (it counts usage), never buffered.
        "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "STREAMED",
        # Envoy refuses FULL_DUPLEX_STREAMED without them; with BUFFERED none are needed.
        "request_trailer_mode": "SEND" if duplex else "SKIP",
        "response_trailer_mode": "SEND" if duplex else "SKIP",
    }
    namespaces = {"untyped": [LB_NAMESPACE]}
    return _typed(
        "envoy.filters.http.ext_proc",
        "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
        failure_mode_allow=spec.failure_mode_allow,
        status_on_error={"code": 503},  # as an EPP with no endpoint ready answers
        processing_mode=processing_mode,
        message_timeout=_seconds(MESSAGE_TIMEOUT_S),
        max_message_timeout=_seconds(MAX_MESSAGE_TIMEOUT_S),
        metadata_options={"forwarding_namespaces": namespaces, "receiving_namespaces": namespaces},
    )


def _route(pool_size: int) -> dict[str, Any]:
    action: dict[str, Any] = {"cluster": POOL_CLUSTER, "timeout": "0s"}
    retries = min(pool_size - 1, MAX_RETRIES)
    if retries > 0:
        action["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset,5xx",
            "num_retries": retries,
            "retry_host_predicate": [
                _typed(
                    "envoy.retry_host_predicates.previous_hosts",
                    "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
                )
            ],
            "host_selection_retry_max_attempts": 5,
        }
    return {
        "match": {"prefix": "/"},
        "route": action,
        "request_body_buffer_limit": MAX_BODY_BYTES,
    }


def _pool_cluster(spec: EnvoySpec) -> dict[str, Any]:
    cluster = _cluster(POOL_CLUSTER, spec.pool, connect_timeout_s=2.0)
    if spec.round_robin:
        cluster["lb_policy"] = "ROUND_ROBIN"
        return cluster
    round_robin = _typed(
        "envoy.load_balancing_policies.round_robin",
        "extensions.load_balancing_policies.round_robin.v3.RoundRobin",
    )
    override_host = _typed(
        "envoy.load_balancing_policies.override_host",
        "extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[{"metadata": _metadata_key(DESTINATION)}, {"header": DESTINATION}],
        selected_host_key=_metadata_key(DESTINATION_SERVED),
        fallback_policy={"policies": [{"typed_extension_config": round_robin}]},
    )
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": override_host}]}
    return cluster


def _epp_cluster(address: str) -> dict[str, Any]:
    cluster = _cluster(EPP_CLUSTER, (address,), connect_timeout_s=1.0)
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},  # gRPC: h2c
        }
    }
    cluster["health_checks"] = [
        {
            "timeout": "2s",
            "interval": "1s",
            # Before the first request Envoy would check only once a minute: an EPP started
            # after Envoy would stay skipped that long.
            "no_traffic_interval": "1s",
            "unhealthy_threshold": 3,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EPP_HEALTH_SERVICE},
        }
    ]
    cluster["outlier_detection"] = {
        # A refused connection ejects the EPP at once (the health check would take 3 s);
        # a passing health check brings it back. gRPC errors do not eject it.
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "base_ejection_time": "1s",
        "max_ejection_percent": 100,
    }
    # With the EPP unhealthy, fail the stream at once instead of trying it anyway ("panic").
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    return cluster


def _cluster(name: str, addresses: tuple[str, ...], connect_timeout_s: float) -> dict[str, Any]:
    hosts = [parse_address(address) for address in addresses]
    static = all(_is_ip(host) for host, _ in hosts)
    endpoints = [{"endpoint": {"address": _socket_address(h, p)}} for h, p in hosts]
    return {
        "name": name,
        # Names (a Service, localhost) are resolved and re-resolved by Envoy; IPv4 first, as
        # pods are addressed (localhost's ::1 may have no server).
        "type": "STATIC" if static else "STRICT_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": _seconds(connect_timeout_s),
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "circuit_breakers": {"thresholds": [dict.fromkeys(CIRCUIT_LIMITS, CIRCUIT_LIMIT)]},
    }


def _metadata_key(key: str) -> dict[str, Any]:
    return {"key": LB_NAMESPACE, "path": [{"key": key}]}


def _typed(name: str, type_name: str, **fields: Any) -> dict[str, Any]:
    """An extension as Envoy names one: its name, and its config with the config's type."""
    return {"name": name, "typed_config": {"@type": _TYPE + type_name, **fields}}


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
