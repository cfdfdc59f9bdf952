"""Tokenizing in threads: the event loop stays free, and a shared tokenizer stays correct.

- The GIL: a Trio task ticking every 1 ms counts its ticks while a worker thread encodes a
  large prompt. Through `encode_batch_fast` (what the offload path calls) the ticks go on;
  through plain `encode`, which holds the GIL for the whole call, they stop. Through the
  preprocessor, a burst of large unique prompts in offload mode leaves the ticker ticking
  many times more often than in inline mode (the naive baseline). Both are relative
  properties measured in one run, the variants interleaved: a busy machine slows every
  variant alike, so no absolute millisecond limit is needed (or safe).
- Thread safety: one `tokenizers.Tokenizer` shared by 4 threads encoding distinct texts at
  once gives exactly the serial results, through `encode_batch_fast` and `encode` alike. The
  encodes really overlap (on 2 cores, 2 threads encode 1.3-2x what one does), and Sluice never
  mutates a tokenizer after loading, so it shares one instance rather than one per thread.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import trio

from app.cli.rooms import RoomMetrics, preprocess_settings
from app.config import Settings
from app.preprocess.encoding import gil_releasing_encoder
from app.preprocess.pipeline import Preprocessor
from app.preprocess.tokenizer_loading import load_tokenizer
from tests.fakes import prepare

PROMPTS = 6
TOKENS_EACH = 16_000
TICK_S = 0.001
ROUNDS = 2  # each variant twice, interleaved
T = TypeVar("T")


def unique_prompts(seed: int, count: int, tokens: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [
        "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 9))) for _ in range(3000)
    ]
    words = int(tokens / 1.7)  # ~1.7 tokens a word for these pseudo-words
    return [f"{seed}-{i} " + " ".join(rnd.choices(vocab, k=words)) for i in range(count)]


async def ticks_during(work: Callable[..., Awaitable[T]], *args: Any) -> tuple[int, float, T]:
    """How many 1 ms ticks a Trio task got in while `work(*args)` ran, for how long (s), and
    what it returned."""
    ticks: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        while not done.is_set():
            await trio.sleep(TICK_S)
            ticks.append(time.perf_counter())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.005)
        started = time.perf_counter()
        result = await work(*args)
        ended = time.perf_counter()
        done.set()
    return sum(started < tick < ended for tick in ticks), ended - started, result


async def test_offloaded_encoder_lets_the_loop_tick_and_plain_encode_does_not() -> None:
    tokenizer = load_tokenizer(None).tokenizer
    offloaded = gil_releasing_encoder(tokenizer)
    [text] = unique_prompts(4, 1, 4 * TOKENS_EACH)
    counts: dict[str, int] = {"encode": 0, "encode_batch_fast": 0}
    for _ in range(ROUNDS):
        plain_ticks, _, _ = await ticks_during(trio.to_thread.run_sync, tokenizer.encode, text)
        fast_ticks, _, _ = await ticks_during(trio.to_thread.run_sync, offloaded, text)
        counts["encode"] += plain_ticks
        counts["encode_batch_fast"] += fast_ticks

    # The GIL-holding call lets through a tick or two as the thread starts and ends at most;
    # the GIL-releasing one one per few ms at worst, over encodes of ~60 ms each.
    assert counts["encode_batch_fast"] >= 5 * (counts["encode"] + ROUNDS), counts


async def tokenize_all(preprocessor: Preprocessor, prompts: list[str]) -> set[str]:
    """Tokenize all prompts at once; the paths they took."""
    paths: set[str] = set()

    async def tokenize(prompt: str) -> None:
        prepared = await prepare(preprocessor, "completion", {"model": "m", "prompt": prompt})
        assert prepared.token_ids is not None and len(prepared.token_ids) > TOKENS_EACH // 2
        paths.add(prepared.tokenize_path)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(tokenize, prompt)
    return paths


async def test_offload_keeps_the_loop_ticking_and_inline_does_not() -> None:
    # One worker thread: on a 2-core machine the loop keeps a core, so the ticks measure the
    # GIL, not CPU contention.
    preprocessors = {
        "offload": Preprocessor(
            preprocess_settings(Settings(tokenize_threads=1)), RoomMetrics.create().preprocess
        ),
        "inline": Preprocessor(
            preprocess_settings(Settings(tokenize_mode="inline")), RoomMetrics.create().preprocess
        ),
    }
    rates = {"offload": 0.0, "inline": 0.0}
    paths: dict[str, set[str]] = {"offload": set(), "inline": set()}
    for round_ in range(ROUNDS):
        for seed, (mode, preprocessor) in enumerate(preprocessors.items(), start=10 * round_):
            prompts = unique_prompts(seed, PROMPTS, TOKENS_EACH)
            ticks, seconds, seen = await ticks_during(tokenize_all, preprocessor, prompts)
            rates[mode] += ticks / seconds
            paths[mode] |= seen

    assert paths == {"offload": {"thread"}, "inline": {"inline"}}
    # Inline, the loop ticks at most once between two prompts' encodes; offloaded, it ticks
    # on through them.
    assert rates["offload"] >= 5 * rates["inline"], rates


def test_shared_tokenizer_is_safe_under_concurrent_encodes() -> None:
    tokenizer = load_tokenizer(None).tokenizer
    encode = gil_releasing_encoder(tokenizer)
    texts = unique_prompts(9, 48, 600)
    serial = [list(encode(text)) for text in texts]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            concurrent = list(pool.map(lambda text: list(encode(text)), texts))
            assert concurrent == serial
            direct = list(
                pool.map(lambda t: tokenizer.encode(t, add_special_tokens=False).ids, texts)
            )
            assert direct == serial
