"""`python -m load BENCHMARK [...]`: Sluice's load generator and benchmarks."""

from __future__ import annotations

import argparse

from load import (
    bench,
    bench_preprocess,
    burst,
    compare,
    dashboard_cost,
    detector_cost,
    hardening,
    overhead,
    profile,
    routing,
    runner,
    soak,
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m load", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    overhead.add_arguments(
        sub.add_parser("overhead", help="latency the proxy adds over a direct backend call")
    )
    burst.add_arguments(
        sub.add_parser(
            "burst", help="event-loop freeze during a tokenization burst, inline vs offload"
        )
    )
    detector_cost.add_arguments(
        sub.add_parser("detector-cost", help="proxy throughput with the stall timer on vs off")
    )
    dashboard_cost.add_arguments(
        sub.add_parser("dashboard-cost", help="proxy CPU per request with 0 vs 5 dashboard pages")
    )
    sub.add_parser("preprocess", help="tokenizer cache, template and loop micro-benchmarks")
    hardening.add_arguments(
        sub.add_parser("hardening", help="long chats, a 12 MB prompt, 1,000 streams: the loop")
    )
    runner.add_arguments(sub.add_parser("run", help="open- or closed-loop load against a URL"))
    bench.add_arguments(sub.add_parser("bench", help="a seed's experiment, variants side by side"))
    soak.add_arguments(sub.add_parser("soak", help="mixed soak with faults, verdict at the end"))
    profile.add_arguments(sub.add_parser("profile", help="py-spy profile of the proxy under load"))
    routing.add_arguments(
        sub.add_parser("routing", help="routing policies and SMG side by side on 4 simulated GPUs")
    )
    compare.add_arguments(
        sub.add_parser("compare", help="this checkout's proxy against a git revision's, by turns")
    )
    args = parser.parse_args()
    if args.benchmark == "overhead":
        overhead.main(args)
    elif args.benchmark == "burst":
        burst.main(args)
    elif args.benchmark == "detector-cost":
        detector_cost.main(args)
    elif args.benchmark == "dashboard-cost":
        dashboard_cost.main(args)
    elif args.benchmark == "preprocess":
        bench_preprocess.main()
    elif args.benchmark == "hardening":
        hardening.main(args)
    elif args.benchmark == "run":
        runner.main(args)
    elif args.benchmark == "bench":
        bench.main(args)
    elif args.benchmark == "soak":
        soak.main(args)
    elif args.benchmark == "profile":
        profile.main(args)
    elif args.benchmark == "routing":
        routing.main(args)
    elif args.benchmark == "compare":
        compare.main(args)


main()
