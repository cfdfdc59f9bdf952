"""A real Envoy for tests: started on free ports in front of a pool (and a picker), stopped after.

    async with envoy_running(EnvoySpec(pool=(...), epp="127.0.0.1:PORT"), tmp_path) as envoy:
        await client.post(f"{envoy.url}/v1/chat/completions", json=...)

or, for the test's whole length, `envoy = await nursery.start(serve_envoy, spec, tmp_path)`.
The spec's listener and admin ports are replaced by 0 (and hosts by 127.0.0.1): Envoy binds
free ones, writes its admin address to a file (`--admin-address-path`), and the listener's
port is read back from the admin API once `/ready` answers. `--use-dynamic-base-id` lets
several Envoys run at once; `--concurrency 1` keeps each to one worker thread. Envoy's log
goes to a file in the given directory; `RunningEnvoy.log()` returns it for failure messages.
Tests skip with `requires_envoy` when no binary is installed.
"""

from __future__ import annotations

import dataclasses
import itertools
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from app.cli.envoy import INSTALL_HINT, find_envoy
from app.epp.envoy_bootstrap import EPP_CLUSTER, EnvoySpec, bootstrap_json

ENVOY = find_envoy()
requires_envoy = pytest.mark.skipif(ENVOY is None, reason=f"no envoy binary: {INSTALL_HINT}")

POLL_INTERVAL = 0.02
# Envoy is ready in well under a second here; the bound is for a loaded CI machine.
READY_POLLS = 1500
STOP_GRACE = 5.0

_numbers = itertools.count()


class EnvoyFailed(RuntimeError):
    """Envoy exited, or never became ready; the message ends with its log."""


@dataclasses.dataclass
class RunningEnvoy:
    url: str  # http://127.0.0.1:PORT, the listener
    admin_url: str
    log_path: Path
    process: trio.Process
    admin: httpx.AsyncClient  # open while Envoy runs

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def admin_json(self, path: str) -> Any:
        """GET an admin page as JSON (`/clusters?format=json`, `/stats?format=json`...)."""
        response = await self.admin.get(self.admin_url + path)
        response.raise_for_status()
        return response.json()

    async def epp_is_down(self) -> bool:
        """Envoy counts the picker out: ejected or failing its health checks (not healthy)."""
        clusters = await self.admin_json("/clusters?format=json")
        for cluster in clusters["cluster_statuses"]:
            if cluster["name"] == EPP_CLUSTER:
                flags = cluster["host_statuses"][0]["health_status"]
                return any(
                    value is True for key, value in flags.items() if key != "eds_health_status"
                )
        raise AssertionError(f"no {EPP_CLUSTER} cluster in Envoy's /clusters")


@asynccontextmanager
async def envoy_running(spec: EnvoySpec, log_dir: Path) -> AsyncIterator[RunningEnvoy]:
    """Envoy with `spec`'s bootstrap, on free loopback ports, until the block ends."""
    if ENVOY is None:
        pytest.skip(f"no envoy binary: {INSTALL_HINT}")
    spec = dataclasses.replace(
        spec, listen_host="127.0.0.1", listen_port=0, admin_host="127.0.0.1", admin_port=0
    )
    stem = log_dir / f"envoy-{next(_numbers)}"
    config, admin_file, log_path = (stem.with_suffix(s) for s in (".json", ".admin", ".log"))
    config.write_text(bootstrap_json(spec))
    command = [ENVOY, "-c", str(config), "--admin-address-path", str(admin_file)]
    command += ["--use-dynamic-base-id", "--concurrency", "1", "--log-level", "info"]
    # Plain HTTP on loopback: no TLS context, whose CA bundle costs ~0.3 s of the loop.
    admin = httpx.AsyncClient(timeout=5, trust_env=False, verify=False)
    async with admin:
        with log_path.open("wb") as log:
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
            try:
                yield await _ready(process, admin, admin_file, log_path)
            finally:
                with trio.CancelScope(shield=True):
                    await _stop(process)


async def serve_envoy(
    spec: EnvoySpec,
    log_dir: Path,
    *,
    task_status: trio.TaskStatus[RunningEnvoy] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`nursery.start(serve_envoy, spec, tmp_path)`: reports the RunningEnvoy, stops Envoy
    when cancelled."""
    async with envoy_running(spec, log_dir) as envoy:
        task_status.started(envoy)
        await trio.sleep_forever()


async def _ready(
    process: trio.Process, admin: httpx.AsyncClient, admin_file: Path, log_path: Path
) -> RunningEnvoy:
    """Poll (bounded) until the admin API says ready, then read the listener's port."""
    for _ in range(READY_POLLS):
        if process.poll() is not None:
            raise EnvoyFailed(_failure(f"envoy exited with {process.returncode}", log_path))
        written = trio.Path(admin_file)
        address = (await written.read_text()).strip() if await written.exists() else ""
        if address:
            admin_url = f"http://{address}"
            try:
                ready = (await admin.get(f"{admin_url}/ready")).status_code == 200
            except httpx.TransportError:
                ready = False
            if ready:
                listeners = (await admin.get(f"{admin_url}/listeners?format=json")).json()
                bound = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                url = f"http://{bound['address']}:{bound['port_value']}"
                return RunningEnvoy(url, admin_url, log_path, process, admin)
        await trio.sleep(POLL_INTERVAL)
    raise EnvoyFailed(_failure(f"envoy not ready after {READY_POLLS} polls", log_path))


async def _stop(process: trio.Process) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE):
            await process.wait()
    if process.poll() is None:
        process.kill()
        await process.wait()


def _failure(what: str, log_path: Path) -> str:
    return f"{what}; its log ({log_path}):\n{log_path.read_text(errors='replace')[-4000:]}"
