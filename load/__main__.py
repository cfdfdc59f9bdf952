"""`python -m load VERB`: Sluice's load generator and benchmarks. Results go to --out-dir
(default ~/.cache/sluice-load), never into the checkout; `report` renders the reference
results (load/reference/) as Markdown."""

from __future__ import annotations

import argparse
from pathlib import Path

from load import bench, compare, harness, profile, report, runner, soak_command


def add_common(parser: argparse.ArgumentParser) -> None:
    """What every scenario of `bench` takes."""
    parser.add_argument("--quick", action="store_true", help="finish in under a minute")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default per scenario)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=harness.default_out_dir(),
        help="where the JSON and PNG go (default: %(default)s)",
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more flag for every `sluice serve` started, e.g. --proxy-arg=--workers=2",
    )


def add_bench(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", help="name every scenario and exit")
    scenarios = parser.add_subparsers(dest="scenario", metavar="NAME")
    for scenario in bench.all_scenarios():
        sub = scenarios.add_parser(scenario.name, help=f"{scenario.about} ({scenario.reproduces})")
        add_common(sub)
        if scenario.options is not None:
            scenario.options(sub)
    add_common(scenarios.add_parser("all", help="every scenario above, one after the other"))


def main_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.list:
        for scenario in bench.all_scenarios():
            print(f"{scenario.name:15} {scenario.reproduces:18} {scenario.about}")
        return
    if args.scenario is None:
        parser.error("bench: name a scenario (bench --list shows them)")
    if args.rounds is not None and args.rounds < 1:
        parser.error("bench: --rounds must be at least 1")
    if args.scenario != "all":
        harness.run(bench.scenario(args.scenario), args)
        return
    for scenario in bench.all_scenarios():
        defaults = argparse.ArgumentParser()
        if scenario.options is not None:
            scenario.options(defaults)
        harness.run(scenario, argparse.Namespace(**{**vars(defaults.parse_args([])), **vars(args)}))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m load", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    runner.add_arguments(
        verbs.add_parser("run", help="load any OpenAI-compatible URL: open or closed loop, sweeps")
    )
    bench_parser = verbs.add_parser(
        "bench", help="one claim measured side by side (`bench --list` names them)"
    )
    add_bench(bench_parser)
    soak_command.add_arguments(
        verbs.add_parser("soak", help="mixed traffic with faults for N minutes, a verdict")
    )
    compare.add_arguments(
        verbs.add_parser("compare", help="this checkout's proxy against a git revision's, by turns")
    )
    profile.add_arguments(
        verbs.add_parser("profile", help="py-spy on the proxy under load: where its CPU goes")
    )
    report.add_arguments(
        verbs.add_parser(
            "report", help="the reference results' tables as Markdown (--write: into the READMEs)"
        )
    )
    args = parser.parse_args()
    if args.verb == "bench":
        main_bench(bench_parser, args)
        return
    mains = {"run": runner.main, "soak": soak_command.main, "compare": compare.main}
    mains |= {"profile": profile.main, "report": report.main}
    mains[args.verb](args)


main()
