"""`python -m load bench SCENARIO [--quick]`: the seeds' experiments, one command each.

Every scenario starts its own simulated backends and proxies as separate processes, runs its
variants side by side in one run (alternating rounds: these machines are noisy), prints a
table to read next to the seed it reproduces, and writes `load/results/SCENARIO.json` with a
PNG beside it. `--quick` finishes in under a minute.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

SCENARIOS = {
    "stalls": "inline vs offload vs offload+caches under bursts (seed 000)",
    "cache": "L0/L1 hit rates per workload, L1's saving on multi-turn (seed 001)",
    "saturation": "wait vs bail-out under overload (seed 000's semaphore)",
    "routing": "routing policies and SMG on the same backends (load/routing.py)",
    "overhead": "direct vs Sluice vs SMG vs LiteLLM: added latency, CPU per request",
    "sidecar": "--forward passthrough vs tokens, backend charging preprocessing (seed 002 exp 7)",
    "templating": "Jinja2 cost vs messages; threads: templates vs tokenizer (seed 002 exp 2, 4)",
    "submit": "time before a request reaches a backend, inline vs offload (seed 003)",
    "streams": "relaying N concurrent token streams: direct vs Sluice vs SMG (issue 15)",
    "replicas": "1, 2, 4 replicas behind a round robin, KV events on/off, budgets in Redis (17)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--quick", action="store_true", help="finish in under a minute")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default per scenario)")
    parser.add_argument(
        "--streams",
        type=int,
        action="append",
        help="streams: concurrent streams (repeatable; default 50 and 200)",
    )
    parser.add_argument(
        "--out-dir", type=Path, help="where JSON and PNG go (default: load/results/)"
    )


def main(args: argparse.Namespace) -> None:
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        module = importlib.import_module(f"load.bench.{name}")
        module.main(args)
