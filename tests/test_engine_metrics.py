"""The engine load parser alone, on each engine's exposition as its server writes it: HELP and
TYPE comments, histograms and unrelated metrics around the few names wanted, labels in the
engine's own order, and the quirks (vLLM's data-parallel `engine` label, SGLang's replicated
TP ranks, llama.cpp with and without KV use, TGI's blank lines); a restart told by a new start
time or a counter gone back; and what each engine states of its own limit (engine_limits.py)."""

from __future__ import annotations

import pytest

from app.fleet.engine_limits import stated_limit
from app.fleet.engine_metrics import (
    EngineLoad,
    EngineName,
    EngineReading,
    Sample,
    next_load,
    read_engine,
    samples,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# The labels each engine puts on its load gauges.
V1 = f'engine="0",model_name="{MODEL}"'
SG = f'engine_type="unified",model_name="{MODEL}",pp_rank="0",tp_rank="0"'

# vLLM 0.10 (V1): prometheus_client's default registry, the deprecated gpu_* names beside the
# current ones, counters with `_created`, histograms, and a histogram whose name ends in _total.
VLLM_V1 = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12183.0
python_gc_objects_collected_total{{generation="1"}} 1473.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 3.125506048e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{V1}}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{V1}}} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: ...
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{V1}}} 0.99
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{V1}}} 0.4375
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{{V1}}} 48210.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{{V1}}} 1.7542307548562634e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{{V1}}} 30112.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{{{V1}}} 1.7542307548562634e+09
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{{{V1},le="1.0"}} 311.0
vllm:iteration_tokens_total_bucket{{{V1},le="+Inf"}} 1204.0
vllm:iteration_tokens_total_count{{{V1}}} 1204.0
vllm:iteration_tokens_total_sum{{{V1}}} 98112.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{{V1},le="0.001"}} 0.0
vllm:time_to_first_token_seconds_bucket{{{V1},le="+Inf"}} 96.0
vllm:time_to_first_token_seconds_count{{{V1}}} 96.0
vllm:time_to_first_token_seconds_sum{{{V1}}} 11.93
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",num_gpu_blocks="27834"}} 1.0
"""

# vLLM with --data-parallel-size 2 behind one API server: one sample per engine.
VLLM_DATA_PARALLEL = f"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{V1}}} 4.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 6.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{V1}}} 1.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{V1}}} 0.2
vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.6
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{{V1}}} 100.0
vllm:prefix_cache_queries_total{{engine="1",model_name="{MODEL}"}} 300.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{{V1}}} 50.0
vllm:prefix_cache_hits_total{{engine="1",model_name="{MODEL}"}} 150.0
"""

# vLLM 0.6 (V0): no engine label, KV use under its old name, a block-level hit-rate gauge.
VLLM_V0 = f"""# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{MODEL}"}} 1.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{model_name="{MODEL}"}} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="{MODEL}"}} 7.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.8125
# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{{model_name="{MODEL}"}} 0.6
"""

# SGLang 0.5: scheduler gauges labelled by rank, tokenizer counters, a histogram.
SGLANG = f"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SG}}} 12.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{{SG}}} 52341.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{SG}}} 0.28
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{{SG}}} 861.4
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{SG}}} 5.0
# HELP sglang:num_grammar_queue_reqs The number of requests in the grammar waiting queue.
# TYPE sglang:num_grammar_queue_reqs gauge
sglang:num_grammar_queue_reqs{{{SG}}} 0.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{SG}}} 0.734
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="{MODEL}"}} 8.128e+06
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="{MODEL}"}} 2.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{MODEL}"}} 41.0
sglang:time_to_first_token_seconds_count{{model_name="{MODEL}"}} 41.0
sglang:time_to_first_token_seconds_sum{{model_name="{MODEL}"}} 17.6
"""


def sglang_ranks(ranks: tuple[str, ...], gauges: dict[str, tuple[float, ...]]) -> str:
    """Scheduler gauges of several ranks (their labels besides the usual ones), each gauge's
    values in the ranks' order."""
    usual = 'engine_type="unified",model_name="m",pp_rank="0"'
    return "".join(
        f"sglang:{name}{{{rank},{usual}}} {value}\n"
        for name, values in gauges.items()
        for rank, value in zip(ranks, values, strict=True)
    )


# SGLang with TP 2 and --enable-metrics-for-all-schedulers: both ranks repeat the numbers.
SGLANG_ALL_SCHEDULERS = sglang_ranks(
    ('tp_rank="0"', 'tp_rank="1"'),
    {"num_running_reqs": (4.0, 4.0), "num_queue_reqs": (2.0, 2.0), "token_usage": (0.75, 0.75)},
)

# SGLang with data-parallel attention: each DP rank schedules its own requests.
SGLANG_DATA_PARALLEL = sglang_ranks(
    ('dp_rank="0",tp_rank="0"', 'dp_rank="1",tp_rank="1"'),
    {"num_running_reqs": (3.0, 5.0), "num_queue_reqs": (1.0, 1.0), "token_usage": (0.25, 0.75)},
)


def llamacpp(*, with_kv: bool) -> str:
    """llama-server's handler: HELP, TYPE and one sample each, counters then gauges, %g values.
    Builds before ggml-org/llama.cpp#13660 also reported KV use."""
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed.", "143"),
        ("prompt_seconds_total", "Prompt process time", "8.168"),
        ("tokens_predicted_total", "Number of generation tokens processed.", "673"),
        ("tokens_predicted_seconds_total", "Predict process time", "29.567"),
        ("n_decode_total", "Total number of llama_decode() calls", "689"),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", "1"),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", "17.5073"),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", "22.7619"),
    ]
    if with_kv:
        gauges += [
            ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", "0.0625"),
            ("kv_cache_tokens", "KV-cache tokens.", "256"),
        ]
    gauges += [
        ("requests_processing", "Number of requests processing.", "2"),
        ("requests_deferred", "Number of requests deferred.", "1"),
    ]
    lines = []
    for kind, metrics in (("counter", counters), ("gauge", gauges)):
        for name, text, value in metrics:
            lines += [f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}"]
            lines.append(f"llamacpp:{name} {value}")
    return "\n".join(lines) + "\n"


# TGI 3 (metrics-exporter-prometheus 0.15): a blank line after each family.
TGI = """# HELP tgi_request_count Total number of requests
# TYPE tgi_request_count counter
tgi_request_count 1032

# HELP tgi_batch_inference_count Inference calls per method (prefill or decode)
# TYPE tgi_batch_inference_count counter
tgi_batch_inference_count{method="prefill"} 412
tgi_batch_inference_count{method="decode"} 20118

# HELP tgi_queue_size Current queue size
# TYPE tgi_queue_size gauge
tgi_queue_size 9

# HELP tgi_batch_current_size Current batch size
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32

# HELP tgi_batch_current_max_tokens Maximum tokens for the current batch
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 41210

# HELP tgi_request_queue_duration Time spent in the queue per request
# TYPE tgi_request_queue_duration histogram
tgi_request_queue_duration_bucket{le="0.00015"} 0
tgi_request_queue_duration_bucket{le="+Inf"} 1032
tgi_request_queue_duration_sum 211.4
tgi_request_queue_duration_count 1032

"""


def reading(text: str) -> EngineReading:
    result = read_engine(text)
    assert result is not None
    return result


# --- each engine ----------------------------------------------------------------------------


def test_vllm_v1_prefers_kv_cache_usage_over_the_deprecated_name() -> None:
    assert reading(VLLM_V1) == EngineReading(
        engine="vllm",
        running=3,
        waiting=2,
        kv_cache_usage=0.4375,
        reported_hit_rate=None,
        prefix_queries=48210.0,
        prefix_hits=30112.0,
        started_at=1.7542307548562634e09,  # its counters' creation: the engine's start
    )


def test_vllm_data_parallel_engines_add_up_counts_and_average_kv_use() -> None:
    result = reading(VLLM_DATA_PARALLEL)
    assert (result.running, result.waiting) == (10, 1)
    assert result.kv_cache_usage == pytest.approx(0.4)
    assert (result.prefix_queries, result.prefix_hits) == (400.0, 200.0)


def test_vllm_v0_names_its_kv_use_and_hit_rate_differently() -> None:
    result = reading(VLLM_V0)
    assert (result.engine, result.running, result.waiting) == ("vllm", 1, 7)
    assert (result.kv_cache_usage, result.reported_hit_rate) == (0.8125, 0.6)
    assert next_load(result, None, None).prefix_cache_hit_rate == 0.6


def test_sglang_reports_its_own_hit_rate() -> None:
    result = reading(SGLANG)
    assert result == EngineReading(
        engine="sglang",
        running=12,
        waiting=5,
        kv_cache_usage=0.28,
        reported_hit_rate=0.734,
        prefix_queries=None,
        prefix_hits=None,
        prompt_tokens=8128000.0,
    )
    assert next_load(result, None, None).prefix_cache_hit_rate == 0.734


def test_sglang_tp_ranks_repeating_one_scheduler_count_once() -> None:
    result = reading(SGLANG_ALL_SCHEDULERS)
    assert (result.running, result.waiting, result.kv_cache_usage) == (4, 2, 0.75)


def test_sglang_data_parallel_ranks_add_up() -> None:
    result = reading(SGLANG_DATA_PARALLEL)
    assert (result.running, result.waiting, result.kv_cache_usage) == (8, 2, 0.5)


@pytest.mark.parametrize(("with_kv", "kv_use"), [(True, 0.0625), (False, None)])
def test_llamacpp_with_and_without_kv_use(with_kv: bool, kv_use: float | None) -> None:
    result = reading(llamacpp(with_kv=with_kv))
    assert (result.engine, result.running, result.waiting) == ("llamacpp", 2, 1)
    assert result.kv_cache_usage == kv_use
    assert next_load(result, None, None).prefix_cache_hit_rate is None


def test_tgi_has_queue_and_batch_but_no_kv_use() -> None:
    assert reading(TGI) == EngineReading(
        engine="tgi",
        running=32,
        waiting=9,
        kv_cache_usage=None,
        reported_hit_rate=None,
        prefix_queries=None,
        prefix_hits=None,
        queue_time=(211.4, 1032.0),
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "404 page not found\n",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n",
        "process_resident_memory_bytes 3.1e+09\nsmg_router_requests_total 5\n",
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 3.0\n',
    ],
)
def test_an_exposition_without_any_engine_load_is_none(text: str) -> None:
    assert read_engine(text) is None


# --- the sample scanner ---------------------------------------------------------------------


def test_samples_read_labels_values_and_timestamps_and_skip_the_rest() -> None:
    text = (
        "# HELP q tgi_queue_size in a comment\n"
        'other{note="tgi_queue_size 99"} 1\n'
        "tgi_queue_size_extra 98\n"
        'tgi_queue_size{a="x\\"y\\\\z",b="line\\nbreak"} 3 1712345678000\n'
        "tgi_queue_size NaN\n"
        "tgi_queue_size not-a-number\n"
        'tgi_queue_size{broken="unterminated} 4\n'
        "tgi_queue_size\t5\r\n"
        "tgi_queue_size 6"
    )
    assert list(samples(text, "tgi_queue_size")) == [
        Sample((("a", 'x"y\\z'), ("b", "line\nbreak")), 3.0),
        Sample((), 5.0),
        Sample((), 6.0),
    ]


# --- the prefix hit rate over time ----------------------------------------------------------


def vllm_reading(queries: float, hits: float) -> EngineReading:
    return EngineReading("vllm", 0, 0, 0.1, None, queries, hits)


def test_vllm_hit_rate_is_over_the_interval_between_two_readings() -> None:
    first = next_load(vllm_reading(1000, 100), None, None)
    assert first.prefix_cache_hit_rate is None  # one reading says nothing about an interval
    second = next_load(vllm_reading(1400, 400), vllm_reading(1000, 100), first)
    assert second.prefix_cache_hit_rate == pytest.approx(0.75)
    assert second == EngineLoad("vllm", 0, 0, 0.1, second.prefix_cache_hit_rate)


def test_an_idle_interval_keeps_the_rate_and_a_restart_forgets_it() -> None:
    shown = EngineLoad("vllm", 0, 0, 0.1, 0.75)
    idle = next_load(vllm_reading(1400, 400), vllm_reading(1400, 400), shown)
    assert idle.prefix_cache_hit_rate == 0.75
    restarted = next_load(vllm_reading(20, 0), vllm_reading(1400, 400), shown)
    assert restarted.prefix_cache_hit_rate is None and restarted.restarted
    assert not idle.restarted


def test_the_queue_wait_and_the_step_are_means_over_the_interval() -> None:
    def at(queued: tuple[float, float], gaps: tuple[float, float]) -> EngineReading:
        return EngineReading(
            "vllm", 4, 9, None, None, None, None, None, None, queue_time=queued, token_gap=gaps
        )

    first = next_load(at((3.0, 10), (2.0, 100)), None, None)
    assert (first.queue_wait_s, first.step_s) == (None, None)  # one reading: no interval
    later = next_load(at((5.0, 14), (4.0, 200)), at((3.0, 10), (2.0, 100)), first)
    assert later.queue_wait_s == pytest.approx(0.5) and later.step_s == pytest.approx(0.02)
    idle = next_load(at((5.0, 14), (4.0, 200)), at((5.0, 14), (4.0, 200)), later)
    assert (idle.queue_wait_s, idle.step_s) == (None, None)  # nothing finished meanwhile


def test_a_restart_is_a_new_start_time_or_a_counter_gone_back() -> None:
    def at(started: float | None, prompt: float | None) -> EngineReading:
        return EngineReading("sglang", 1, 0, None, None, None, None, prompt, started)

    assert not next_load(at(None, 900), None, None).restarted  # nothing to compare with
    assert not next_load(at(5.0, 900), at(5.0, 800), None).restarted
    assert next_load(at(9.0, 900), at(5.0, 800), None).restarted  # a new engine process
    assert next_load(at(None, 12), at(None, 800), None).restarted  # its counter began again
    assert not next_load(at(None, 12), at(None, None), None).restarted


@pytest.mark.parametrize(
    ("engine", "answer", "limit"),
    [
        # SGLang 0.5: a scheduler's cap per data-parallel rank; ranks add up.
        ("sglang", {"max_running_requests": None, "internal_states": [
            {"effective_max_running_requests_per_dp": 128, "last_gen_throughput": 9.1},
            {"effective_max_running_requests_per_dp": 128}]}, 256),
        ("sglang", {"max_running_requests": 48, "internal_states": [{}]}, 48),
        ("sglang", {"max_running_requests": None}, None),
        ("llamacpp", {"total_slots": 4, "model_alias": "m"}, 4),
        ("tgi", {"max_batch_size": None, "max_concurrent_requests": 128}, None),
        ("tgi", {"max_batch_size": 32}, 32),
        ("llamacpp", {"total_slots": True}, None),  # nonsense is no statement
        ("llamacpp", {"total_slots": 0}, None),
        ("sglang", ["not", "an", "object"], None),
        ("vllm", {"max_num_seqs": 256}, None),  # vLLM states nothing we read
    ],
)  # fmt: skip
def test_what_each_engine_states_of_its_limit(
    engine: EngineName, answer: object, limit: int | None
) -> None:
    assert stated_limit(engine, answer) == limit
