"""`python -m load bench routing`: the routing issue's comparison (policies and SMG on the same
backends), which lives in `load/routing.py` as `python -m load routing`; run here as that
command, so both stay one measurement. `--quick` is passed on where that command takes it.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys


def main(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("load.routing") is None:
        print("bench routing: load/routing.py is not in this tree yet (the routing issue adds it)")
        return
    command = [sys.executable, "-m", "load", "routing"]
    help_text = subprocess.run([*command, "--help"], capture_output=True, text=True, check=False)
    if help_text.returncode != 0:
        print("bench routing: `python -m load routing` is not wired into load/__main__.py yet")
        return
    if args.quick and "--quick" in help_text.stdout:
        command.append("--quick")
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"bench routing: `{' '.join(command[1:])}` exited {completed.returncode}")
