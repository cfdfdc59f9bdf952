"""LoRA adapters through a real Sluice in front of simulated engines over HTTP: requests for an
adapter go to the engine whose slots hold it, the next adapter to an engine with a free slot
(the dashboard's backend rows show them); with `--lora-load-on-demand`, concurrent first
requests for an adapter no engine lists load it once and are all answered, a hot adapter
whose engine is full is loaded on one more, a full engine unloads its least recently used
adapter first, an SGLang engine's refusal when full is learnt and answered by an unload, and
a load that cannot succeed is an OpenAI-shaped 503 after its retries."""

from __future__ import annotations

import dataclasses

import httpx
import trio

from app.fleet.backends import Backend
from app.models import AdapterConfig
from tests.conftest import RunningSluice, StartSim, StartSluice, wait_until
from tests.sims import QUICK

BASE = "base-model"
LORA = dataclasses.replace(QUICK, models=(BASE,), max_loras=1, lora_load_time=0.05)
TABLE = tuple(AdapterConfig(name, f"/loras/{name}", BASE) for name in ("x", "y", "z"))


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def ask(client: httpx.AsyncClient, running: RunningSluice, model: str) -> httpx.Response:
    return await client.post(running.proxy_url + "/v1/chat/completions", json=chat(model))


async def reported(client: httpx.AsyncClient, running: RunningSluice) -> None:
    """Until every engine's adapter report (its max_lora) came: an engine writes one at its
    first request, so each is sent one for the base model, and one more goes through Sluice
    (its scrapes follow its traffic)."""
    backends: list[Backend] = running.sluice.pool.backends

    async def every() -> bool:
        return all(b.adapters.max_lora is not None for b in backends)

    for backend in backends:
        await client.post(backend.url + "/v1/chat/completions", json=chat(BASE))
    await ask(client, running, BASE)
    await wait_until(every)


async def test_adapter_requests_keep_to_the_engine_that_holds_the_adapter(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    modules = ("a=/loras/a", "b=/loras/b")
    sims = [await start_sim(LORA, lora_modules=modules, seed=i) for i in range(2)]
    running = await start_sluice([sim.url for sim in sims])
    await reported(client, running)
    first = await ask(client, running, "a")
    assert first.status_code == 200
    holder = first.headers["x-sluice-backend"]
    for _ in range(6):
        again = await ask(client, running, "a")
        assert again.headers["x-sluice-backend"] == holder
    other = await ask(client, running, "b")
    assert other.status_code == 200 and other.headers["x-sluice-backend"] != holder
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert 'sluice_lora_routes_total{tier="resident"} 6.0' in metrics
    snapshot = (await client.get(running.dashboard_url + "/api/snapshot")).json()
    rows = {row["url"]: row["adapters"] for row in snapshot["backends"]}
    assert rows[holder]["listed"] == ["a", "b"] and rows[holder]["max_lora"] == 1
    assert rows[holder]["resident"] == ["a"]


async def test_concurrent_first_requests_load_an_adapter_once(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(LORA, seed=i) for i in range(2)]
    running = await start_sluice(
        [sim.url for sim in sims], lora_load_on_demand=True, adapters=TABLE
    )
    await reported(client, running)
    models = (await client.get(running.proxy_url + "/v1/models")).json()["data"]
    assert {m["id"]: m["parent"] for m in models if m["id"] == "x"} == {"x": BASE}
    answers: list[httpx.Response] = []

    async def one() -> None:
        answers.append(await ask(client, running, "x"))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(one)
    assert [a.status_code for a in answers] == [200] * 20
    loads = [sim.app.state()["lora"]["loads"] for sim in sims]
    assert sorted(loads) == [0, 1]
    # y goes to the engine with a free slot; z finds both full and unloads the coldest.
    assert (await ask(client, running, "y")).status_code == 200
    assert [sim.app.state()["lora"]["loads"] for sim in sims] == [1, 1]
    assert (await ask(client, running, "x")).status_code == 200  # x is now the warmer one
    assert (await ask(client, running, "z")).status_code == 200
    adapters = [set(sim.app.state()["lora"]["adapters"]) for sim in sims]
    assert sorted(adapters, key=sorted) == [{"x"}, {"z"}]
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert metrics.count('sluice_lora_unloads_total{backend="') == 1


async def test_a_hot_adapter_is_loaded_on_one_more_engine_when_its_holder_is_full(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    two_seats = dataclasses.replace(LORA, max_num_seqs=2, inter_token_latency=0.02)
    sims = [await start_sim(two_seats, seed=i) for i in range(2)]
    running = await start_sluice(
        [sim.url for sim in sims], lora_load_on_demand=True, adapters=TABLE
    )
    await reported(client, running)
    assert (await ask(client, running, "x")).status_code == 200
    assert sorted(sim.app.state()["lora"]["loads"] for sim in sims) == [0, 1]
    answers: list[httpx.Response] = []

    async def one() -> None:
        body = {**chat("x"), "max_tokens": 40}  # 0.8 s on one of its engine's 2 seats
        answers.append(await client.post(running.proxy_url + "/v1/chat/completions", json=body))

    async with trio.open_nursery() as nursery:
        for _ in range(16):  # 4 a second, where its engine answers 2.5: a queue grows there
            nursery.start_soon(one)
            await trio.sleep(0.25)
    assert [a.status_code for a in answers] == [200] * 16
    assert [sim.app.state()["lora"]["loads"] for sim in sims] == [1, 1]
    assert len({a.headers["x-sluice-backend"] for a in answers}) == 2


async def test_an_sglang_refusal_when_full_is_answered_by_an_unload(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(LORA, metrics_style="sglang", max_cpu_loras=1)
    running = await start_sluice([sim.url], lora_load_on_demand=True, adapters=TABLE)
    assert (await ask(client, running, "x")).status_code == 200
    assert (await ask(client, running, "y")).status_code == 200
    assert set(sim.app.state()["lora"]["adapters"]) == {"y"}
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert "sluice_lora_loads_total" in metrics and 'outcome="failed"' in metrics


async def test_a_load_that_cannot_succeed_is_a_503_after_its_retries(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(QUICK, models=(BASE,))  # no LoRA: no adapter endpoints at all
    running = await start_sluice([sim.url], lora_load_on_demand=True, adapters=TABLE)
    answer = await ask(client, running, "x")
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "adapter_not_loaded" and "x" in error["message"]
    assert (await ask(client, running, BASE)).status_code == 200
