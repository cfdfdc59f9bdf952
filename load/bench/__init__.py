"""The scenarios of `python -m load bench NAME`: one module each, in the order `--list` shows
them. Each module declares `SCENARIO` (load/harness.py's `Scenario`): its variants, workload
and table; the harness runs it.
"""

from __future__ import annotations

import importlib

from load.harness import Scenario

NAMES = (
    "stalls",
    "cache",
    "saturation",
    "routing",
    "overhead",
    "sidecar",
    "templating",
    "submit",
    "hardening",
    "detector-cost",
    "dashboard-cost",
    "streams",
    "tracing",
    "replicas",
    "fairness",
    "admission",
    "longprompts",
    "epp",
    "pd",
    "discovery",
)


def scenario(name: str) -> Scenario:
    module = importlib.import_module(f"load.bench.{name.replace('-', '_')}")
    found: Scenario = module.SCENARIO
    return found


def all_scenarios() -> list[Scenario]:
    return [scenario(name) for name in NAMES]
