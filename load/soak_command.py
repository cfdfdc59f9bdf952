"""`python -m load soak`'s command line: its flags, and the soak run to its verdict (soak.py
runs it, soak_report.py judges it)."""

from __future__ import annotations

import argparse

import trio

from load.doors import DOORS
from load.soak import CAPACITY_S, CAPACITY_WARM_S, STEADY_RATE, Soak
from load.soak_report import verdict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--door", choices=DOORS, default="proxy", help="proxy, or Envoy asking Sluice (epp)"
    )
    parser.add_argument(
        "--fleet",
        choices=("aggregated", "pd", "dns"),
        default="aggregated",
        help="two engines that do both, (pd) two prefill and two decode engines, or (dns) two "
        "engines behind a DNS name, one replaced in a rolling replacement every 3 min",
    )
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra flag for `sluice serve`"
    )
    parser.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        help="extra flag for both `sluice sim-backend`s, e.g. --sim-arg=--max-num-seqs=8",
    )
    steady = parser.add_mutually_exclusive_group()
    steady.add_argument(
        "--rate", type=float, default=STEADY_RATE, help="steady requests/s (default: %(default)s)"
    )
    steady.add_argument(
        "--load",
        type=float,
        help="steady traffic at this multiple of what the two simulated GPUs answer of it, "
        f"measured for {CAPACITY_WARM_S + CAPACITY_S:g} s before the soak",
    )


def main(args: argparse.Namespace) -> None:
    if args.minutes < 1:
        raise SystemExit("soak: --minutes must be at least 1")
    if args.rate <= 0 or (args.load is not None and args.load <= 0):
        raise SystemExit("soak: --rate and --load must be above 0")
    if args.fleet != "aggregated" and (args.door != "proxy" or args.load is not None):
        raise SystemExit(f"soak: --fleet {args.fleet} goes through the proxy door, at a --rate")
    soak = Soak(
        args.minutes,
        args.seed,
        args.proxy_arg,
        args.sim_arg,
        args.rate,
        args.load,
        args.door,
        args.fleet,
    )
    trio.run(soak.run)
    raise SystemExit(0 if verdict(soak.done, soak.crashes, soak.lost_examples) else 1)
