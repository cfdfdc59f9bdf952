"""The stall detector inside a running proxy: an inline tokenization of a long unique prompt
shows up as a `blocking` stall in `/metrics` (with its cause label) and in the dashboard's
`/api/snapshot`, tagged with the `tokenize-inline` phase and with a stack that names the
tokenizer call; the same prompt in offload mode leaves the loop free (stalls the OS caused on
a busy machine aside). Real time: lower bounds only."""

from __future__ import annotations

import random
from typing import Any

import httpx
import trio

from tests.conftest import RunningSluice, StartSim, StartSluice


def unique_prompt(seed: int, words: int = 40_000) -> str:
    rng = random.Random(seed)
    vocabulary = ["latency", "tokenizer", "kernel", "prefix", "batch", "stream", "cache", "GPU"]
    return " ".join(f"{rng.choice(vocabulary)}{rng.randrange(1000)}" for _ in range(words))


async def burst(client: httpx.AsyncClient, url: str, seed: int) -> None:
    # Building 40k words takes tens of ms: not on the loop the detector is watching.
    prompt = await trio.to_thread.run_sync(unique_prompt, seed)
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    # Beside a CPU hog, tokenizing 40k words and answering took over the client's 10 s.
    response = await client.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


async def start_sluice_on_a_sim(
    start_sim: StartSim, start_sluice: StartSluice, tokenize_mode: str
) -> RunningSluice:
    """A proxy tokenizing `tokenize_mode` in front of a backend that takes any prompt."""
    sim = await start_sim(max_model_len=10_000_000)
    return await start_sluice([sim.url], tokenize_mode=tokenize_mode, max_model_len=10_000_000)


async def burst_and_snapshot(
    client: httpx.AsyncClient, running: RunningSluice, seed: int
) -> dict[str, Any]:
    """A burst through the proxy, then the dashboard's snapshot."""
    await burst(client, running.proxy_url, seed)
    snapshot: dict[str, Any] = (await client.get(running.dashboard_url + "/api/snapshot")).json()
    return snapshot


def tokenizer_stalls(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in snapshot["loop"]["recent"] if s["phase"] == "tokenize-inline"]


async def test_inline_tokenization_is_a_stall_with_the_tokenizer_in_its_stack(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim(start_sim, start_sluice, tokenize_mode="inline")
    snapshot = await burst_and_snapshot(client, running, seed=1)
    stalls = tokenizer_stalls(snapshot)
    assert stalls, snapshot["loop"]
    worst = max(stalls, key=lambda s: s["max_duration_s"])
    assert worst["max_duration_s"] >= 0.02
    assert worst["cause"] == "blocking"
    assert any("encode" in frame for frame in worst["stack"]), worst["stack"]
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("sluice_event_loop_stall_seconds_count")
    )
    assert count >= 1
    assert 'cause="blocking"' in metrics


async def test_offloaded_tokenization_leaves_no_tokenizer_stall(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim(start_sim, start_sluice, tokenize_mode="offload")
    snapshot = await burst_and_snapshot(client, running, seed=2)
    assert not tokenizer_stalls(snapshot)
    # The simulated backend shares this loop and may stall it; the proxy's tokenizer may not.
    proxy_tokenizing = [
        s
        for s in snapshot["loop"]["recent"]
        if any("app/preprocess" in f for f in s["stack"]) and s["cause"] != "preempted"
    ]
    assert not proxy_tokenizing, proxy_tokenizing
