"""gRPC health checking (grpc.health.v1.Health) on the endpoint-picker door's port.

Envoy's gRPC health checks, Kubernetes' `grpc:` probes and `grpc_health_probe` all speak
this protocol, so the EPP answers it beside ext_proc. A status per service name:

- ""          the server as a whole: SERVING while it runs;
- "liveness"  SERVING while it runs (a restart would not help otherwise);
- "readiness" and "envoy.service.ext_proc.v3.ExternalProcessor": NOT_SERVING until Sluice
  has a backend that takes traffic; its owner calls `set_ready` as that changes, so a
  gateway sends no request to an EPP that could only refuse it.

Check: the status, or NOT_FOUND (5) for a name we do not know, as the protocol says.
Watch: the status at once, then each change, until the client cancels; a name we do not
know gets SERVICE_UNKNOWN and the call stays open, as the protocol says. The messages are
messages.py's (no grpcio-health-checking at run time).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

import trio
from google.protobuf.message import DecodeError

from app.epp.grpc_server import Handler, MessageStream
from app.epp.grpc_wire import GrpcError, StatusCode
from app.epp.messages import HealthCheckRequest, HealthCheckResponse

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
CHECK_PATH = "/grpc.health.v1.Health/Check"
WATCH_PATH = "/grpc.health.v1.Health/Watch"


class ServingStatus(enum.IntEnum):
    """grpc.health.v1.HealthCheckResponse.ServingStatus."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3  # Watch only


SERVING = ServingStatus.SERVING
NOT_SERVING = ServingStatus.NOT_SERVING
SERVICE_UNKNOWN = ServingStatus.SERVICE_UNKNOWN
# The services that follow `set_ready`.
READINESS_SERVICES = ("readiness", EXT_PROC_SERVICE)


def unary(function: Callable[[bytes], Awaitable[bytes]]) -> Handler:
    """A handler for a unary method: one request message in, one response message out."""

    async def handle(stream: MessageStream) -> None:
        request = await stream.receive()
        if request is None:
            raise GrpcError(StatusCode.INTERNAL, "no request message")
        await stream.send(await function(request))

    return handle


def _parse_request(message: bytes) -> str:
    try:
        return str(HealthCheckRequest.FromString(message).service)
    except DecodeError as error:
        raise GrpcError(StatusCode.INVALID_ARGUMENT, "malformed HealthCheckRequest") from error


def _response(status: ServingStatus) -> bytes:
    return bytes(HealthCheckResponse(status=int(status)).SerializeToString())


class HealthService:
    """The serving status of each service name, set at run time on the loop's thread."""

    def __init__(self, *, ready: bool = False) -> None:
        self._statuses: dict[str, ServingStatus] = {
            "": SERVING,
            "liveness": SERVING,
        }
        for service in READINESS_SERVICES:
            self._statuses[service] = SERVING if ready else NOT_SERVING
        # Set, and replaced, on every change: what Watch calls wait on.
        self._changed = trio.Event()

    def status(self, service: str) -> ServingStatus | None:
        """The service's status; None for a name we do not know."""
        return self._statuses.get(service)

    def set_status(self, service: str, status: ServingStatus) -> None:
        """Set (or add) a service's status; its watchers hear of a change."""
        if self._statuses.get(service) == status:
            return
        self._statuses[service] = status
        self._changed.set()
        self._changed = trio.Event()

    def set_ready(self, ready: bool) -> None:
        """Whether Sluice has a backend that takes traffic: readiness and ext_proc."""
        for service in READINESS_SERVICES:
            self.set_status(service, SERVING if ready else NOT_SERVING)

    async def check(self, request: bytes) -> bytes:
        service = _parse_request(request)
        status = self._statuses.get(service)
        if status is None:
            raise GrpcError(StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return _response(status)

    async def watch(self, stream: MessageStream) -> None:
        request = await stream.receive()
        if request is None:
            raise GrpcError(StatusCode.INTERNAL, "no request message")
        service = _parse_request(request)
        sent: ServingStatus | None = None
        while True:
            # Taken before the status is read: a change while we send is not missed.
            changed = self._changed
            status = self._statuses.get(service, SERVICE_UNKNOWN)
            if status != sent:
                await stream.send(_response(status))
                sent = status
            await changed.wait()

    def handlers(self) -> dict[str, Handler]:
        """Method path -> handler, to merge into the door's `serve_grpc` handlers."""
        return {CHECK_PATH: unary(self.check), WATCH_PATH: self.watch}
