"""The stall detector never crashes the process it watches (app/observe/stack_capture.py).

The load that killed Sluice with SIGSEGV when faulthandler dumped every thread: large
conversations (1,500-4,000 short messages) rendered by Jinja2 in worker threads, so that
other threads run Python whenever the stack alarm fires. A child process runs 2,000 such
renders through `trio.to_thread` while a task forces stalls on the loop (alternately
`time.sleep`, which hands the GIL to the renderers, and a pure-Python busy loop), with a
2 ms threshold and a 1 ms probe so the alarm fires on every forced stall and on many GIL
hand-offs besides. The child must exit 0 (a segfault fails the test with its signal); every
forced stall must have fired the alarm; every stack captured must be the loop thread's (no
Jinja2 frame, which only worker threads run), and the forced stalls' own stacks must name
the function that stalled.

Marked slow (5-10 s on 2 cores, a child process), but part of the default run.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.cli.rooms import RoomMetrics
from app.observe.loop_monitor import LoopMonitor

REQUESTS = 2000
RENDER_THREADS = 4
CONVERSATIONS = 12  # distinct ones, reused: renders are not cached, so each costs in full
THRESHOLD_MS = 2.0
PROBE_INTERVAL_S = 0.001
FORCED_STALL_S = 0.012
FORCED_STALL_EVERY_S = 0.02

# A chat template in the style of the shipped ones: a namespace, a loop, string building.
TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages if message['role'] == 'system' -%}
{%- set ns.system = ns.system + message['content'] -%}
{%- endfor -%}
<|begin|>{{ ns.system }}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}<|user|>{{ message['content'] }}
{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}
"""


def conversations(seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    sizes = [1500 + (2500 * index) // (CONVERSATIONS - 1) for index in range(CONVERSATIONS)]
    return [
        [{"role": "system", "content": "Be brief."}]
        + [
            {"role": ("user", "assistant")[turn % 2], "content": f"m{rng.randrange(1000)} ok"}
            for turn in range(size)
        ]
        for size in sizes
    ]


def sleep_on_the_loop() -> None:
    time.sleep(FORCED_STALL_S)


def spin_on_the_loop() -> None:
    deadline = time.perf_counter() + FORCED_STALL_S
    while time.perf_counter() < deadline:
        pass


async def _stress() -> dict[str, Any]:
    template = ImmutableSandboxedEnvironment().from_string(TEMPLATE)
    chats = conversations(seed=7)
    monitor = LoopMonitor(
        RoomMetrics.create().loop, THRESHOLD_MS, instrument=True, probe_interval_s=PROBE_INTERVAL_S
    )
    threads = trio.CapacityLimiter(RENDER_THREADS)
    rendered = 0
    forced = 0
    done = trio.Event()

    def render(messages: list[dict[str, str]]) -> int:
        return len(template.render(messages=messages, add_generation_prompt=True))

    async def request(index: int) -> None:
        nonlocal rendered
        async with threads:
            size = await trio.to_thread.run_sync(render, chats[index % CONVERSATIONS])
        assert size > 0
        rendered += 1

    async def stall_the_loop() -> None:
        nonlocal forced
        while not done.is_set():
            await trio.sleep(FORCED_STALL_EVERY_S)
            (sleep_on_the_loop, spin_on_the_loop)[forced % 2]()
            forced += 1

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        nursery.start_soon(stall_the_loop)
        async with trio.open_nursery() as requests:
            for index in range(REQUESTS):
                requests.start_soon(request, index)
        done.set()
        await trio.sleep(FORCED_STALL_EVERY_S * 2)  # the last forced stall's record
        snapshot = monitor.snapshot()
        nursery.cancel_scope.cancel()
    with_stacks = [record for record in snapshot["recent"] if record["stack"]]
    stacks = [record["stack"] for record in with_stacks]
    forced_names = {sleep_on_the_loop.__name__, spin_on_the_loop.__name__}
    return {
        "requests": rendered,
        "forced_stalls": forced,
        "alarms": snapshot["stack_dumps"],
        "stalls": snapshot["stalls"]["count"],
        "stalls_by_cause": snapshot["stalls"]["by_cause"],
        "distinct_stacks": len(stacks),
        "worker_stacks": sum(any("jinja2" in frame for frame in stack) for stack in stacks),
        "forced_stalls_with_stack": sum(
            record["count"]
            for record in with_stacks
            if record["stack"][0].rsplit(" ", 1)[1] in forced_names
        ),
        "seconds": time.perf_counter() - started,
    }


def child_main() -> None:
    print(json.dumps(trio.run(_stress)))


@pytest.mark.slow
def test_stack_alarm_under_threaded_template_renders_never_crashes() -> None:
    child = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "tests.test_stalls_stress"],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        pytest.fail(f"the child died of {name}:\n{child.stderr[-4000:]}")
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout)
    print(result)

    assert result["requests"] == REQUESTS
    assert result["forced_stalls"] >= 1
    assert result["alarms"] >= result["forced_stalls"], result
    assert result["worker_stacks"] == 0, result
    assert result["forced_stalls_with_stack"] >= result["forced_stalls"] / 2, result


if __name__ == "__main__":
    child_main()
