"""`python -m load bench pd` (load/bench/pd.py): its plan is the same for every variant of a
round and unique prompt by prompt; the proxy's disaggregation counters and hand-off
histogram are read back from Prometheus text and differenced; and its targets pass or fail
on the figures they name (ITL and tokens/s ratios, hand-off bucket bounds, short prompts one
hop, recomputes only for one-hop requests)."""

from __future__ import annotations

import json
from typing import Any

from load import harness
from load.bench import pd
from load.workloads import Corpus


def test_a_rounds_plan_is_the_same_for_each_variant_and_every_prompt_its_own() -> None:
    corpus = Corpus.default()
    first = pd.plan("pd/1", 4.0, corpus, "127.0.0.1:1")
    assert first == pd.plan("pd/1", 4.0, corpus, "127.0.0.1:1")
    bodies = [json.loads(item.data.split(b"\r\n\r\n", 1)[1]) for _, item in first]
    texts = [body["messages"][0]["content"] for body in bodies]
    assert len({text[:14] for text in texts}) == len(texts)  # the nonce, first
    assert {item.tag for _, item in first} == {"long", "short"}
    assert all(body["stream"] for body in bodies)
    assert [at for at, _ in first] == sorted(at for at, _ in first)


def test_pd_counters_and_the_handoff_histogram_are_differenced_between_scrapes() -> None:
    def scrape(two_hops: int, short: int, fast: int) -> dict[str, float]:
        return harness.parse_metrics(
            f'sluice_pd_requests_total{{model="sim",mode="disaggregated",reason="disaggregated"}} '
            f"{two_hops}\n"
            f'sluice_pd_requests_total{{model="sim",mode="aggregated",reason="short"}} {short}\n'
            f'sluice_pd_handoff_seconds_bucket{{le="0.0005"}} {fast}\n'
            f'sluice_pd_handoff_seconds_bucket{{le="0.003"}} {two_hops}\n'
            f'sluice_pd_handoff_seconds_bucket{{le="+Inf"}} {two_hops}\n'
        )

    before, after = scrape(10, 3, 10), scrape(110, 8, 108)
    assert pd.pd_modes(before, after) == {"disaggregated": 100, "aggregated (short)": 5}
    buckets = pd.handoff_buckets(before, after)
    assert buckets == {"0.0005": 98, "0.003": 100, "+Inf": 100}
    assert pd.bucket_quantile(buckets, 50) == 0.0005
    assert pd.bucket_quantile(buckets, 99) == 0.003
    assert pd.bucket_quantile({"+Inf": 0}, 50) is None


def result(itl_ratio: float, recomputed: dict[str, float]) -> dict[str, Any]:
    pooled = {
        "requests": {"long": 20, "short": 30},
        "modes": {"disaggregated": 20, "aggregated (short)": 30},
        "prefill_legs": 20,
        "handoff_p50_ms": 0.25,
        "handoff_p99_ms": 2.0,
        "recomputed": recomputed,
        "transfers": {"decode": 20},
    }
    return {
        "ratios": {pd.VLLM: {"itl_p99": [itl_ratio, 0, 0], "tokens_per_s": [1.0, 1.0, 1.0]}},
        "pooled": {pd.VLLM: pooled},
        "summary": {pd.AGGREGATED: {"errors": 0}, pd.VLLM: {"errors": 0}},
    }


def test_targets_pass_on_the_issues_figures_and_name_what_failed() -> None:
    met = pd.targets(result(0.3, {"no_params": 30}))
    assert met and all(line.startswith("PASS") for line in met)

    failed = pd.targets(result(0.6, {"no_params": 30, "unusable": 1}))
    assert [line[5:].split(":")[1].split()[0] for line in failed if line.startswith("FAIL")] == [
        "ITL",
        "decode",
    ]
    assert harness.targets_met(failed, "issue 43's").startswith("issue 43's targets: 4 of 6")
