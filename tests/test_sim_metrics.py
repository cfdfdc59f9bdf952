"""The simulated backend's `/metrics` in each engine's style, over real HTTP: the engine's names,
labels, comments and neighbouring metrics, numbers that follow the simulated GPU, text that
Prometheus' own parser accepts, and the proxy's engine parser reading each back."""

from __future__ import annotations

import dataclasses
from typing import get_args

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from app.fleet.engine_metrics import read_engine
from app.sim.settings import MetricsStyle
from tests.conftest import StartSim
from tests.sims import QUEUEING, QUICK, one_running_one_waiting, samples

STYLES: tuple[MetricsStyle, ...] = get_args(MetricsStyle)
# The model MARKS name, served by each engine.
SIM_TEST_MODEL = dataclasses.replace(QUEUEING, models=("sim-test-model",))
SIM_TEST_MODEL_QUICK = dataclasses.replace(QUICK, models=("sim-test-model",))

# Lines (or runs of lines) each style's exposition has, as the real engine writes them, and
# what it never has.
MARKS: dict[MetricsStyle, tuple[str, ...]] = {
    "vllm": (
        'vllm:num_requests_running{engine="0",model_name="sim-test-model"} 1.0\n',
        'vllm:num_requests_waiting{engine="0",model_name="sim-test-model"} 1.0\n',
        "# TYPE vllm:prefix_cache_queries_total counter\n",
        'vllm:prefix_cache_hits_created{engine="0",model_name="sim-test-model"} ',
        'vllm:cache_config_info{block_size="16",',
        'python_gc_objects_collected_total{generation="0"} ',
        "process_cpu_seconds_total ",
    ),
    "sglang": (
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n",
        'sglang:num_queue_reqs{engine_type="unified",model_name="sim-test-model",'
        'pp_rank="0",tp_rank="0"} 1.0\n',
        'sglang:num_running_reqs{engine_type="unified",model_name="sim-test-model",'
        'pp_rank="0",tp_rank="0"} 1.0\n',
        'sglang:cached_tokens_total{model_name="sim-test-model"} ',
    ),
    "llamacpp": (
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n",
        "# HELP llamacpp:requests_deferred Number of request deferred.\n"
        "# TYPE llamacpp:requests_deferred gauge\n"
        "llamacpp:requests_deferred 1\n",
        "\nllamacpp:requests_processing 1\n",
        "\nllamacpp:n_decode_total ",
    ),
    "tgi": (
        "# HELP tgi_queue_size Current queue size\n"
        "# TYPE tgi_queue_size gauge\n"
        "tgi_queue_size 1\n\n",
        "\ntgi_batch_current_size 1\n\n",
        'tgi_batch_inference_count{method="prefill"} ',
    ),
}
NEVER: dict[MetricsStyle, tuple[str, ...]] = {
    "vllm": (),
    "sglang": ("_created", "process_"),  # SGLang's multiprocess registry serves neither
    "llamacpp": ("{", "\n\n"),
    "tgi": ("_total", "_created"),
}


@pytest.mark.parametrize("style", STYLES)
async def test_each_style_reports_the_gpus_queue_in_its_engines_own_words(
    start_sim: StartSim, client: httpx.AsyncClient, style: MetricsStyle
) -> None:
    sim = await start_sim(SIM_TEST_MODEL, metrics_style=style)
    url, app = sim.url, sim.app
    async with trio.open_nursery() as nursery:
        await one_running_one_waiting(nursery, client, sim)
        text = (await client.get(url + "/metrics")).text
        usage = app.engine.kv_cache.usage  # before the clients leave and free their blocks
        nursery.cancel_scope.cancel()

    for mark in MARKS[style]:
        assert mark in text, mark
    # The simulator's own disaggregation counters (labelled, `_total`) are in every style.
    engines_own = "".join(
        line
        for line in text.splitlines(keepends=True)
        if "sluice_sim_pd_" not in line and "sim:pd_" not in line
    )
    for absent in NEVER[style]:
        assert absent not in engines_own, absent
    assert list(text_string_to_metric_families(text))  # Prometheus' own parser accepts it
    reading = read_engine(text)
    assert reading is not None
    assert (reading.engine, reading.running, reading.waiting) == (style, 1, 1)
    if style == "tgi":
        assert reading.kv_cache_usage is None  # TGI never reports KV use
    else:
        assert usage > 0
        assert reading.kv_cache_usage == pytest.approx(usage, rel=1e-5)  # llama.cpp: 6 digits


async def test_sglang_hit_rate_is_that_of_the_last_prefill(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    url = (await start_sim(SIM_TEST_MODEL_QUICK, metrics_style="sglang")).url
    system = {"role": "system", "content": "Answer in haiku. " * 30}
    usages = []
    for question in ("first question", "second question"):
        request = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 2}
        answer = (await client.post(url + "/v1/chat/completions", json=request)).json()
        usages.append(answer["usage"])
        reading = read_engine((await client.get(url + "/metrics")).text)
        assert reading is not None
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reading.reported_hit_rate == cached / answer["usage"]["prompt_tokens"]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_llamacpp_counts_tokens_and_decode_calls(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(SIM_TEST_MODEL_QUICK, metrics_style="llamacpp")
    url, app = sim.url, sim.app
    request = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 5}
    usage = (await client.post(url + "/v1/chat/completions", json=request)).json()["usage"]
    values = await samples(client, url)
    assert values["llamacpp:prompt_tokens_total"] == usage["prompt_tokens"]
    assert values["llamacpp:tokens_predicted_total"] == usage["completion_tokens"] == 5
    assert values["llamacpp:n_decode_total"] == app.engine.steps >= 5
    assert values["llamacpp:tokens_predicted_seconds_total"] > 0
    assert values["llamacpp:kv_cache_usage_ratio"] == 0  # the sequence finished: nothing held
