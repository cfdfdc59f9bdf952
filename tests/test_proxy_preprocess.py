"""Preprocessing seen through the proxy: the loop stays free while a tokenizer thread is
stuck (seed 003's gate, over HTTP), the context window is enforced before any backend sees
the request, tokens are counted per API key without exposing the key, the `server-timing`
and `x-sluice-prompt-tokens` headers, template errors as 400s, and the saturation switch on
the dashboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from app.preprocess.tokenizer_loading import load_tokenizer
from tests.conftest import StartSim, StartSluice, StartSluiceOnASim, wait_until
from tests.fakes import GateTokenizer


def completion(text: str) -> dict[str, Any]:
    # Padded past what is encoded on the loop at once, so that it meets the dispatcher.
    return {"model": "m", "prompt": text + " and then" * 40, "max_tokens": 2}


async def test_loop_answers_while_a_tokenizer_thread_is_blocked(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    gate = GateTokenizer(load_tokenizer(None).tokenizer)
    running = await start_sluice_on_a_sim(tokenizer=gate, tokenize_threads=1)
    url = running.proxy_url
    warm = await client.post(url + "/v1/completions", json=completion("a cached prompt"))
    assert warm.status_code == 200

    stuck: list[httpx.Response] = []

    async def blocked_request() -> None:
        stuck.append(await client.post(url + "/v1/completions", json=completion("GATE text")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocked_request)
        await gate.arrived()
        assert (await client.get(url + "/health")).status_code == 200
        hit = await client.post(url + "/v1/completions", json=completion("a cached prompt"))
        assert hit.status_code == 200
        assert not stuck  # still waiting for its tokens
        gate.gate.set()
    assert stuck[0].status_code == 200
    metrics = (await client.get(url + "/metrics")).text
    assert 'sluice_tokenize_seconds_count{model="m",path="l0"} 1.0' in metrics
    assert 'sluice_tokenize_seconds_count{model="m",path="thread"} 2.0' in metrics


async def test_context_window_is_enforced_before_any_backend_sees_the_request(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(max_model_len=64)
    running = await start_sluice([sim.url])
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 200}]}
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "64" in error["message"]
    assert "x-sluice-backend" not in response.headers
    assert (await client.get(sim.url + "/sim/state")).json()["prompt_tokens"] == 0

    running = await start_sluice([sim.url], max_model_len=10)
    response = await client.post(running.proxy_url + "/v1/completions", json=completion("x " * 9))
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_tokens_are_counted_per_key_and_reported_in_headers(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    body = {"model": "m", "messages": [{"role": "user", "content": "Count my tokens, please."}]}
    response = await client.post(
        running.proxy_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer sk-very-secret"},
    )
    assert response.status_code == 200
    prompt_tokens = int(response.headers["x-sluice-prompt-tokens"])
    assert prompt_tokens > 5
    timing = dict(
        part.strip().split(";dur=") for part in response.headers["server-timing"].split(",")
    )
    assert float(timing["template"]) > 0 and float(timing["tokenize"]) > 0

    async def counted() -> bool:
        text = (await client.get(running.proxy_url + "/metrics")).text
        return "sluice_prompt_tokens_total{api_key=" in text

    await wait_until(counted)
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert "sk-very-secret" not in metrics
    line = next(m for m in metrics.splitlines() if m.startswith("sluice_prompt_tokens_total{"))
    assert 'api_key="key-' in line and line.endswith(f" {float(prompt_tokens)}")


async def test_template_and_content_errors_are_400s(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = await start_sim()
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System messages are not supported by this model') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    running = await start_sluice([sim.url], chat_template=str(template))
    url = running.proxy_url + "/v1/chat/completions"
    refused = await client.post(
        url, json={"model": "m", "messages": [{"role": "system", "content": "x"}]}
    )
    assert refused.status_code == 400
    assert "System messages are not supported" in refused.json()["error"]["message"]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    parts = await client.post(
        url, json={"model": "m", "messages": [{"role": "user", "content": [image]}]}
    )
    assert parts.status_code == 400
    assert parts.json()["error"]["param"] == "messages[0].content[0]"
    fine = await client.post(
        url, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert fine.status_code == 200


async def test_saturation_switch_on_the_dashboard(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim(admin_token="s3cret")
    policy_url = running.dashboard_url + "/api/policy"
    denied = await client.put(policy_url, json={"saturation": "bail-out"})
    assert denied.status_code == 401
    auth = {"authorization": "Bearer s3cret"}
    bad = await client.put(policy_url, json={"saturation": "drop"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "saturation"
    ok = await client.put(policy_url, json={"saturation": "bail-out"}, headers=auth)
    assert ok.status_code == 200
    assert running.sluice.preprocessor.saturation == "bail-out"
    snapshot = (await client.get(running.dashboard_url + "/api/snapshot")).json()
    assert snapshot["preprocess"]["saturation"] == "bail-out"
