"""Preprocessing micro-benchmarks on the bundled DeepSeek tokenizer.

    .venv/bin/python -m load.bench_preprocess

1. L0 hit cost on 64 KiB texts (target <= 20 us), for a fresh string (a request body parsed
   anew: its hash is not cached yet) and through the whole `Preprocessor.prepare` path.
2. A grown ~16k-token conversation through L1 vs a full encode (target >= 5x faster).
3. Chat template render cost vs message count for the shipped templates, with the calibrated
   cost model's on-loop verdict, and what a render cache would pay per request (a JSON key).
4. The loop: worst 1 ms-ticker gap while 8 unique ~16k-token prompts are tokenized, inline vs
   offload, side by side.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import trio

from app.config import Settings
from app.observe.metrics import Metrics
from app.preprocess.chat_template import (
    SHIPPED_DIR,
    ChatTemplate,
    calibrate_render_cost,
)
from app.preprocess.encoding import facts_for, gil_releasing_encoder
from app.preprocess.l0_cache import L0Cache
from app.preprocess.l1_cache import L1Cache
from app.preprocess.pipeline import RENDER_ON_LOOP_BUDGET, Prepared, Preprocessor
from app.preprocess.tokenizer_loading import load_tokenizer
from load.stats import percentile

RND = random.Random(20240611)
VOCAB = [
    "".join(RND.choices("abcdefghijklmnopqrstuvwxyz", k=RND.randint(2, 9))) for _ in range(5000)
]


def prose(chars: int) -> str:
    words: list[str] = []
    total = 0
    while total < chars:
        word = RND.choice(VOCAB)
        words.append(word)
        total += len(word) + 1
    return " ".join(words)[:chars]


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


async def prepare_text(preprocessor: Preprocessor, text: str) -> Prepared:
    """A completion request for `text` through the whole preprocessing path."""
    body = json.dumps({"model": "sim", "prompt": text}).encode()
    return await preprocessor.prepare("completion", body)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f} us"


def bench_l0() -> None:
    encode = gil_releasing_encoder(load_tokenizer(None).tokenizer)
    text = prose(64 * 1024)
    cache = L0Cache(10_000, 256 * 2**20, 64 * 1024)
    cache.put(text, encode(text))
    fresh = [text.encode().decode() for _ in range(300)]  # equal strings, hashes not cached
    it = iter(fresh)
    cold = timed(lambda: cache.get(next(it)), len(fresh))
    warm = timed(lambda: cache.get(text), 300)

    preprocessor = Preprocessor(Settings(), Metrics())
    body_texts = iter([text.encode().decode() for _ in range(300)])

    async def through_pipeline() -> list[float]:
        async with preprocessor.running():
            await prepare_text(preprocessor, text)
            seconds = []
            for _ in range(300):
                prepared = await prepare_text(preprocessor, next(body_texts))
                assert prepared.tokenize_path == "l0"
                seconds.append(prepared.tokenize_seconds)
            return seconds

    piped = trio.run(through_pipeline)
    tokens = len(encode(text))
    print(f"\n1. L0 hit, 64 KiB text ({tokens} tokens)            median        p99")
    for name, samples in (
        ("cache.get, fresh str (hash computed)", cold),
        ("cache.get, same str (hash cached)", warm),
        ("prepare, fresh body (tokenize part)", piped),
    ):
        print(f"   {name:38} {us(statistics.median(samples))} {us(percentile(samples, 99))}")


def deepseek_template() -> ChatTemplate:
    source = (SHIPPED_DIR / "deepseek_v3.jinja").read_text()
    return ChatTemplate("deepseek_v3", source, "<｜begin▁of▁sentence｜>", "")  # noqa: RUF001


def bench_l1() -> None:
    loaded = load_tokenizer(None)
    encode = gil_releasing_encoder(loaded.tokenizer)
    finder = facts_for(loaded).finder
    assert finder is not None
    template = deepseek_template()
    messages: list[dict[str, Any]] = [{"role": "system", "content": prose(4000)}]
    while len(encode(template.render(messages, add_generation_prompt=True))) < 16_000:
        messages.append({"role": "user", "content": prose(1500)})
        messages.append({"role": "assistant", "content": prose(1500)})
    base = template.render(messages, add_generation_prompt=False)
    grown = [
        template.render(
            [*messages, {"role": "user", "content": prose(400)}], add_generation_prompt=True
        )
        for _ in range(64)
    ]
    l1 = L1Cache(finder, encode, 50 * 2**20)
    l1.tokenize(base)
    outcomes: list[str] = []
    hits = []
    for prompt in grown:
        start = time.perf_counter()
        outcomes.append(l1.tokenize(prompt).result)
        hits.append(time.perf_counter() - start)
    full = [timed(functools.partial(encode, prompt), 1)[0] for prompt in grown]
    print(
        f"\n2. Grown conversation: {len(messages) + 1} messages, {len(encode(grown[0]))} tokens, "
        f"a new ~100-token user turn each time (64 variants)"
    )
    print(f"   full encode                  median {us(statistics.median(full))}")
    print(
        f"   L1 (hit + 1/32 sampled full)  median {us(statistics.median(hits))}   "
        f"mean {us(statistics.mean(hits))}"
    )
    print(
        f"   speed-up: median {statistics.median(full) / statistics.median(hits):.1f}x, "
        f"mean {statistics.mean(full) / statistics.mean(hits):.1f}x   "
        f"({outcomes.count('hit')} hits, {outcomes.count('mismatch')} mismatches)"
    )


def bench_render() -> None:
    print(
        f"\n3. Render cost vs message count (~60-token messages); on-loop if the calibrated "
        f"estimate <= {RENDER_ON_LOOP_BUDGET * 1e3:.0f} ms"
    )
    header = "   messages"
    names = ("deepseek_v3", "chatml", "llama3")
    for name in names:
        header += f" | {name:>14} est. loop?"
    print(header + " | json key")
    templates = {
        name: ChatTemplate(name, (SHIPPED_DIR / f"{name}.jinja").read_text(), "<s>", "</s>")
        for name in names
    }
    costs = {name: calibrate_render_cost(t) for name, t in templates.items()}
    for n in (1, 4, 16, 64, 128, 256, 512, 1024):
        messages = [{"role": "system", "content": prose(200)}] + [
            {"role": ("user", "assistant")[i % 2], "content": prose(250)} for i in range(n - 1)
        ]
        chars = sum(len(m["content"]) for m in messages)
        row = f"   {n:8}"
        for name in names:
            render = functools.partial(templates[name].render, messages, add_generation_prompt=True)
            seconds = statistics.median(timed(render, 15))
            estimate = costs[name].estimate(n, chars)
            verdict = "yes" if estimate <= RENDER_ON_LOOP_BUDGET else "no"
            row += f" | {seconds * 1e3:8.3f} ms {estimate * 1e3:5.2f} {verdict:>3}"
        key = statistics.median(timed(functools.partial(json.dumps, messages), 15))
        print(row + f" | {key * 1e3:6.3f} ms")
    for name, cost in costs.items():
        limit = int((RENDER_ON_LOOP_BUDGET - cost.base) / (cost.per_message + 250 * cost.per_char))
        print(
            f"   {name}: {cost.per_message * 1e6:.2f} us/message calibrated, base "
            f"{cost.base * 1e6:.0f} us -> on the loop up to ~{limit} such messages"
        )


async def ticker_burst(
    preprocessor: Preprocessor, prompts: list[str]
) -> tuple[float, float, float]:
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with preprocessor.running(), trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        start = time.perf_counter()
        async with trio.open_nursery() as burst:
            for prompt in prompts:
                burst.start_soon(prepare_text, preprocessor, prompt)
        elapsed = time.perf_counter() - start
        done.set()
    return max(gaps), percentile(gaps, 99), elapsed


def bench_loop() -> None:
    encode = gil_releasing_encoder(load_tokenizer(None).tokenizer)
    sample = prose(60_000)
    chars = int(60_000 * 16_000 / len(encode(sample)))
    print("\n4. Loop: 1 ms ticker during a burst of 8 unique ~16k-token prompts")
    print("   mode                        worst gap     p99 gap    burst took")
    for label, settings in (
        ("inline (naive baseline)", Settings(tokenize_mode="inline")),
        ("offload, 2 threads", Settings(tokenize_threads=2)),
        ("offload, 1 thread", Settings(tokenize_threads=1)),
    ):
        preprocessor = Preprocessor(settings, Metrics())
        prompts = [f"{label} {i} " + prose(chars) for i in range(8)]
        worst, p99, elapsed = trio.run(ticker_burst, preprocessor, prompts)
        print(f"   {label:26} {worst * 1e3:8.1f} ms {p99 * 1e3:8.1f} ms {elapsed * 1e3:10.1f} ms")


def main() -> None:
    bench_l0()
    bench_l1()
    bench_render()
    bench_loop()


if __name__ == "__main__":
    main()
