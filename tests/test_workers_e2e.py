"""`sluice serve --workers 2` as a user runs it, in front of a simulated backend: both
workers really share the proxy port (connections land on both, told apart by the pid in the
port's /metrics); the one dashboard shows both, sums their requests, serves every worker's
metrics under a `worker` label and flips the saturation policy of both at once; a worker
killed with SIGKILL is started again, and says so in the log and on the dashboard; SIGTERM
stops the supervisor and every worker; a worker that cannot start stops everything with
its status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import StartSim, wait_until

pytestmark = pytest.mark.slow

SERVE = ("serve", "--port", "0", "--dashboard-port", "0", "--workers", "2")
LEAN = ("--render-workers", "1", "--tokenize-threads", "1", "--health-check-interval", "0.2")


class Supervised:
    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log
        self.proxy = ""
        self.dashboard = ""

    async def started(self) -> None:
        """Wait for the two URL lines it prints once every worker listens."""
        with trio.fail_after(90):
            while not self.dashboard:
                text = self.log.read_text(errors="replace")
                for line in text.splitlines():
                    if line.startswith("Sluice proxy:"):
                        self.proxy = line.split()[-1]
                    if line.startswith("Sluice dashboard:"):
                        self.dashboard = line.split()[-1]
                assert self.process.poll() is None, text[-3000:]
                await trio.sleep(0.1)

    async def wait_exit(self, timeout: float) -> int:
        with trio.fail_after(timeout):
            while self.process.poll() is None:
                await trio.sleep(0.05)
        return self.process.returncode


def start(tmp_path: Path, *args: str) -> Supervised:
    log = tmp_path / "sluice.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", *args], stdout=out, stderr=subprocess.STDOUT
        )
    return Supervised(process, log)


async def snapshot(client: httpx.AsyncClient, dashboard: str) -> dict[str, Any]:
    response = await client.get(dashboard + "/api/snapshot")
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


async def pids_answering(proxy: str, connections: int) -> set[str]:
    """The worker pids that answered `connections` fresh connections' /metrics."""
    pids: set[str] = set()
    for _ in range(connections):
        async with httpx.AsyncClient(trust_env=False, timeout=10) as fresh:
            text = (await fresh.get(proxy + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("sluice_worker_info{"):
                pids.add(line.split('pid="')[1].split('"')[0])
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_workers_share_the_port_restart_when_killed_and_stop_together(
    start_sim: StartSim, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = await start_sim()
    supervised = start(tmp_path, *SERVE, *LEAN, "--backend", sim.url, "--shutdown-grace", "2")
    try:
        await supervised.started()
        first = await snapshot(client, supervised.dashboard)
        assert first["workers"]["count"] == 2
        rows = first["workers"]["rows"]
        assert [r["state"] for r in rows] == ["up", "up"]
        worker_pids = {str(r["pid"]) for r in rows}

        # The kernel spreads connections over both listeners.
        assert await pids_answering(supervised.proxy, 24) == worker_pids

        chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        for _ in range(6):
            async with httpx.AsyncClient(trust_env=False, timeout=10) as fresh:
                response = await fresh.post(supervised.proxy + "/v1/chat/completions", json=chat)
                assert response.status_code == 200

        async def summed() -> bool:
            merged = await snapshot(client, supervised.dashboard)
            per_worker = [r["requests_total"] or 0 for r in merged["workers"]["rows"]]
            return merged["requests"]["total"] == 6 == sum(per_worker)

        await wait_until(summed, timeout=10)
        metrics = (await client.get(supervised.dashboard + "/metrics")).text
        assert 'worker="0"' in metrics and 'worker="1"' in metrics
        assert metrics.count("# TYPE sluice_proxy_overhead_seconds histogram") == 1

        # The switch reaches both workers, and the page shows the policy in force.
        answer = await client.put(
            supervised.dashboard + "/api/policy", json={"saturation": "bail-out"}
        )
        assert answer.json() == {"saturation": "bail-out"}

        async def both_bail_out() -> bool:
            merged = await snapshot(client, supervised.dashboard)
            seen = [r["saturation"] for r in merged["workers"]["rows"]]
            return merged["preprocess"]["saturation"] == "bail-out" and seen == ["bail-out"] * 2

        await wait_until(both_bail_out, timeout=10)

        # kill -9 one worker: it comes back, with a new pid, and says so.
        killed = rows[0]["pid"]
        os.kill(killed, signal.SIGKILL)

        async def restarted() -> bool:
            merged = await snapshot(client, supervised.dashboard)
            row = merged["workers"]["rows"][0]
            return row["state"] == "up" and row["pid"] != killed and row["restarts"] == 1

        await wait_until(restarted, timeout=60)
        merged = await snapshot(client, supervised.dashboard)
        assert any("SIGKILL" in n["text"] for n in merged["notices"])
        assert merged["workers"]["rows"][0]["last_exit"] == "was killed by SIGKILL"
        assert f"worker 0 (pid {killed}) was killed by SIGKILL" in supervised.log.read_text()
        # The new one took the policy in force, not the flag's.
        await wait_until(both_bail_out, timeout=10)

        # SIGTERM: the supervisor and every worker stop.
        now_pids = [r["pid"] for r in merged["workers"]["rows"]]
        supervised.process.send_signal(signal.SIGTERM)
        assert await supervised.wait_exit(timeout=30) == 0
        assert not any(alive(pid) for pid in now_pids)
        # The merged page was built every tick without a failure.
        assert "tick failed" not in supervised.log.read_text()
    finally:
        if supervised.process.poll() is None:
            supervised.process.kill()
            supervised.process.wait()


async def test_a_worker_that_cannot_start_stops_everything_with_its_status(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "no-such-tokenizer.json"
    supervised = start(
        tmp_path, *SERVE, *LEAN, "--backend", "http://127.0.0.1:9", "--tokenizer", str(missing)
    )
    try:
        assert await supervised.wait_exit(timeout=60) == 2
        text = supervised.log.read_text()
        assert "before listening" in text
        assert "Sluice proxy:" not in text
    finally:
        if supervised.process.poll() is None:
            supervised.process.kill()
            supervised.process.wait()
