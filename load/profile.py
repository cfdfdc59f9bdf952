"""`python -m load profile`: where the proxy's CPU per request goes, with py-spy.

Starts one instant simulated backend and `sluice serve` in front of it (separate processes),
drives the overhead scenario's traffic (non-streaming one-token chats, open loop, through
the lean client, load/client.py) and meanwhile samples the proxy with `py-spy record --format raw`
(py-spy from PyPI; it needs ptrace rights: root, or CAP_SYS_PTRACE). Prints the CPU per
request from /proc, then the samples by package (of the innermost frame), by owner (the
innermost frame outside Trio's and the standard library's plumbing: who caused a socket
call or a task switch), by function (self) and including callees (inclusive: py-spy sees
only the running part of a coroutine's stack, so this view undercounts). Writes the
collapsed stacks (flame-graph input) and the summary to `--out-dir` (profile*).

    python -m load profile --rate 200 --seconds 20 [--proxy-arg=--no-stall-instrument]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from load import client, drive, harness
from load.processes import Stack, cpu_seconds

TOP = 25


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("profile: py-spy is not installed (pip install py-spy)")
    return found


def frame_label(frame: str) -> str:
    """`handle (app/proxy/app.py:123)` -> `handle (app/proxy/app.py)`: lines merged."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    if "/app/" in path:
        path = "app/" + path.split("/app/", 1)[1]
    return f"{name} ({path})"


def package(label: str) -> str:
    path = label.rsplit("(", 1)[-1].rstrip(")")
    if path.startswith("app/"):
        return "/".join(path.split("/")[:2])
    if path.startswith(".") or path.startswith("/"):
        return path.split("/")[-1]
    return path.split("/")[0].split(".")[0]


# Frames that do work on behalf of their callers: a sample in them is charged to the
# innermost caller outside them (the "owner" view).
RUNTIME = (
    "trio",
    "outcome",
    "contextlib",
    "<attrs",
    "<frozen",
    "collections",
    "typing",
    "functools",
    "abc",
)


def owner(frames: list[str]) -> str:
    """The innermost frame that is not runtime plumbing, e.g. the code that called `send_all`."""
    for label in reversed(frames):
        if label.startswith("run (trio/"):
            return "the Trio loop itself (epoll, scheduling)"
        if not package(label).startswith(RUNTIME) and not label.startswith("<"):
            return label
    return "a socket call whose caller py-spy did not see"


def summarize(collapsed: str) -> tuple[int, dict[str, list[tuple[str, int]]]]:
    """Samples in all, and the top frames by package, self time and inclusive time."""
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    owners: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_label(f) for f in stack.split(";") if "(" in f]
        if not frames:
            continue
        total += count
        self_time[frames[-1]] += count
        packages[package(frames[-1])] += count
        owners[owner(frames)] += count
        for label in set(frames):
            inclusive[label] += count
    return total, {
        "self": self_time.most_common(TOP),
        "inclusive": inclusive.most_common(TOP),
        "packages": packages.most_common(TOP),
        "owner": owners.most_common(TOP),
    }


async def under_load(args: argparse.Namespace) -> dict[str, Any]:
    async with Stack(args.proxy_arg) as stack:
        sim = await stack.sim(instant=True)
        url = await stack.proxy(sim)
        pid = stack.pids[url]
        await harness.wait_healthy(url)
        pool = client.Pool(url)
        await pool.warm(100)
        raw = args.out_dir / "profile-collapsed.txt"
        raw.parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [py_spy(), "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
             "--rate", "250", "--format", "raw", "--output", str(raw), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        await trio.sleep(1.0)  # py-spy attaches
        cpu0 = cpu_seconds(pid)
        if args.clients:
            source = drive.one_token(pool)
            run = await drive.closed_loop(pool, args.clients, source, seconds=args.seconds - 2)
        else:
            one = pool.prepare(client.ONE_TOKEN_REQUEST)
            run = await drive.open_loop(pool, drive.poisson(one, args.rate, args.seconds - 2, 1))
        answered, errors = run.ok, run.errors
        cpu = cpu_seconds(pid) - cpu0
        await trio.to_thread.run_sync(spy.wait)
        await pool.close()
        if spy.returncode != 0:
            assert spy.stderr is not None
            raise SystemExit(f"profile: py-spy failed: {spy.stderr.read().decode()[-500:]}")
    requests = answered + errors
    return {
        "requests": requests,
        "errors": errors,
        "cpu_ms_per_request": cpu / max(requests, 1) * 1e3,
        "collapsed": str(raw),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument(
        "--clients", type=int, default=0, help="closed-loop clients instead of --rate"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the profile")
    parser.add_argument("--proxy-arg", action="append", default=[], help="flag for sluice serve")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=harness.default_out_dir(),
        help="where the profile goes (default: %(default)s)",
    )


def main(args: argparse.Namespace) -> None:
    if args.seconds < 5:
        raise SystemExit("profile: --seconds must be at least 5")
    run = trio.run(under_load, args)
    samples, summary = summarize(Path(run["collapsed"]).read_text())
    total = samples or 1
    load_shape = f"{args.clients} closed-loop clients" if args.clients else f"{args.rate:g}/s"
    lines = [
        f"{run['requests']:.0f} requests, {load_shape}, {run['errors']:.0f} errors; proxy CPU "
        f"{run['cpu_ms_per_request']:.2f} ms/request; {total} samples (py-spy, non-idle)"
    ]
    for title in ("packages", "owner", "self", "inclusive"):
        lines.append(f"\nby {title} (% of samples)")
        for label, count in summary[title]:
            lines.append(f"  {100 * count / total:5.1f}%  {label}")
    text = "\n".join(lines)
    print(text)
    out = Path(run["collapsed"]).with_name("profile.txt")
    out.write_text(text + "\n")
    blob = {**harness.provenance(), "run": run, "samples": samples, "summary": summary}
    out.with_suffix(".json").write_text(json.dumps(blob, indent=1))
    print(f"\nwrote {out}, {out.with_suffix('.json')} and {run['collapsed']}")
