"""`sluice demo` as a user runs it, in its own process group: two models served (one of them
by two simulated GPUs) with traffic reaching both, every simulated GPU and the traffic in a
child process of its own (the proxy's process listens on the proxy's and dashboard's ports
only), Ctrl-C (SIGINT to the whole group) stopping every process cleanly with status 0, and
the children stopping by themselves when the demo is killed outright. Linux only: process
trees and sockets are read from /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60.0

if not Path("/proc/self/fd").is_dir():
    pytest.skip("reads /proc", allow_module_level=True)


class Demo:
    def __init__(self, log: IO[str]) -> None:
        self.log = log  # a file, not a pipe: a pipe nobody reads could fill up
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app", "demo", "--port", "0", "--dashboard-port", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
        self.lines: list[str] = []
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("Sluice dashboard:"):
                self.dashboard_url = line.split()[-1]
            if line.startswith("Press Ctrl-C"):
                break
        self.proxy_url = next(ln for ln in self.lines if ln.startswith("Sluice proxy:")).split()[-1]

    def snapshot(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.dashboard_url + "/api/snapshot", timeout=10) as answer:
            result: dict[str, Any] = json.load(answer)
            return result

    def group(self) -> set[int]:
        """Every live process of its group (children and grandchildren included)."""
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.process.pid and fields[0] != "Z":
                    found.add(int(entry.name))
        return found

    def errors(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def demo() -> Iterator[Demo]:
    with tempfile.TemporaryFile(mode="w+") as log:
        running = Demo(log)
        yield running
        running.stop()


def listening_ports(pid: int) -> set[int]:
    """The TCP ports `pid` itself listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_two_models_with_gpus_and_traffic_in_processes_of_their_own(demo: Demo) -> None:
    def both_models_answered() -> bool:
        models = {m["name"]: m for m in demo.snapshot()["models"]}
        return set(models) == {"sim-large", "sim-small"} and all(
            m["requests"]["codes"].get("200", 0) > 0 for m in models.values()
        )

    wait_for(both_models_answered, "traffic reached both models")
    snapshot = demo.snapshot()
    large, small = snapshot["models"]
    assert large["aliases"] == ["chat-default"] and len(large["pool"]["backends"]) == 2
    assert small["chat_template"] == "shipped:chatml" and small["max_model_len"] == 32768
    sims = {port_of(b["url"]) for b in snapshot["backends"]}
    assert len(sims) == 3
    own = listening_ports(demo.process.pid)
    assert {port_of(demo.proxy_url), port_of(demo.dashboard_url)} <= own
    assert not sims & own  # the simulated GPUs listen in other processes...
    children = demo.group() - {demo.process.pid}
    assert sims <= set().union(*(listening_ports(pid) for pid in children))  # ...its children
    # The traffic too: requests keep arriving although no process of ours but the demo's
    # children sends any.
    before = snapshot["requests"]["total"]
    wait_for(lambda: demo.snapshot()["requests"]["total"] > before, "traffic flows")

    # Ctrl-C: the terminal sends SIGINT to the whole group.
    os.killpg(demo.process.pid, signal.SIGINT)
    assert demo.process.wait(timeout=WAIT_S) == 0
    wait_for(lambda: not demo.group(), "every process of the demo stopped")
    errors = demo.errors()
    assert "Traceback" not in errors and "KeyboardInterrupt" not in errors, errors


def test_the_children_stop_when_the_demo_is_killed_outright(demo: Demo) -> None:
    children = demo.group() - {demo.process.pid}
    assert len(children) >= 4  # three simulated GPUs and the traffic
    demo.process.kill()
    demo.process.wait()
    wait_for(lambda: not demo.group(), "the children noticed their parent was gone")
