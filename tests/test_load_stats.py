"""The load generator's pure parts: arrival processes (mean and variance of seeded schedules),
percentiles against a reference and their confidence ranges (coverage checked by
simulation), summaries of alternating rounds, SLOs and goodput, `server-timing` and
Prometheus parsing, the shapes of the workloads, and `compare --replicas`' summary."""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import pytest

from load import arrivals, compare_replicas, harness
from load.drive import parse_server_timing
from load.stats import (
    Ranged,
    by_group,
    goodput,
    meets,
    paired_change,
    parse_slos,
    percentile,
    quantile_range,
    summary,
)
from load.workloads import WORKLOADS, workload


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def test_poisson_schedule_has_the_rate_and_exponential_variance() -> None:
    rate = 50.0
    times = arrivals.schedule("poisson", rate, 400.0, seed=7)
    gaps = gaps_of(times)
    # 20,000 arrivals: the count's standard deviation is sqrt(20,000) ~ 141.
    assert abs(len(times) - rate * 400) < 5 * (rate * 400) ** 0.5
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: variance = mean squared.
    assert statistics.pvariance(gaps) == pytest.approx(1 / rate**2, rel=0.08)


def test_seeded_schedules_repeat_and_differ_by_seed() -> None:
    assert arrivals.schedule("poisson", 10, 10, seed=1) == arrivals.schedule(
        "poisson", 10, 10, seed=1
    )
    assert arrivals.schedule("poisson", 10, 10, seed=1) != arrivals.schedule(
        "poisson", 10, 10, seed=2
    )


def test_constant_schedule_is_evenly_spaced() -> None:
    times = arrivals.schedule("constant", 4.0, 3.0)
    assert times == pytest.approx([0.25 * i for i in range(1, 12)])


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_mean_and_burstiness_sets_the_variance(shape: float) -> None:
    rate = 20.0
    gaps = list(
        next(g)
        for g in [arrivals.gaps("gamma", rate, random.Random(3), shape)]
        for _ in range(40_000)
    )
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.04)
    # Gamma(k, theta = 1 / (rate k)): variance = k theta^2 = 1 / (k rate^2).
    assert statistics.pvariance(gaps) == pytest.approx(1 / (shape * rate**2), rel=0.12)


def test_arrivals_refuse_impossible_rates() -> None:
    with pytest.raises(ValueError):
        arrivals.schedule("poisson", 0, 1)
    with pytest.raises(ValueError):
        arrivals.schedule("gamma", 1, 1, burstiness=0)


def test_percentile_matches_numpys_linear_method() -> None:
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    # numpy.percentile(values, q) with the default "linear" method.
    reference = {0: 15.0, 25: 20.0, 40: 29.0, 50: 35.0, 90: 46.0, 99: 49.6, 100: 50.0}
    for q, expected in reference.items():
        assert percentile(values, q) == pytest.approx(expected)
    assert percentile(list(reversed(values)), 50) == 35.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_nan() -> None:
    assert percentile([], 50) != percentile([], 50)


def test_summary_scales_to_milliseconds() -> None:
    s = summary([0.001, 0.002, 0.003], 1e3)
    assert s["count"] == 3
    assert s["p50"] == pytest.approx(2.0)
    assert s["max"] == pytest.approx(3.0)
    assert summary([])["count"] == 0


def test_slos_parse_to_seconds_and_reject_nonsense() -> None:
    assert parse_slos(["ttft:500", "e2e:2000"]) == {"ttft": 0.5, "e2e": 2.0}
    for bad in ("ttft", "latency:5", "ttft:-1", "ttft:abc"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_goodput_counts_only_successes_within_every_slo() -> None:
    slos = {"ttft": 0.5}
    records = [
        {"ok": 1.0, "ttft": 0.1},
        {"ok": 1.0, "ttft": 0.6},  # too slow
        {"ok": 0.0, "ttft": 0.1},  # failed
        {"ok": 1.0, "ttft": None},  # unknown: not counted as good
    ]
    assert goodput(records, slos, 2.0) == 0.5
    assert meets({"ttft": 0.5}, slos)


def test_server_timing_parses_sluices_header() -> None:
    timing = parse_server_timing("template;dur=0.125, tokenize;dur=2.500, route;dur=0.010")
    assert timing == pytest.approx({"template": 0.000125, "tokenize": 0.0025, "route": 0.00001})
    assert parse_server_timing("garbage, x;dur=abc") == {}


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_seeded_and_openai_shaped(name: str) -> None:
    first = [r.body for _ in range(30) for r in workload(name, seed=5).next()]
    again = [r.body for _ in range(30) for r in workload(name, seed=5).next()]
    assert first == again
    for request in workload(name, seed=5).next():
        assert request.path in ("/v1/chat/completions", "/v1/completions")
        assert ("messages" in request.body) == (request.path == "/v1/chat/completions")


def test_chat_conversations_grow_and_restart() -> None:
    source = workload("chat", seed=1, conversations=1, chat_turns=3)
    lengths = [len(source.next()[0].body["messages"]) for _ in range(5)]
    assert lengths == [2, 4, 6, 2, 4]


def test_burst_sends_a_run_of_unique_large_prompts() -> None:
    source = workload("burst", seed=1, burst_every=5)
    arrivals_ = [source.next() for _ in range(10)]
    bursts = [a for a in arrivals_ if len(a) > 1]
    assert len(bursts) == 2
    prompts = [r.body["prompt"] for r in bursts[0]]
    assert len(set(prompts)) == 20
    assert min(len(p) for p in prompts) > 10_000


def test_long_conversations_have_thousands_of_short_messages() -> None:
    messages = workload("long", seed=2).next()[0].body["messages"]
    assert 1500 <= len(messages) <= 4002
    assert max(len(m["content"]) for m in messages[1:-1]) <= 80


@pytest.mark.parametrize(("n", "q"), [(20, 50), (200, 50), (2000, 99)])
def test_quantile_ranges_hold_the_true_quantile_95_times_in_100(n: int, q: float) -> None:
    rng = random.Random(n)
    true = -math.log(1 - q / 100)  # the exponential distribution's quantile, rate 1
    held = 0
    for _ in range(400):
        low, high = quantile_range([rng.expovariate(1.0) for _ in range(n)], q)
        held += low <= true <= high
    assert 0.92 <= held / 400 <= 0.995


def test_a_quantile_range_of_few_values_is_their_whole_spread() -> None:
    assert quantile_range([3.0, 1.0, 2.0], 50) == (1.0, 3.0)
    assert quantile_range([4.0], 99) == (4.0, 4.0)
    assert all(math.isnan(x) for x in quantile_range([], 50))


def test_rounds_alternate_their_order() -> None:
    assert list(harness.alternate(3, ["a", "b"])) == [
        (1, "a"), (1, "b"), (2, "b"), (2, "a"), (3, "a"), (3, "b")
    ]  # fmt: skip


def test_rounds_summarise_by_variant_with_medians_ranges_worsts_and_totals() -> None:
    rows = [
        {"round": r, "variant": v, "p99": p99, "worst": worst, "errors": e}
        for r, v, p99, worst, e in [
            (1, "a", 10.0, 50.0, 0), (1, "b", 20.0, 9.0, 1),
            (2, "b", 30.0, 7.0, 0), (2, "a", 12.0, 40.0, 2),
            (3, "a", 11.0, 80.0, 0), (3, "b", float("nan"), 8.0, 0),
        ]
    ]  # fmt: skip
    out = by_group(rows, "variant", ["p99"], worst=["worst"])
    assert list(out) == ["a", "b"]
    assert out["a"] == {
        "rounds": 3,
        "p99": 11.0,
        "p99_range": [10.0, 12.0],
        "worst": 80.0,
        "errors": 2,
    }
    assert out["b"]["p99"] == 25.0  # a NaN round is left out of the median
    assert paired_change(rows, "p99", "b", "a").value == pytest.approx(
        (20 / 10 - 1) * 100 / 2 + (30 / 12 - 1) * 100 / 2
    )


def test_ranged_cells_print_their_range_only_when_there_is_one() -> None:
    assert harness.fmt(Ranged(2.0, 1.0, 3.0)) == "2.0 (1.0-3.0)"
    assert harness.fmt(Ranged(2.0, 2.0, 2.0)) == "2.0"
    assert harness.fmt(1234.5) == "1,234.5"
    assert harness.fmt(float("nan")) == "n/a"


def test_prometheus_text_parses_and_lag_buckets_bound_every_sample() -> None:
    before = harness.parse_metrics('sluice_event_loop_lag_seconds_bucket{le="0.005"} 10\n')
    after = harness.parse_metrics(
        "# HELP x\n"
        'sluice_event_loop_lag_seconds_bucket{le="0.005"} 12\n'
        'sluice_event_loop_lag_seconds_bucket{le="0.05"} 14\n'
        'sluice_event_loop_lag_seconds_bucket{le="+Inf"} 14\n'
        'stalls_total{task="a",cause="gil-wait"} 2\n'
        'stalls_total{task="b",cause="gil-wait"} 3\n'
    )
    assert harness.lag_max_bucket(before, after) == 0.05
    assert harness.label_values(after, "stalls_total", "cause") == {"gil-wait": 5.0}
    assert harness.metric(after, "stalls_total") == 5.0
    assert harness.delta(before, after, "missing") is None


def test_compare_replicas_averages_rounds_and_sets_four_replicas_against_one() -> None:
    def run(round_: int, version: str, replicas: int, hit: float, p99: float) -> dict[str, Any]:
        return {
            "round": round_, "workload": "hot", "version": version, "replicas": replicas,
            "hit_rate": hit, "ttft_p50_ms": 50.0, "ttft_p99_ms": p99,
            "ttft_p99_warm_ms": p99 / 2, "errors": round_ - 1,
        }  # fmt: skip

    runs = [
        run(1, "this", 1, 0.90, 100.0), run(1, "this", 4, 0.80, 200.0),
        run(2, "this", 1, 0.94, 300.0), run(2, "this", 4, 0.90, 400.0),
        run(1, "rev", 1, 0.90, 100.0), run(1, "rev", 4, 0.90, 100.0),
        run(2, "rev", 1, 0.90, 100.0), run(2, "rev", 4, 0.90, 100.0),
    ]  # fmt: skip
    result = compare_replicas.summary(runs)
    this = result["hot this"]
    assert this["means"][1]["hit_rate"] == pytest.approx(0.92)
    assert this["means"][4]["ttft_p99_ms"] == pytest.approx(300.0)
    assert this["means"][4]["errors"] == 1
    assert this["many_to_one"]["hit_rate"] == pytest.approx(0.85 / 0.92)
    assert this["many_to_one"]["ttft_p99_ms"] == pytest.approx(1.5)
    assert result["hot rev"]["many_to_one"]["hit_rate"] == pytest.approx(1.0)
