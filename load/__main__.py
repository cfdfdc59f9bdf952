"""`python -m load BENCHMARK [...]`: Sluice's load generator and benchmarks."""

from __future__ import annotations

import argparse

from load import overhead


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m load", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    overhead.add_arguments(
        sub.add_parser("overhead", help="latency the proxy adds over a direct backend call")
    )
    args = parser.parse_args()
    if args.benchmark == "overhead":
        overhead.main(args)


main()
