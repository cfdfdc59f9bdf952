"""`python -m load bench templating`: seed 002's experiments 2 and 4, in process.

1. The chat-history tax (exp 2): Jinja2 render time of the shipped chat templates for a
   conversation of constant total length split into 1, 10, 50, 100 and 1,000 messages, and
   the same conversations rendered by their plain Python renders (shipped_renders.py).
2. The render's cost per message, and where the proxy runs it: 1 to 1,024 messages of ~60
   tokens, the proxy's render (the plain Python one, for these) measured beside the cost
   model's estimate (calibrated on Jinja's renders) and its verdict (on the loop when the
   estimate is under RENDER_ON_LOOP_BUDGET, else in a render worker), and what a render
   cache's key (the messages as JSON) would cost.
3. Threads vs the GIL (exp 4): a fixed amount of work (renders of a 100-message
   conversation; `encode_batch_fast` of ~4k-token texts, the call Sluice offloads) split over
   1, 2, 4 and 8 threads; speedup = time on 1 thread / time on N. Jinja2 is pure Python and
   holds the GIL; the tokenizer's Rust core releases it; 2 cores cap it at 2x here.

No processes or sockets: these are the costs the proxy's own numbers are built from.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from app.preprocess.chat_template import SHIPPED_DIR, ChatTemplate, calibrate_render_cost
from app.preprocess.encoding import gil_releasing_encoder
from app.preprocess.rendering import RENDER_ON_LOOP_BUDGET
from app.preprocess.tokenizer_loading import load_tokenizer
from load import harness
from load.harness import Bench, Scenario, Table
from load.plots import plot_lines
from load.workloads import Corpus

TEMPLATES = ("llama3", "deepseek_v3", "chatml")
TURNS = (1, 10, 50, 100, 1000)
MESSAGES = (1, 4, 16, 64, 128, 256, 512, 1024)
THREADS = (1, 2, 4, 8)


def template(name: str) -> ChatTemplate:
    return ChatTemplate(name, (SHIPPED_DIR / f"{name}.jinja").read_text(), "<s>", "</s>")


def conversation(tokens_each: int, count: int, rng: random.Random) -> list[dict[str, str]]:
    corpus = Corpus.default()
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": corpus.text(rng, tokens_each)}
        for i in range(count)
    ]
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
    """Render ms by messages: Jinja's, under each template's name, and the plain Python
    render's, under "<name> (python)"."""
    rng = random.Random(2)
    out: dict[str, dict[str, float]] = {}
    for name in TEMPLATES:
        compiled = template(name)
        jinja: dict[str, float] = {}
        python: dict[str, float] = {}
        out[name], out[f"{name} (python)"] = jinja, python
        for turns in TURNS:
            messages = conversation(max(1, tokens // turns), turns, rng)
            for renders, render in (
                (jinja, compiled.render_with_jinja),
                (python, compiled.render),
            ):
                timed = functools.partial(render, messages, add_generation_prompt=True)
                renders[str(turns)] = median_seconds(timed, repeat) * 1e3
    return out


def per_message(repeat: int) -> dict[str, Any]:
    rng = random.Random(3)
    compiled = {name: template(name) for name in TEMPLATES}
    costs = {name: calibrate_render_cost(t) for name, t in compiled.items()}
    rows = []
    for count in MESSAGES:
        messages = conversation(60, count, rng)
        chars = sum(len(m["content"]) for m in messages)
        row: dict[str, Any] = {"messages": len(messages)}
        for name, t in compiled.items():
            render = functools.partial(t.render, messages, add_generation_prompt=True)
            estimate = costs[name].estimate(len(messages), chars)
            row[name] = {
                "ms": median_seconds(render, repeat) * 1e3,
                "estimate_ms": estimate * 1e3,
                "on_loop": estimate <= RENDER_ON_LOOP_BUDGET,
            }
        row["json_key_ms"] = median_seconds(functools.partial(json.dumps, messages), repeat) * 1e3
        rows.append(row)
    calibrated = {
        name: {"base_us": cost.base * 1e6, "per_message_us": cost.per_message * 1e6}
        for name, cost in costs.items()
    }
    return {"rows": rows, "calibrated": calibrated, "budget_ms": RENDER_ON_LOOP_BUDGET * 1e3}


def scaling(jobs: int, work: dict[str, Callable[[], object]], repeats: int) -> dict[str, Any]:
    """Speedup of `jobs` calls of each work on N threads over 1 thread, the thread counts
    taking turns in a rotated order each repeat (drift falls on all alike); medians."""
    times: dict[tuple[str, int], list[float]] = {(w, n): [] for w in work for n in THREADS}
    pools = {n: ThreadPoolExecutor(n) for n in THREADS}
    try:
        for repeat in range(repeats + 1):  # the first only starts the threads
            for n in THREADS[repeat % len(THREADS) :] + THREADS[: repeat % len(THREADS)]:
                for name, fn in work.items():
                    started = time.perf_counter()
                    list(pools[n].map(lambda _, fn=fn: fn(), range(jobs)))
                    if repeat:
                        times[(name, n)].append(time.perf_counter() - started)
    finally:
        for pool in pools.values():
            pool.shutdown()
    return {
        name: {
            str(n): statistics.median(times[(name, 1)]) / statistics.median(times[(name, n)])
            for n in THREADS
        }
        for name in work
    }


def in_process(bench: Bench) -> dict[str, Any]:
    tokens, repeat = bench.pick(20_000, 100_000), bench.pick(5, 15)
    harness.progress("templating: the history tax")
    tax = history_tax(tokens, repeat)
    harness.progress("templating: cost per message")
    costs = per_message(repeat)
    harness.progress("templating: threads")
    rng = random.Random(4)
    compiled, messages = template("llama3"), conversation(200, 100, rng)
    encode = gil_releasing_encoder(load_tokenizer(None).tokenizer)
    text = Corpus.default().text(rng, 4000)
    jobs = bench.pick(16, 48)
    work: dict[str, Callable[[], object]] = {
        "jinja2": lambda: compiled.render_with_jinja(messages, add_generation_prompt=True),
        "tokenizer": lambda: encode(text),
    }
    speedups = scaling(jobs, work, bench.pick(3, 7))
    return {"tokens": tokens, "render_ms": tax, "per_message": costs, "speedup": speedups}


def tables(blob: dict[str, Any]) -> list[Table]:
    result = blob["in_process"]
    tax = result["render_ms"]
    costs = result["per_message"]
    verdicts = [
        [row["messages"], *(row[n][k] for n in TEMPLATES for k in ("ms", "estimate_ms", "on_loop")),
         row["json_key_ms"]]
        for row in costs["rows"]
    ]  # fmt: skip
    return [
        Table(
            f"render ms at ~{result['tokens'] // 1000}k tokens, by messages",
            ["template", *map(str, TURNS), "100 vs 1"],
            [[n, *by_turns.values(), by_turns["100"] / by_turns["1"]]
             for n, by_turns in tax.items()],
            digits=2,
        ),
        Table(
            f"render ms of ~60-token messages, measured vs the calibrated estimate; on the loop "
            f"when the estimate is <= {costs['budget_ms']:g} ms",
            ["messages", *(f"{n} {k}" for n in TEMPLATES for k in ("ms", "est.", "loop?")),
             "json key ms"],
            verdicts,
            digits=3,
        ),
        Table(
            "the cost model, calibrated at start-up",
            ["template", "base us", "us per message"],
            [[n, *c.values()] for n, c in costs["calibrated"].items()],
            digits=2,
        ),
        Table(
            "speedup over 1 thread, same work",
            ["work", *(f"{n} threads" for n in THREADS)],
            [[k, *v.values()] for k, v in result["speedup"].items()],
            digits=2,
        ),
    ]  # fmt: skip


def plot(blob: dict[str, Any], png: Path) -> None:
    result = blob["in_process"]
    plot_lines(
        f"Render time vs messages at ~{result['tokens'] // 1000}k tokens",
        list(TURNS),
        {name: list(by_turns.values()) for name, by_turns in result["render_ms"].items()},
        "messages",
        "ms",
        png,
    )
    plot_lines(
        "Thread speedup (same total work)",
        list(THREADS),
        {name: list(s.values()) for name, s in result["speedup"].items()},
        "threads",
        "x faster than 1 thread",
        png.with_name("templating-threads.png"),
    )


SCENARIO = Scenario(
    name="templating",
    reproduces="seed 002 exp 2, 4",
    about="Jinja2 cost vs messages, where renders run; threads: templates vs tokenizer",
    reference=(
        "seed 002 exp 2 (~100k tokens, Jinja2): 1 turn 11.8 ms, 10 turns 21.4, 50 turns 41.2,\n"
        "100 turns 58.7 (~5x: cost follows messages, not tokens). exp 4 speedup at 2/4/8/16\n"
        "threads: Jinja2 0.9/0.85/0.82/0.80x, tokenizer 1.8/3.2/5.1/6.8x. Read: the same shape\n"
        "here; this machine's 2 cores cap the tokenizer near 2x (less when others use them)."
    ),
    in_process=in_process,
    tables=tables,
    plot=plot,
)
