"""`python -m load bench routing`: the routing comparison (policies and SMG on the same
backends), which lives in `load/routing.py` as `python -m load routing`; run here as that
command, so both stay one measurement. `--quick` keeps one workload (rag), 5 s per run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from load.bench import common


def main(args: argparse.Namespace) -> None:
    out_dir = args.out_dir or common.RESULTS_DIR
    command = [sys.executable, "-m", "load", "routing", "--json", str(out_dir / "routing.json")]
    if args.quick:
        command += ["--workloads", "rag", "--duration", "5"]
    if args.rounds:
        command += ["--rounds", str(args.rounds)]
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"bench routing: `{' '.join(command[1:])}` exited {completed.returncode}")
