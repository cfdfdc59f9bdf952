"""The endpoint picker's port: ext_proc's `Process` and gRPC health checking, on one h2c
listener beside the proxy's, in the same process, sharing its decision, fleet and metrics.

Readiness (`readiness`, and the ext_proc service's own name) follows the fleet: SERVING while
a backend takes traffic, looked at every READINESS_INTERVAL_S, so a gateway that health-checks
its picker sends nothing to one that could only answer 503.

Stopping (`close`, on SIGTERM as the proxy's port): readiness turns NOT_SERVING, the listener
closes, every connection gets GOAWAY; requests already in a stream are picked for and
followed to their end (`wait_idle`, within --shutdown-grace), so a rolling update of the
picker loses none of them.
"""

from __future__ import annotations

import trio

from app.epp.grpc_server import GrpcServer
from app.epp.health import HealthService
from app.epp.processor import EndpointPicker
from app.fleet.pool import BackendPool

PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
READINESS_INTERVAL_S = 1.0


class EppDoor:
    def __init__(self, picker: EndpointPicker, pool: BackendPool) -> None:
        self.pool = pool
        self.health = HealthService(ready=pool.any_available(trio.current_time()))
        self.server = GrpcServer({PROCESS_PATH: picker.process, **self.health.handlers()})

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled, or closed and idle; reports the port bound (0: a free one)."""
        async with trio.open_nursery() as nursery:
            bound: int = await nursery.start(self.server.serve, host, port)
            nursery.start_soon(self._follow_readiness)
            task_status.started(bound)

    def close(self) -> None:
        self.health.set_ready(False)
        self.server.close()

    async def wait_idle(self) -> None:
        await self.server.wait_idle()

    async def _follow_readiness(self) -> None:
        while not self.server.closing:
            self.health.set_ready(self.pool.any_available(trio.current_time()))
            await trio.sleep(READINESS_INTERVAL_S)
