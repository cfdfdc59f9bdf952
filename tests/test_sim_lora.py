"""The simulated backend's LoRA adapters over real HTTP, as vLLM (and SGLang) answer: load,
unload and their refusals, concurrent loads of one name, the load time, `/v1/models` cards with
`root` and `parent`, requests naming an adapter (served while loaded, vLLM's 404 after),
`vllm:lora_requests_info` and the sim's load counter read by the proxy's own metric parser,
and the flags."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import trio

from app.cli.command import ConfigExit, parse
from app.fleet.engine_metrics import samples
from app.sim.settings import SimSettings
from tests.conftest import StartSim
from tests.sims import QUICK

BASE = "base-model"
LORA = dataclasses.replace(
    QUICK, models=(BASE,), max_loras=2, lora_load_time=0.2, lora_modules=("early=/loras/early",)
)
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}


async def load(client: httpx.AsyncClient, url: str, name: str, path: str) -> httpx.Response:
    return await client.post(
        url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
    )


async def test_load_list_serve_unload_as_vllm_answers(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(LORA)
    started = trio.current_time()
    loaded = await load(client, sim.url, "sql", "/loras/sql")
    assert trio.current_time() - started >= LORA.lora_load_time
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'sql' added successfully.",
    )
    assert "content-type" not in loaded.headers  # FastAPI's Response with no media type

    cards = (await client.get(sim.url + "/v1/models")).json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (BASE, BASE, None),
        ("early", "/loras/early", BASE),
        ("sql", "/loras/sql", BASE),
    ]
    answer = await client.post(sim.url + "/v1/chat/completions", json={**CHAT, "model": "sql"})
    assert (answer.status_code, answer.json()["model"]) == (200, "sql")
    completion = await client.post(
        sim.url + "/v1/completions", json={"model": "early", "prompt": "hi", "max_tokens": 2}
    )
    assert completion.json()["model"] == "early"

    unloaded = await client.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'sql' removed successfully.",
    )
    gone = await client.post(sim.url + "/v1/chat/completions", json={**CHAT, "model": "sql"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The model `sql` does not exist."
    state = sim.app.state()["lora"]
    assert state["requests_by_adapter"] == {"sql": 1, "early": 1}
    assert state["loads"] == 2  # --lora-modules' and the endpoint's


async def test_refusals_carry_vllms_messages_and_codes(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(LORA, lora_load_time=0.0)
    refusals = [
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x"},
            400,
            "InvalidUserInput",
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "early", "lora_path": "/elsewhere"},
            400,
            "InvalidUserInput",
            "The lora adapter 'early' has already been loaded. If you want to load the adapter "
            "in place, set 'load_inplace' to True.",
        ),
        (
            "/v1/unload_lora_adapter",
            {},
            400,
            "InvalidUserInput",
            "'lora_name' needs to be provided to unload a LoRA adapter.",
        ),
        (
            "/v1/unload_lora_adapter",
            {"lora_name": "never"},
            404,
            "NotFoundError",
            "The lora adapter 'never' cannot be found.",
        ),
    ]
    for path, body, status, kind, message in refusals:
        answer = await client.post(sim.url + path, json=body)
        assert answer.status_code == status, body
        assert answer.json()["error"] | {"param": None} == {
            "message": message,
            "type": kind,
            "param": None,
            "code": status,
        }
    inplace = await client.post(
        sim.url + "/v1/load_lora_adapter",
        json={"lora_name": "early", "lora_path": "/v2", "load_inplace": True},
    )
    assert inplace.status_code == 200
    adapter = sim.app.engine.lora.get("early") if sim.app.engine.lora else None
    assert adapter is not None and (adapter.path, adapter.lora_int_id) == ("/v2", 1)


async def test_concurrent_loads_of_one_name_load_it_once(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(LORA)
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await load(client, sim.url, "new", "/loras/new")).status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(one)
    assert sorted(statuses) == [200, 400, 400, 400, 400]  # vLLM serializes them by name
    text = (await client.get(sim.url + "/metrics")).text
    assert [s.value for s in samples(text, "sim:lora_loads_total")] == [2.0]


async def test_without_max_loras_there_is_no_lora(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(QUICK)
    answer = await load(client, sim.url, "sql", "/loras/sql")
    assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"})
    assert "lora" not in (await client.get(sim.url + "/metrics")).text


async def test_the_info_metric_shows_running_and_waiting_adapters(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    # One adapter at a time and slow tokens: the second adapter's request waits.
    sim = await start_sim(LORA, max_loras=1, inter_token_latency=0.05, lora_load_time=0.0)
    await load(client, sim.url, "other", "/loras/other")
    engine = sim.app.engine
    long_chat = {**CHAT, "max_tokens": 200}
    async with trio.open_nursery() as nursery:
        for model in ("early", "other"):
            body = {**long_chat, "model": model}
            nursery.start_soon(lambda b=body: client.post(sim.url + "/v1/chat/completions", json=b))
            await engine.wait_until(lambda: engine.running + engine.waiting >= 1)
        with trio.fail_after(5):
            await engine.wait_until(lambda: (engine.running, engine.waiting) == (1, 1))
            await engine.wait_until(lambda: engine.steps > 0)
        text = (await client.get(sim.url + "/metrics")).text
        nursery.cancel_scope.cancel()
    series = list(samples(text, "vllm:lora_requests_info"))
    latest = max(series, key=lambda sample: sample.value)
    assert dict(latest.labels) == {
        "max_lora": "1",
        "running_lora_adapters": "early",
        "waiting_lora_adapters": "other",
    }
    assert latest.value > 1.7e9  # a wall-clock timestamp, as vLLM's set_to_current_time


async def test_sglang_style_serves_sglangs_endpoints(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(LORA, metrics_style="sglang", max_cpu_loras=2, lora_load_time=0.0)
    body = {"lora_name": "b", "lora_path": "/loras/b"}
    loaded = await client.post(sim.url + "/load_lora_adapter", json=body)
    assert (loaded.status_code, loaded.json()) == (
        200,
        {
            "success": True,
            "error_message": None,
            "loaded_adapters": {"early": "/loras/early", "b": "/loras/b"},
        },
    )
    full = await client.post(sim.url + "/load_lora_adapter", json={**body, "lora_name": "c"})
    assert full.status_code == 400
    assert full.json()["error_message"].startswith("Cannot load LoRA adapter c at path /loras/b.")
    unknown = await client.post(sim.url + "/unload_lora_adapter", json={"lora_name": "zz"})
    assert unknown.status_code == 400 and unknown.json()["success"] is False
    unloaded = await client.post(sim.url + "/unload_lora_adapter", json={"lora_name": "b"})
    assert unloaded.json()["loaded_adapters"] == {"early": "/loras/early"}


def test_the_flags_parse_and_refuse_what_cannot_work() -> None:
    _, settings = parse(
        ["sim-backend", "--max-loras", "2", "--lora-modules", "a=/p/a", "--lora-modules", "b=/p/b"]
    )
    assert isinstance(settings, SimSettings)
    assert settings.lora_adapters == (("a", "/p/a"), ("b", "/p/b"))
    for argv in (
        ["--lora-modules", "a=/p/a"],  # LoRA off
        ["--max-loras", "2", "--lora-modules", "no-path"],
        ["--max-loras", "2", "--max-cpu-loras", "1"],
        ["--max-loras", "-1"],
    ):
        with pytest.raises(ConfigExit):
            parse(["sim-backend", *argv])
