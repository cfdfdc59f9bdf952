"""`python -m load bench templating`: seed 002's experiments 2 and 4, in process.

1. The chat-history tax (exp 2): Jinja2 render time of the shipped chat templates for a
   conversation of constant total length split into 1, 10, 50, 100 and 1,000 messages.
2. Threads vs the GIL (exp 4): a fixed amount of work (renders of a 100-message
   conversation; `encode_batch_fast` of ~4k-token texts, the call Sluice offloads) split over
   1, 2, 4 and 8 threads; speedup = time on 1 thread / time on N. Jinja2 is pure Python and
   holds the GIL; the tokenizer's Rust core releases it. This machine has 2 cores, so 2x is
   the tokenizer's ceiling here.

No processes or sockets: these are the costs the proxy's own numbers are built from.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from app.preprocess.chat_template import SHIPPED_DIR, ChatTemplate
from app.preprocess.encoding import gil_releasing_encoder
from app.preprocess.tokenizer_loading import load_tokenizer
from load.bench import common
from load.plots import plot_lines
from load.workloads import CHARS_PER_TOKEN, Corpus

TEMPLATES = ("llama3", "deepseek_v3", "chatml")
TURNS = (1, 10, 50, 100, 1000)
THREADS = (1, 2, 4, 8)
SEED_NOTE = (
    "seed 002 exp 2 (~100k tokens, Jinja2): 1 turn 11.8 ms, 10 turns 21.4, 50 turns 41.2,\n"
    "100 turns 58.7 (~5x: cost follows messages, not tokens). exp 4 speedup at 2/4/8/16\n"
    "threads: Jinja2 0.9/0.85/0.82/0.80x, tokenizer 1.8/3.2/5.1/6.8x. Read: the same shape\n"
    "here; this machine's 2 cores cap the tokenizer near 2x (less when others use them)."
)


def template(name: str) -> ChatTemplate:
    return ChatTemplate(name, (SHIPPED_DIR / f"{name}.jinja").read_text(), "<s>", "</s>")


def conversation(
    corpus: Corpus, rng: random.Random, tokens: int, turns: int
) -> list[dict[str, str]]:
    per_message = max(1, tokens // turns)
    messages = []
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": corpus.text(rng, per_message)})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "And so?"})
    return messages


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def history_tax(tokens: int, repeat: int) -> dict[str, dict[str, float]]:
    corpus, rng = Corpus.default(), random.Random(2)
    out: dict[str, dict[str, float]] = {}
    for name in TEMPLATES:
        compiled = template(name)
        out[name] = {}
        for turns in TURNS:
            messages = conversation(corpus, rng, tokens, turns)
            render = functools.partial(compiled.render, messages, add_generation_prompt=True)
            seconds = median_seconds(render, repeat)
            out[name][str(turns)] = seconds * 1e3
    return out


def scaling(jobs: int, fn: Callable[[], object]) -> dict[str, float]:
    """Speedup of `jobs` calls of `fn` on N threads over 1 thread (median of 3)."""
    times: dict[int, float] = {}
    for threads in THREADS:
        with ThreadPoolExecutor(threads) as pool:

            def run(pool: ThreadPoolExecutor = pool) -> None:
                list(pool.map(lambda _: fn(), range(jobs)))

            run()  # warm the threads
            times[threads] = median_seconds(run, 3)
    return {str(n): times[1] / t for n, t in times.items()}


def main(args: argparse.Namespace) -> None:
    tokens = 20_000 if args.quick else 100_000
    repeat = 5 if args.quick else 15
    tax = history_tax(tokens, repeat)
    corpus, rng = Corpus.default(), random.Random(4)
    compiled = template("llama3")
    messages = conversation(corpus, rng, 20_000, 100)
    encode = gil_releasing_encoder(load_tokenizer(None).tokenizer)
    text = corpus.text(rng, 4000)
    jobs = 16 if args.quick else 48
    speedups = {
        "jinja2": scaling(jobs, lambda: compiled.render(messages, add_generation_prompt=True)),
        "tokenizer": scaling(jobs, lambda: encode(text)),
    }
    png = common.write(
        "templating",
        {
            "tokens": tokens,
            "render_ms": tax,
            "speedup": speedups,
            "chars_per_token": CHARS_PER_TOKEN,
        },
        args.out_dir,
    )
    plot_lines(
        f"Render time vs messages at ~{tokens // 1000}k tokens",
        list(TURNS),
        {name: list(tax[name].values()) for name in TEMPLATES},
        "messages",
        "ms",
        png,
    )
    plot_lines(
        "Thread speedup (same total work)",
        list(THREADS),
        {name: list(s.values()) for name, s in speedups.items()},
        "threads",
        "x faster than 1 thread",
        png.with_name("templating-threads.png"),
    )
    rows = [[name, *tax[name].values(), tax[name]["100"] / tax[name]["1"]] for name in TEMPLATES]
    text_out = (
        f"render ms at ~{tokens // 1000}k tokens, by messages\n"
        + common.table(["template", *map(str, TURNS), "100 vs 1"], rows, digits=2)
        + "\n\nspeedup over 1 thread, same work\n"
        + common.table(
            ["work", *(f"{n} threads" for n in THREADS)],
            [[k, *v.values()] for k, v in speedups.items()],
        )
    )
    common.report("templating", SEED_NOTE, text_out, png)
