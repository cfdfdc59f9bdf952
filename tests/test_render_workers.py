"""Render worker processes: how many there may be (at most 4 by default on any machine),
that none starts before a render needs one, that no more start than renders run at once,
that a normal shutdown stops them without a word, and that a proxy killed outright leaves
no orphan behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from app.cli.rooms import RoomMetrics, preprocess_settings
from app.config import Settings
from app.preprocess import workers
from app.preprocess.pipeline import PARSE_ON_LOOP_BYTES, Preprocessor
from tests.conftest import wait_until


def children(pid: int) -> set[int]:
    """The live child processes of `pid`, as Linux lists them."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    return found


def spawned_workers(pid: int) -> set[int]:
    """Its render workers: children running multiprocessing's spawn entry point."""
    workers = set()
    for child in children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            workers.add(child)
    return workers


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize(("cores", "workers"), [(16, 4), (64, 4), (4, 3), (2, 1), (1, 1)])
def test_by_default_at_most_four_render_workers_whatever_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, workers: int
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert Settings().render_workers == workers
    assert Settings(render_workers=12).render_workers == 12  # asked for: as many


def big_body(nonce: int) -> bytes:
    words = "word " * (PARSE_ON_LOOP_BYTES // 4)
    return json.dumps({"model": "m", "prompt": f"{nonce} {words}", "max_tokens": 1}).encode()


async def test_workers_start_on_need_no_more_than_renders_at_once_and_stop_quietly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # a big machine: 4 workers at most
    # Quietly, given the time: beside a CPU hog a worker still loading its tokenizer took
    # over the production grace of 5 s to answer the shutdown, and was killed.
    monkeypatch.setattr(workers, "WORKER_GRACE_SECONDS", 60.0)
    preprocessor = Preprocessor(
        preprocess_settings(Settings(tokenize_queue=64)), RoomMetrics.create().preprocess
    )
    me = os.getpid()
    before = spawned_workers(me)
    with caplog.at_level(logging.WARNING):
        async with preprocessor.running():
            assert spawned_workers(me) == before  # nothing started yet
            await preprocessor.prepare("completion", big_body(0))
            one = spawned_workers(me) - before
            assert len(one) == 1
            async with trio.open_nursery() as nursery:
                for nonce in range(1, 13):
                    nursery.start_soon(preprocessor.prepare, "completion", big_body(nonce))
            started = spawned_workers(me) - before
            assert one <= started and 1 <= len(started) <= 4
        assert not spawned_workers(me) - before
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_a_proxy_killed_outright_leaves_no_worker_behind(tmp_path: Path) -> None:
    port, dashboard = free_port(), free_port()
    # A fleet file names the model: the proxy renders without asking a backend.
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[models]]\nname = "m"\nbackends = ["http://127.0.0.1:9"]\n')
    command = [sys.executable, "-m", "app", "serve", "--config", str(fleet), "--port", str(port)]
    proxy = await trio.lowlevel.open_process(
        [*command, "--dashboard-port", str(dashboard)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proxy.stdout is not None
        printed = b""
        while b"Sluice proxy" not in printed:  # it prints its URLs once listening
            printed += await proxy.stdout.receive_some()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        body = big_body(0)
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        await stream.receive_some()  # answered (a 502: no backend is there), so rendered

        async def a_worker_runs() -> bool:
            return bool(spawned_workers(proxy.pid))

        await wait_until(a_worker_runs, timeout=30)
        workers = spawned_workers(proxy.pid)
        proxy.send_signal(signal.SIGKILL)
        await proxy.wait()

        async def all_gone() -> bool:
            return not any(alive(worker) for worker in workers)

        await wait_until(all_gone, timeout=30)
        await stream.aclose()
    finally:
        proxy.kill()
        await proxy.wait()
