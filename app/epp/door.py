"""The endpoint picker's port: ext_proc's `Process` and gRPC health checking, on one h2c
listener beside the proxy's, in the same process, sharing its decision, fleet and metrics.

Readiness (`readiness`, and the ext_proc service's own name) follows the fleet: SERVING while
a backend takes traffic, looked at every READINESS_INTERVAL_S, so a gateway that health-checks
its picker sends nothing to one that could only answer 503.
"""

from __future__ import annotations

import trio

from app.epp.grpc_server import serve_grpc
from app.epp.health import HealthService
from app.epp.processor import EndpointPicker
from app.fleet.backends import BackendPool

PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
READINESS_INTERVAL_S = 1.0


async def serve_epp(
    picker: EndpointPicker,
    pool: BackendPool,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; reports the port bound (`port` 0: a free one)."""
    health = HealthService(ready=pool.any_available(trio.current_time()))
    handlers = {PROCESS_PATH: picker.process, **health.handlers()}
    async with trio.open_nursery() as nursery:
        bound: int = await nursery.start(serve_grpc, handlers, host, port)
        nursery.start_soon(_follow_readiness, health, pool)
        task_status.started(bound)


async def _follow_readiness(health: HealthService, pool: BackendPool) -> None:
    while True:
        health.set_ready(pool.any_available(trio.current_time()))
        await trio.sleep(READINESS_INTERVAL_S)
