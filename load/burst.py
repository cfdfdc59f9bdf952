"""Event-loop freeze under a tokenization burst: inline vs offload, side by side.

One simulated backend, two proxies in front of it (`--tokenize-mode inline`, the naive
baseline, and `--tokenize-mode offload`). Each burst sends 8 unique ~16k-token prompts at once
as non-streaming `/v1/completions` (`max_tokens: 1`) while a probe on its own keep-alive
connection sends `GET /health` every `--probe-interval-ms`; the probe's latencies are how long
the proxy's event loop froze, as a client sees it. Bursts alternate between the two proxies
for `--rounds` rounds. `/metrics` is scraped around each burst for the stall detector's view.

    python -m load burst --rounds 3

Targets (issues 3 and 4): offload's worst /health latency <= 10 ms and >= 3x better than
inline's. A missed target is reported, not an error: the exit status is non-zero only when the
benchmark itself fails.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import httpx
import trio

from load.processes import start_instant_sim, start_proxy, stop_all
from load.stats import percentile

MODES = ("inline", "offload")
PROMPTS_PER_BURST = 8
TOKENS_PER_PROMPT = 16_000
CALIBRATION_CHARS = 64_000
TARGET_OFFLOAD_WORST_S = 0.010
TARGET_INLINE_OVER_OFFLOAD = 3.0
MAX_MODEL_LEN = "1000000"
BURST_TIMEOUT_S = 30.0
WARM_UP_TIMEOUT_S = 20.0
# The stall detector records a freeze once the loop runs again; give it that moment.
METRICS_SETTLE_S = 0.1
JSON_HEADERS = {"content-type": "application/json"}

STALL_SUM = "sluice_event_loop_stall_seconds_sum"
STALL_COUNT = "sluice_event_loop_stall_seconds_count"
LAG_COUNT = "sluice_event_loop_lag_seconds_count"
LAG_BUCKET_PREFIX = 'sluice_event_loop_lag_seconds_bucket{le="'

# Common English words (all at least two letters, so word plus space is >= 3 characters).
COMMON_WORDS = """
    the of and to in is that for it as with on was by at be this are from or an which have
    not but had they has were their one all been more when there can so if will would about
    time people year way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education foot boy age policy process music market sense nation plan college interest
    death experience effect use class control care field development role effort rate heart
    drug show leader light voice wife police mind price report decision son view relationship
    town road arm difference value building action model season society tax director early
    position player record paper space ground form event official matter center couple site
    project activity star table need court oil situation cost industry figure street image
    phone data picture practice piece land product doctor wall patient worker news test movie
    north love support technology step baby computer type attention film tree source organ
"""
WORDS = tuple(COMMON_WORDS.split())


class BurstError(Exception):
    """The benchmark could not measure: a process, a request or a response failed."""


@dataclass
class BurstResult:
    round: int
    mode: str
    wall_s: float
    probes: int
    health_worst_s: float
    health_p99_s: float
    prompt_tokens_mean: float
    # None when the proxy does not export the metric.
    stall_seconds: float | None
    stall_count: float | None
    lag_samples: float | None
    # Upper bound of the highest lag bucket that gained samples (inf: above the last bound).
    lag_max_bucket_s: float | None


def english_like_text(rng: random.Random, chars: int) -> str:
    return " ".join(rng.choices(WORDS, k=chars // 3 + 1))[:chars]


def unique_prompt(rng: random.Random, chars: int) -> str:
    """A random seed word first, so neither the L0 (exact) nor the L1 (prefix) cache hits."""
    return f"{rng.getrandbits(64):016x} {english_like_text(rng, chars)}"


def completion_body(prompt: str) -> bytes:
    return json.dumps({"model": "sim", "prompt": prompt, "max_tokens": 1}).encode()


async def post_completion(client: httpx.AsyncClient, proxy_url: str, body: bytes) -> int:
    """Send one completion; return the prompt token count the proxy reports."""
    response = await client.post(proxy_url + "/v1/completions", content=body, headers=JSON_HEADERS)
    if response.status_code != 200:
        raise BurstError(f"{proxy_url} answered {response.status_code}: {response.text[:200]}")
    tokens = response.headers.get("x-sluice-prompt-tokens", "")
    if not tokens.isdigit():
        raise BurstError(f"{proxy_url} sent x-sluice-prompt-tokens {tokens!r}")
    return int(tokens)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


async def scrape_metrics(client: httpx.AsyncClient, proxy_url: str) -> dict[str, float]:
    response = await client.get(proxy_url + "/metrics")
    if response.status_code != 200:
        raise BurstError(f"{proxy_url}/metrics answered {response.status_code}")
    return parse_metrics(response.text)


def metric_delta(before: dict[str, float], after: dict[str, float], key: str) -> float | None:
    if key not in after:
        return None
    return after[key] - before.get(key, 0.0)


def lag_max_bucket(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The smallest lag bucket bound that holds every lag sample taken between the scrapes."""
    buckets = sorted(
        (float(key[len(LAG_BUCKET_PREFIX) : -2]), after[key] - before.get(key, 0.0))
        for key in after
        if key.startswith(LAG_BUCKET_PREFIX)
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= total)


async def probe_health(
    proxy_url: str, interval_s: float, latencies: list[float], started: trio.Event, done: trio.Event
) -> None:
    """GET /health on one keep-alive connection until `done`, recording each latency.

    `started` is set once the connection is open, and the latencies list is emptied then, so
    it holds only probes sent after that moment: at least one, the probe in flight at `done`.
    """
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(limits=limits, timeout=BURST_TIMEOUT_S, trust_env=False) as probe:
        while True:
            sent = time.perf_counter()
            response = await probe.get(proxy_url + "/health")
            latencies.append(time.perf_counter() - sent)
            if response.status_code != 200:
                raise BurstError(f"{proxy_url}/health answered {response.status_code}")
            if not started.is_set():
                latencies.clear()
                started.set()
            elif done.is_set():
                return
            await trio.sleep(interval_s)


async def run_burst(
    client: httpx.AsyncClient,
    proxy_url: str,
    prompts: list[str],
    probe_interval_s: float,
    round_number: int,
    mode: str,
) -> BurstResult:
    bodies = [completion_body(prompt) for prompt in prompts]
    before = await scrape_metrics(client, proxy_url)
    latencies: list[float] = []
    prompt_tokens: list[int] = []
    probe_started = trio.Event()
    burst_done = trio.Event()

    async def send(body: bytes) -> None:
        prompt_tokens.append(await post_completion(client, proxy_url, body))

    with trio.fail_after(BURST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                probe_health, proxy_url, probe_interval_s, latencies, probe_started, burst_done
            )
            await probe_started.wait()
            burst_started = time.perf_counter()
            async with trio.open_nursery() as burst:
                for body in bodies:
                    burst.start_soon(send, body)
            wall_s = time.perf_counter() - burst_started
            burst_done.set()
    await trio.sleep(METRICS_SETTLE_S)
    after = await scrape_metrics(client, proxy_url)
    return BurstResult(
        round=round_number,
        mode=mode,
        wall_s=wall_s,
        probes=len(latencies),
        health_worst_s=max(latencies),
        health_p99_s=percentile(latencies, 99),
        prompt_tokens_mean=statistics.mean(prompt_tokens),
        stall_seconds=metric_delta(before, after, STALL_SUM),
        stall_count=metric_delta(before, after, STALL_COUNT),
        lag_samples=metric_delta(before, after, LAG_COUNT),
        lag_max_bucket_s=lag_max_bucket(before, after),
    )


async def warm_up(client: httpx.AsyncClient, proxy_url: str, rng: random.Random) -> float:
    """Wait for a healthy backend, open the connections a burst needs, and return the
    characters per token of `english_like_text` as the proxy's tokenizer counts them."""
    with trio.fail_after(WARM_UP_TIMEOUT_S):
        while (await client.get(proxy_url + "/health")).status_code != 200:
            await trio.sleep(0.1)
        prompt = unique_prompt(rng, CALIBRATION_CHARS)
        tokens = await post_completion(client, proxy_url, completion_body(prompt))
        async with trio.open_nursery() as nursery:
            for _ in range(PROMPTS_PER_BURST):
                nursery.start_soon(
                    post_completion, client, proxy_url, completion_body(unique_prompt(rng, 40))
                )
    return len(prompt) / tokens


async def start_stack(processes: list[subprocess.Popen[bytes]]) -> dict[str, str]:
    """Start the simulated backend and one proxy per mode; return {mode: proxy URL}."""
    sim_url = await start_instant_sim(processes, "--max-model-len", MAX_MODEL_LEN)
    proxy_urls: dict[str, str] = {}

    async def start_mode(mode: str) -> None:
        proxy_urls[mode] = await start_proxy(
            processes, sim_url, "--max-model-len", MAX_MODEL_LEN, "--tokenize-mode", mode
        )

    async with trio.open_nursery() as nursery:
        for mode in MODES:
            nursery.start_soon(start_mode, mode)
    return proxy_urls


async def measure(args: argparse.Namespace) -> tuple[list[BurstResult], float]:
    """Run the bursts; return them and the calibrated characters per token."""
    rng = random.Random()
    processes: list[subprocess.Popen[bytes]] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    try:
        proxy_urls = await start_stack(processes)
        async with httpx.AsyncClient(limits=limits, timeout=60, trust_env=False) as client:
            chars_per_token = [await warm_up(client, proxy_urls[mode], rng) for mode in MODES]
            prompt_chars = round(TOKENS_PER_PROMPT * statistics.mean(chars_per_token))
            results = []
            for round_number in range(1, args.rounds + 1):
                for mode in MODES:
                    prompts = [unique_prompt(rng, prompt_chars) for _ in range(PROMPTS_PER_BURST)]
                    results.append(
                        await run_burst(
                            client,
                            proxy_urls[mode],
                            prompts,
                            args.probe_interval_ms / 1000,
                            round_number,
                            mode,
                        )
                    )
    finally:
        stop_all(processes)
    return results, statistics.mean(chars_per_token)


def optional_sum(values: list[float | None]) -> float | None:
    """The sum, or None when any burst lacked the metric."""
    present = [value for value in values if value is not None]
    return sum(present) if len(present) == len(values) else None


@dataclass
class ModeSummary:
    health_worst_max_s: float
    health_worst_median_s: float
    health_p99_median_s: float
    wall_median_s: float
    stall_seconds: float | None
    stall_count: float | None
    lag_max_bucket_s: float | None


def summarize_mode(bursts: list[BurstResult]) -> ModeSummary:
    lag_bounds = [b.lag_max_bucket_s for b in bursts if b.lag_max_bucket_s is not None]
    return ModeSummary(
        health_worst_max_s=max(b.health_worst_s for b in bursts),
        health_worst_median_s=statistics.median(b.health_worst_s for b in bursts),
        health_p99_median_s=statistics.median(b.health_p99_s for b in bursts),
        wall_median_s=statistics.median(b.wall_s for b in bursts),
        stall_seconds=optional_sum([b.stall_seconds for b in bursts]),
        stall_count=optional_sum([b.stall_count for b in bursts]),
        lag_max_bucket_s=max(lag_bounds) if lag_bounds else None,
    )


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def count(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def report(results: list[BurstResult], chars_per_token: float) -> None:
    """Print the JSON blob, then the per-burst and per-mode tables and the targets."""
    modes = {mode: summarize_mode([r for r in results if r.mode == mode]) for mode in MODES}
    offload_worst = modes["offload"].health_worst_max_s
    ratio = modes["inline"].health_worst_max_s / offload_worst
    prompt_tokens_mean = statistics.mean(r.prompt_tokens_mean for r in results)
    offload_met = offload_worst <= TARGET_OFFLOAD_WORST_S
    ratio_met = ratio >= TARGET_INLINE_OVER_OFFLOAD
    blob = {
        "prompts_per_burst": PROMPTS_PER_BURST,
        "target_tokens_per_prompt": TOKENS_PER_PROMPT,
        "prompt_tokens_mean": prompt_tokens_mean,
        "chars_per_token": chars_per_token,
        "modes": {mode: asdict(summary) for mode, summary in modes.items()},
        "inline_over_offload_worst": ratio,
        "target_offload_worst_met": offload_met,
        "target_ratio_met": ratio_met,
        "bursts": [asdict(result) for result in results],
    }
    print(json.dumps(blob, indent=2))
    print("\nround mode    probes  /health worst ms  p99 ms  wall ms  stall ms  stalls  lag<= ms")
    for r in results:
        print(
            f"{r.round:5} {r.mode:7} {r.probes:6} {ms(r.health_worst_s):>16} "
            f"{ms(r.health_p99_s):>7} {ms(r.wall_s):>8} {ms(r.stall_seconds):>9} "
            f"{count(r.stall_count):>7} {ms(r.lag_max_bucket_s):>9}"
        )
    print(
        "\nmode    worst max ms  worst median ms  p99 median ms  wall median ms  stall ms  "
        "stalls  lag<= ms"
    )
    for mode, m in modes.items():
        print(
            f"{mode:7} {ms(m.health_worst_max_s):>12} {ms(m.health_worst_median_s):>16} "
            f"{ms(m.health_p99_median_s):>14} {ms(m.wall_median_s):>15} "
            f"{ms(m.stall_seconds):>9} {count(m.stall_count):>7} {ms(m.lag_max_bucket_s):>9}"
        )
    print(
        f"\nprompts: {PROMPTS_PER_BURST} per burst, mean {prompt_tokens_mean:.0f} tokens "
        f"(target {TOKENS_PER_PROMPT})"
    )
    print(
        f"worst /health inline/offload: {ratio:.1f}x (target >= {TARGET_INLINE_OVER_OFFLOAD:g}x: "
        f"{'met' if ratio_met else 'MISSED'}); offload worst <= "
        f"{TARGET_OFFLOAD_WORST_S * 1e3:g} ms: {'met' if offload_met else 'MISSED'}"
    )


def leaf_messages(group: BaseExceptionGroup[Exception]) -> Iterator[str]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from leaf_messages(exc)
        else:
            yield f"{type(exc).__name__}: {exc}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="bursts per mode, alternating")
    parser.add_argument(
        "--probe-interval-ms",
        type=float,
        default=1.0,
        help="pause between two /health probes (0: back-to-back)",
    )


def main(args: argparse.Namespace) -> None:
    if args.rounds < 1:
        raise SystemExit("burst: --rounds must be at least 1")
    try:
        results, chars_per_token = trio.run(measure, args)
    except* (BurstError, RuntimeError, httpx.HTTPError, trio.TooSlowError) as group:
        raise SystemExit("burst failed: " + "; ".join(leaf_messages(group))) from None
    report(results, chars_per_token)
