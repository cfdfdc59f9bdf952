"""The saturation signal an autoscaler scales a model's engines on
(app/observe/saturation_signal.py):

- the figure from its parts: the share of engines saturated plus held requests over the
  room; a model without an engine taking traffic reads 1 and more;
- `--workers N`: the supervisor's merged exposition gives it once per model, the largest
  ratio plus every worker's held requests over the room, not a sum of the workers' figures;
- the dashboard's merge of several workers' snapshots makes the figure again the same way;
- the fair queue's oldest held request, and the gate's reading of a pool (autojump clock);
- a disaggregated pool's share saturated by role, at /metrics with the model and role labels;
- a real Sluice before a simulated GPU of one sequence: at /metrics with the model label, above
  1 while requests are held, 0 again once they are answered.
"""

from __future__ import annotations

from typing import cast

import httpx
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.config import BackendRole
from app.dashboard.snapshot import Snapshot
from app.dashboard.worker_snapshots import merge_snapshots
from app.fleet.pool import BackendPool
from app.observe.saturation_signal import (
    ModelSignal,
    RoleShare,
    SaturationCollector,
    combine,
    saturation,
)
from app.observe.worker_metrics import merge_worker_metrics
from app.routing.admission import Admission, FairQueue, Held
from app.routing.decision import RouteRequest
from tests.conftest import MODEL, StartSim, StartSluice, wait_until
from tests.gate_fakes import Routes, full, gate_for, pool_of, reported


def test_the_figure_is_the_share_saturated_plus_held_over_the_room() -> None:
    idle = ModelSignal("m", engines=4, saturated=0, held=0, room=16, oldest_held_s=0.0)
    assert (idle.engines_saturated_ratio, idle.saturation) == (0.0, 0.0)
    half = ModelSignal("m", engines=4, saturated=2, held=0, room=16, oldest_held_s=0.0)
    assert half.saturation == 0.5
    beyond = ModelSignal("m", engines=4, saturated=4, held=8, room=16, oldest_held_s=1.0)
    assert beyond.saturation == 1.5  # half a pool more than it has
    nothing = ModelSignal("m", engines=0, saturated=0, held=3, room=0, oldest_held_s=1.0)
    assert nothing.saturation == 4.0  # nothing serves it: 1, and each held request on top
    assert saturation(1.0, 2, 0) == 3.0  # a room of 0 counts as 1


def test_workers_combine_the_largest_ratio_with_every_workers_held_requests() -> None:
    combined = combine(
        [("m", 0.5), ("m", 1.0), ("n", 0.0)], [("m", 4.0), ("m", 4.0)], [("m", 16.0), ("n", 8.0)]
    )
    assert combined == {"m": 1.5, "n": 0.0}


def worker_text(ratio: float, held: int, room: int) -> str:
    return (
        "# TYPE sluice_admission_saturation gauge\n"
        f'sluice_admission_saturation{{model="m"}} {ratio + held / room}\n'
        "# TYPE sluice_admission_engines_saturated_ratio gauge\n"
        f'sluice_admission_engines_saturated_ratio{{model="m"}} {ratio}\n'
        "# TYPE sluice_admission_held gauge\n"
        f'sluice_admission_held{{model="m"}} {held}\n'
        "# TYPE sluice_admission_room gauge\n"
        f'sluice_admission_room{{model="m"}} {room}\n'
    )


def test_the_supervisors_exposition_gives_the_combined_figure_once_per_model() -> None:
    texts = {0: worker_text(1.0, 4, 8), 1: worker_text(0.5, 2, 8)}
    merged = merge_worker_metrics(texts, {0: True, 1: True}, {}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    (only,) = families["sluice_admission_saturation"].samples
    assert (only.labels, only.value) == ({"model": "m"}, 1.75)  # 1.0 + (4 + 2) / 8
    held = families["sluice_admission_held"].samples  # the parts keep their workers
    assert sorted(s.labels["worker"] for s in held) == ["0", "1"]


def test_the_dashboards_merge_makes_the_figure_from_the_merged_parts() -> None:
    def worker(ratio: float, held: int, oldest: float) -> Snapshot:
        model = {"held": held, "saturation": ratio + held / 8, "engines_saturated_ratio": ratio,
                 "room": 8, "oldest_held_s": oldest}  # fmt: skip
        return cast(Snapshot, {"admission": {"window_s": 60, "models": {"m": model}}})

    merged = merge_snapshots([worker(1.0, 4, 2.0), worker(0.5, 2, 3.0)])
    model = merged["admission"]["models"]["m"]
    assert (model["held"], model["room"], model["oldest_held_s"]) == (6, 8, 3.0)
    assert model["saturation"] == 1.75


def test_the_oldest_held_request_is_the_first_of_some_tenant() -> None:
    queue = FairQueue(max_held=8, max_per_tenant=8)
    assert queue.oldest_arrival() is None
    for tenant, at in (("a", 1.0), ("a", 2.0), ("b", 3.0), ("b", 4.0)):
        queue.push(Held(tenant, 1.0, 0, at))
    assert queue.oldest_arrival() == 1.0
    popped = queue.pop()
    assert popped is not None and popped.arrived == 1.0
    assert queue.oldest_arrival() == 2.0


async def test_the_gate_reads_its_pool_held_requests_and_their_age(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = pool_of(2, room=1)
    routes = Routes()
    gate = gate_for(pool, routes)
    assert gate.signals() == []  # no model served, nothing held
    async with trio.open_nursery() as nursery:
        for number in range(4):  # one runs and one waits at each engine
            nursery.start_soon(gate.enter, RouteRequest(text=str(number)), (), Admission())
        for _ in range(3):
            nursery.start_soon(gate.enter, RouteRequest(text="held"), (), Admission())
        await trio.sleep(2.0)
        for backend in pool.backends:
            reported(backend, 1, 1, at=trio.current_time())
        (signal,) = gate.signals()
        assert (signal.model, signal.engines, signal.saturated, signal.room) == ("(none)", 2, 2, 2)
        assert signal.held == 3 and signal.oldest_held_s == pytest.approx(2.0)
        assert signal.saturation == 1.0 + 3 / 2
        nursery.cancel_scope.cancel()


async def test_a_disaggregated_pool_reads_each_roles_share_saturated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    roles = {
        f"http://{role}-{n}:8000": BackendRole(f"http://{role}-{n}:8000", role)
        for role in ("prefill", "decode")
        for n in range(2)
    }
    served = {url: ("m",) for url in roles}
    pool = BackendPool(
        tuple(roles), failures_to_open=3, cooldown=10.0, probe_path="/health",
        configured=served, roles=roles,
    )  # fmt: skip
    now = trio.current_time()
    for backend in pool.backends:
        backend.healthy = True
        full(backend, 4, at=now)
        reported(backend, 0, 0, at=now)
    prefill_0, _, decode_0, decode_1 = pool.backends
    reported(prefill_0, 4, 2, at=now)  # its own queue is not empty: saturated
    (signal,) = gate_for(pool, Routes()).signals()
    assert signal.roles == (RoleShare("decode", 2, 0), RoleShare("prefill", 2, 1))
    assert signal.engines_saturated_ratio == 0.25
    decode_0.healthy = decode_1.healthy = False
    (signal,) = gate_for(pool, Routes()).signals()
    assert signal.roles == (RoleShare("decode", 0, 0), RoleShare("prefill", 2, 1))
    assert [share.ratio for share in signal.roles] == [1.0, 0.5]  # no decode engine: 1


def test_the_role_shares_are_exported_with_model_and_role_labels() -> None:
    registry = CollectorRegistry()
    signal = ModelSignal(
        "m", 4, 1, 0, 16, 0.0, (RoleShare("decode", 2, 0), RoleShare("prefill", 2, 1))
    )
    SaturationCollector(registry).set_function(lambda: [signal])
    samples = [
        sample
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == "sluice_admission_role_engines_saturated_ratio"
    ]
    assert {(s.labels["model"], s.labels["role"]): s.value for s in samples} == {
        ("m", "decode"): 0.0,
        ("m", "prefill"): 0.5,
    }
    plain = ModelSignal("m", 4, 1, 0, 16, 0.0)
    SaturationCollector(other := CollectorRegistry()).set_function(lambda: [plain])
    assert b"sluice_admission_role_engines_saturated_ratio{" not in generate_latest(other)


def saturation_of(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == MODEL and family.name.startswith("sluice_admission_")
    }


async def test_the_gauge_rises_while_requests_are_held_and_returns_to_zero(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(max_num_seqs=1, inter_token_latency=0.02, metrics_style="sglang")
    running = await start_sluice([sim.url], admission_timeout=60)
    metrics_url = running.proxy_url + "/metrics"

    async def answered(tokens: int) -> None:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        answer = await client.post(
            running.proxy_url + "/v1/chat/completions", json={**payload, "max_tokens": tokens}
        )
        assert answer.status_code == 200

    async def figures() -> dict[str, float]:
        return saturation_of((await client.get(metrics_url)).text)

    async def idle() -> bool:
        return (await figures()).get("sluice_admission_saturation") == 0.0

    await wait_until(idle, timeout=10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answered, 150)  # ~3 s on the engine's one sequence
        for _ in range(4):
            nursery.start_soon(answered, 2)

        async def held() -> bool:
            return running.sluice.router.gate.held >= 2

        await wait_until(held, timeout=10)
        busy = await figures()
        assert busy["sluice_admission_engines_saturated_ratio"] == 1.0
        assert busy["sluice_admission_room"] == 1.0
        assert busy["sluice_admission_saturation"] >= 1.0 + 2
        assert busy["sluice_admission_oldest_held_seconds"] > 0.0
    await wait_until(idle, timeout=10)
    assert (await figures())["sluice_admission_oldest_held_seconds"] == 0.0
