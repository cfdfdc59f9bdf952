"""Many models behind one Sluice, end to end on real sockets: simulated backends that serve one
model each (and one that serves two, found through its own /v1/models), every request
answered only by its own model's backends (`x-sluice-backend` says which; a request sent to
the wrong one would get that simulated engine's vLLM 404), an alias forwarded under the
served name, unknown and missing models, the `openai` client listing and calling both
models, each model's window enforced with its own tokenizer, failover inside a pool, a full
pool that does not hold up another's requests, and `--api-keys`: 401 without a key, 404 for a
model the key may not use, the model list each key sees, its tokens per minute."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from app.config import ModelConfig
from tests.conftest import RunningSluice, StartSim, StartSluice, set_faults, wait_until
from tests.fakes import write_word_tokenizer

LONG_WORDS = ["antidisestablishmentarianism", "floccinaucinihilipilification"]


@dataclasses.dataclass
class Fleet:
    running: RunningSluice
    big: set[str]  # the URLs of the backends serving "big"
    small: set[str]
    both: str  # the unconfigured backend whose /v1/models lists both

    @property
    def url(self) -> str:
        return self.running.proxy_url


async def start_fleet(
    start_sim: StartSim, start_sluice: StartSluice, tmp_path: Path, **overrides: Any
) -> Fleet:
    big = [await start_sim(models=("big",), seed=i) for i in range(2)]
    small = await start_sim(models=("small",))
    both = await start_sim(models=("big", "small"))
    words = str(write_word_tokenizer(tmp_path / "words", LONG_WORDS))
    models = (
        ModelConfig("big", tuple(s.url for s in big), aliases=("chat-default",), max_model_len=100),
        ModelConfig("small", (small.url,), tokenizer=words, max_model_len=100),
    )
    running = await start_sluice([both.url], models=models, policy="round_robin", **overrides)
    return Fleet(running, {s.url for s in big} | {both.url}, {small.url, both.url}, both.url)


def chat(model: str | None, content: str = "Hello", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
    return ({} if model is None else {"model": model}) | body | fields


async def ask(
    client: httpx.AsyncClient,
    fleet: Fleet,
    model: str | None,
    key: str | None = None,
    **fields: Any,
) -> httpx.Response:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return await client.post(
        fleet.url + "/v1/chat/completions", json=chat(model, **fields), headers=headers
    )


async def test_each_request_goes_only_to_its_own_models_backends(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fleet = await start_fleet(start_sim, start_sluice, tmp_path)
    seen: dict[str, set[str]] = {"big": set(), "small": set()}
    for round_ in range(8):
        for model in ("big", "small", "chat-default"):
            response = await ask(client, fleet, model, content=f"question {round_}")
            # A wrong backend answers its engine's 404 (`The model ... does not exist`).
            assert response.status_code == 200, response.text
            served = "big" if model == "chat-default" else model
            assert response.json()["model"] == served  # the alias left as the served name
            seen[served].add(response.headers["x-sluice-backend"])
    assert seen == {"big": fleet.big, "small": fleet.small}  # each pool, all of it
    metrics = (await client.get(fleet.url + "/metrics")).text
    assert 'sluice_requests_total{code="200",model="big"} 16.0' in metrics
    assert 'sluice_requests_total{code="200",model="small"} 8.0' in metrics
    assert "chat-default" not in metrics.split("# HELP sluice_requests")[1].split("# HELP")[0]


async def test_unknown_missing_and_misnamed_models(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fleet = await start_fleet(start_sim, start_sluice, tmp_path)
    unknown = await ask(client, fleet, "gpt-4o")
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "model",
        "model_not_found",
    )
    assert "big" not in error["message"] and "small" not in error["message"]
    missing = await ask(client, fleet, None)
    assert missing.status_code == 400  # two models served: which one?
    assert missing.json()["error"]["code"] == "missing_required_parameter"
    # An unknown model is never a metric label.
    assert "gpt-4o" not in (await client.get(fleet.url + "/metrics")).text


async def test_one_model_served_needs_no_model_field(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url])
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=chat(None))
    assert response.status_code == 200 and response.json()["model"] == "m"


async def test_the_openai_client_lists_and_calls_both_models(
    start_sim: StartSim, start_sluice: StartSluice, tmp_path: Path
) -> None:
    fleet = await start_fleet(start_sim, start_sluice, tmp_path)
    oai = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)

    def exercise() -> None:
        cards = {card.id: card for card in oai.models.list().data}
        assert sorted(cards) == ["big", "chat-default", "small"]
        assert cards["chat-default"].model_extra is not None
        assert cards["chat-default"].model_extra["root"] == "big"
        assert cards["big"].owned_by == "vllm"  # the backends' own card says so
        assert {cards[name].model_extra["max_model_len"] for name in cards} == {100}  # type: ignore[index]
        for name in ("big", "small", "chat-default"):
            answer = oai.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            assert answer.choices[0].message.content
            streamed = oai.completions.create(
                model=name, prompt="Once upon", max_tokens=3, stream=True
            )
            assert "".join(c.choices[0].text for c in streamed if c.choices)
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    await trio.to_thread.run_sync(exercise)


async def test_each_model_counts_and_limits_tokens_with_its_own_tokenizer(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fleet = await start_fleet(start_sim, start_sluice, tmp_path)
    prompt = " ".join(LONG_WORDS * 20)  # 40 words: 40 tokens for small's, ~8 a word for big's
    fits = await client.post(
        fleet.url + "/v1/completions", json={"model": "small", "prompt": prompt, "max_tokens": 4}
    )
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-sluice-prompt-tokens"] == "40"
    for model in ("big", "chat-default"):
        refused = await client.post(
            fleet.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4}
        )
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and "100 tokens" in error["message"]
    # Chat prompts too, each rendered with its own template before it is counted.
    small_chat = await ask(client, fleet, "small", content=prompt)
    assert small_chat.status_code == 200
    assert int(small_chat.headers["x-sluice-prompt-tokens"]) < 50
    assert (await ask(client, fleet, "big", content=prompt)).status_code == 400


async def test_a_dead_backend_fails_over_inside_its_pool_only(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    big = await start_sim(models=("big",))
    spare = await start_sim(models=("big",))
    small = await start_sim(models=("small",))
    models = (
        ModelConfig("big", (big.url, spare.url)),
        ModelConfig("small", (small.url,)),
    )
    running = await start_sluice([], models=models, policy="round_robin", breaker_failures=1)
    fleet = Fleet(running, {big.url, spare.url}, {small.url}, "")
    big.kill()
    for _ in range(4):
        response = await ask(client, fleet, "big")
        assert response.status_code == 200
        assert response.headers["x-sluice-backend"] == spare.url
    small.kill()
    response = await ask(client, fleet, "small")
    assert response.status_code in (502, 503)  # not sent to big's backends
    assert (await ask(client, fleet, "big")).status_code == 200


async def test_a_full_pool_does_not_hold_up_another_pools_requests(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    slow = await start_sim(models=("slow",), inter_token_latency=0.05)
    quick = await start_sim(models=("quick",))
    models = (ModelConfig("slow", (slow.url,)), ModelConfig("quick", (quick.url,)))
    running = await start_sluice([], models=models, max_inflight_per_backend=1)
    fleet = Fleet(running, set(), set(), "")
    async with trio.open_nursery() as nursery:
        for _ in range(3):  # one in flight, two waiting in slow's queue
            nursery.start_soon(ask, client, fleet, "slow", None)
        router = running.sluice.router

        async def slow_queue_waits() -> bool:
            return router.gate.held == 2

        await wait_until(slow_queue_waits)
        with trio.fail_after(3):
            assert (await ask(client, fleet, "quick")).status_code == 200
        assert router.snapshot()["admission"]["held_by_model"] == {"slow": 2}


async def test_a_backend_that_stops_listing_a_model_leaves_its_pool(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(models=("a", "b"))
    running = await start_sluice([sim.url])
    backend = running.sluice.pool.backends[0]
    assert backend.served == {"a", "b"}
    backend.set_models([{"id": "a"}])  # as its next /v1/models would
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=chat("b"))
    assert response.status_code == 404


# --- --api-keys --------------------------------------------------------------------------------

KEYS = """
[[keys]]
key = "sk-big-only"
models = ["chat-default"]

[[keys]]
key = "sk-everything"
tokens_per_minute = 40
"""


async def test_api_keys_decide_who_may_call_which_model(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    fleet = await start_fleet(start_sim, start_sluice, tmp_path, api_keys=str(keys))
    for key in (None, "sk-unknown", "sk-big-onl"):
        refused = await ask(client, fleet, "big", key)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "sk-" not in refused.text
    assert (await client.get(fleet.url + "/v1/models")).status_code == 401
    # Its alias grants the model; the other model is "not found", as a made-up one is.
    assert (await ask(client, fleet, "big", "sk-big-only")).status_code == 200
    hidden = await ask(client, fleet, "small", "sk-big-only")
    made_up = await ask(client, fleet, "no-such-model", "sk-big-only")
    assert hidden.status_code == made_up.status_code == 404
    assert hidden.json()["error"]["message"].replace("small", "X") == made_up.json()["error"][
        "message"
    ].replace("no-such-model", "X")
    listed = await client.get(
        fleet.url + "/v1/models", headers={"authorization": "Bearer sk-big-only"}
    )
    assert [card["id"] for card in listed.json()["data"]] == ["big", "chat-default"]
    everything = await client.get(
        fleet.url + "/v1/models", headers={"authorization": "Bearer sk-everything"}
    )
    assert len(everything.json()["data"]) == 3
    # 40 tokens a minute per model: the second prompt of ~30 tokens waits, the other model not.
    text = "one two three four five six seven eight nine ten " * 2
    assert (await ask(client, fleet, "small", "sk-everything", content=text)).status_code == 200
    limited = await ask(client, fleet, "small", "sk-everything", content=text)
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "tokens_per_minute"
    assert (await ask(client, fleet, "big", "sk-everything", content=text)).status_code == 200
    # Keys never reach the metrics or the dashboard, only fingerprints.
    metrics = (await client.get(fleet.url + "/metrics")).text
    snapshot = json.dumps((await client.get(fleet.running.dashboard_url + "/api/snapshot")).json())
    for secret in ("sk-big-only", "sk-everything"):
        assert secret not in metrics and secret not in snapshot
    assert 'api_key="key-' in metrics


async def test_a_broken_backend_answer_is_failed_over_for_its_model(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fleet = await start_fleet(start_sim, start_sluice, tmp_path, breaker_failures=1)
    await set_faults(client, fleet.both, error_rate=1.0)
    codes = [(await ask(client, fleet, "small")).status_code for _ in range(6)]
    # The backend serving both answered 500 once for small, and small's breaker opened
    # there; the rest went to small's own backend.
    assert codes.count(200) >= 5
    backend = running_backend(fleet, fleet.both)
    assert backend.breaker_state(trio.current_time(), "small") == "open"
    assert backend.breaker_state(trio.current_time(), "big") == "closed"


def running_backend(fleet: Fleet, url: str) -> Any:
    found = fleet.running.sluice.pool.find(url)
    assert found is not None
    return found
