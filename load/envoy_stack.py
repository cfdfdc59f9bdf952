"""Envoy in a benchmark's `Stack`, and the four doors `bench epp` puts before the same GPUs.

- `direct`: the GPU itself (one GPU: a client spreading over several is what `envoy` does).
- `envoy`: `sluice envoy --round-robin`, Envoy's own round robin, no picker.
- `envoy+epp`: `sluice serve --epp-port 0` (its proxy port unused) and `sluice envoy --epp`:
  Envoy asks Sluice's endpoint picker (ext_proc over gRPC) where each request goes.
- `sluice`: `sluice serve`, Sluice's own proxy, with the same flags.

Envoy binds port 0 for its listener and its admin interface and writes the admin address to
a file (`--admin-address-path`); once the admin's `/ready` answers 200, the listener's port
is read from `/listeners`: no race for ports. `sluice envoy` replaces itself with Envoy
(exec), so the PID the Stack holds, measures and stops (SIGTERM) is Envoy's own. Its log is
kept in the Stack's log directory like every other process's.

Also here: Prometheus histograms read as the change between two scrapes (a round's), with
the bucket bound that holds a quantile (Sluice's `sluice_epp_decision_seconds` and
`sluice_tokenize_seconds{path}`), and one answer through a door compared byte for byte with
the GPU's own (the simulated GPU answers a prompt the same way every time).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from load import harness
from load.client import CHAT, FAILURES, Reply, call
from load.processes import LOG_DIR, Stack, log_path, tree_cpu

TARGETS = ("direct", "envoy", "envoy+epp", "sluice")
EPP_PATTERN = re.compile(r"Sluice endpoint picker: (127\.0\.0\.1:\d+)")
LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# Envoy's own default is one worker thread a core (2 here), as a user runs it.
ENVOY_FLAGS = ("--", "--log-level", "warning")


@dataclass(frozen=True)
class Target:
    """One door before the GPUs: where clients send, and whose CPU and metrics say what."""

    name: str
    url: str
    pids: dict[str, int] = field(default_factory=dict)  # {"sluice": pid, "envoy": pid}
    sluice: str | None = None  # the Sluice's proxy URL: its /metrics (also in EPP mode)


def netloc(url: str) -> str:
    return urlsplit(url).netloc


async def start_envoy(
    stack: Stack, gpus: Sequence[str], epp: str | None = None, *flags: str
) -> Target:
    """Envoy before `gpus`: asking the picker at `epp` (HOST:PORT), or round robin (None);
    `flags`: more of `sluice envoy`'s (`--body-mode buffered`)."""
    LOG_DIR.mkdir(exist_ok=True)
    handle, name = tempfile.mkstemp(dir=LOG_DIR, suffix=".admin")
    os.close(handle)  # Envoy writes the address into it once it listens
    admin_file = Path(name)
    argv = [sys.executable, "-m", "app", "envoy", "--port", "0", "--admin-port", "0"]
    argv += [*(["--epp", epp] if epp else ["--round-robin"]), *flags]
    for gpu in gpus:
        argv += ["--pool", netloc(gpu)]
    argv += [*ENVOY_FLAGS, "--admin-address-path", str(admin_file)]
    process = _spawn(argv)
    stack.processes.append(process)
    try:
        with trio.fail_after(60):
            url = await _listener(process, admin_file)
    finally:
        await trio.Path(admin_file).unlink(missing_ok=True)
    stack.pids[url] = process.pid
    return Target("envoy+epp" if epp else "envoy", url, {"envoy": process.pid})


def _spawn(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """`argv` started, its output in the Stack's log directory under its PID."""
    with tempfile.NamedTemporaryFile(dir=LOG_DIR, suffix=".log", delete=False) as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    Path(log.name).replace(log_path(process))
    return process


async def _listener(process: subprocess.Popen[bytes], admin_file: Path) -> str:
    """Envoy's listener URL, once its admin interface says it is ready."""
    while True:
        if process.poll() is not None:
            text = log_path(process).read_text(errors="replace")
            raise RuntimeError(f"envoy exited ({process.returncode}):\n{text[-2000:]}")
        admin = (await trio.Path(admin_file).read_text()).strip()
        if admin:
            try:
                if (await call(f"http://{admin}/ready", give_up_s=2)).status == 200:
                    listeners = (await call(f"http://{admin}/listeners?format=json")).json()
                    status = listeners["listener_statuses"][0]["local_address"]
                    address = status["socket_address"]
                    return f"http://{address['address']}:{address['port_value']}"
            except FAILURES:
                pass
        await trio.sleep(0.05)


async def epp_address(stack: Stack, proxy: str) -> str:
    """The picker's HOST:PORT that the `sluice serve --epp-port 0` at `proxy` printed."""
    path = log_path_of(stack, proxy)
    with trio.fail_after(30):
        while True:
            found = EPP_PATTERN.search(await trio.Path(path).read_text(errors="replace"))
            if found:
                return found.group(1)
            await trio.sleep(0.05)


def log_path_of(stack: Stack, url: str) -> Path:
    return LOG_DIR / f"{stack.pids[url]}.log"


async def start_targets(
    stack: Stack, gpus: Sequence[str], flags: Sequence[str], names: Sequence[str] = TARGETS
) -> dict[str, Target]:
    """The doors `names` before `gpus`, in that order; both Sluices get `flags`."""
    targets: dict[str, Target] = {}
    for name in names:
        if name == "direct":
            if len(gpus) != 1:
                raise ValueError("direct is one GPU's own door")
            targets[name] = Target(name, gpus[0])
        elif name == "envoy":
            targets[name] = await start_envoy(stack, gpus)
        elif name == "envoy+epp":
            sluice = await stack.proxy(gpus, "--epp-port", "0", *flags)
            envoy = await start_envoy(stack, gpus, await epp_address(stack, sluice))
            pids = {"sluice": stack.pids[sluice], **envoy.pids}
            targets[name] = Target(name, envoy.url, pids, sluice)
        elif name == "sluice":
            sluice = await stack.proxy(gpus, *flags)
            targets[name] = Target(name, sluice, {"sluice": stack.pids[sluice]}, sluice)
        else:
            raise ValueError(f"no target named {name!r}")
    return targets


async def all_answer(targets: dict[str, Target], probe: dict[str, Any]) -> None:
    """Every door answers a chat with 200 (Envoy+EPP once Envoy saw the picker healthy)."""
    for name, target in targets.items():
        if not await harness.answers(target.url, {}, probe):
            raise RuntimeError(f"{name} never answered a chat with 200")


def cpu_now(target: Target) -> dict[str, float]:
    return {role: tree_cpu(pid) for role, pid in target.pids.items()}


def cpu_since(target: Target, before: dict[str, float]) -> dict[str, float]:
    return {role: tree_cpu(pid) - before[role] for role, pid in target.pids.items()}


# -- histograms between two scrapes ---------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A histogram's change between two scrapes, every other label summed."""

    bounds: tuple[float, ...]  # upper bounds, ascending, +Inf last
    cumulative: tuple[float, ...]  # observations at or below each bound
    total: float  # the sum of the observations, s

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def bound_of(self, q: float) -> float:
        """The smallest bucket bound that holds the q-th percentile (0..100); NaN: empty."""
        if not self.count:
            return math.nan
        wanted = self.count * q / 100
        return next(b for b, c in zip(self.bounds, self.cumulative, strict=True) if c >= wanted)

    def as_dict(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean_ms": self.mean * 1e3,
            "p50_le_ms": self.bound_of(50) * 1e3,
            "p99_le_ms": self.bound_of(99) * 1e3,
        }


def histogram(before: dict[str, float], after: dict[str, float], name: str) -> Histogram:
    """`name`'s buckets, count and sum as changed from `before` to `after` (parse_metrics)."""
    buckets: dict[float, float] = {}
    total = 0.0
    for key, value in after.items():
        change = value - before.get(key, 0.0)
        if key.startswith(name + "_bucket{"):
            le = dict(LABELS.findall(key))["le"]
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + change
        elif key == name + "_sum" or key.startswith(name + "_sum{"):
            total += change
    bounds = tuple(sorted(buckets))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), total)


# -- comparing answers ------------------------------------------------------------------------


async def byte_compare(url: str, request: dict[str, Any]) -> dict[str, Any]:
    """`request` (a chat) through Envoy+EPP at `url` against the GPU that served it, each
    asked after a first identical request, so that both report the same cached tokens; the
    GPU asked twice says whether it answers a prompt deterministically."""

    async def ask(where: str) -> Reply:
        return await call(where + CHAT, "POST", json_body=request)

    first = await ask(url)  # its GPU now holds the whole prompt: the next report it cached
    gpu = first.headers.get("x-sluice-backend", "")
    if first.status != 200 or not gpu:
        return {"error": f"through Envoy+EPP: {first.status}, backend {gpu or 'not said'}"}
    direct, through, again = await ask(gpu), await ask(url), await ask(gpu)
    return {
        "statuses": [first.status, direct.status, through.status, again.status],
        "bytes": len(through.body),
        "same_gpu": through.headers.get("x-sluice-backend") == gpu,
        "deterministic": normalized(direct.body) == normalized(again.body),
        "identical": normalized(through.body) == normalized(direct.body),
        "same_text": token_text(through.body) == token_text(direct.body),
    }


def normalized(body: bytes) -> bytes:
    """A chat answer (whole or server-sent events) less what differs between two identical
    answers: each chunk's `id` and `created`."""
    body = re.sub(rb'"id"\s*:\s*"[^"]*"', b'"id":""', body)
    return re.sub(rb'"created"\s*:\s*\d+', b'"created":0', body)


def token_text(body: bytes) -> str:
    """The text of a streamed chat answer's deltas, joined."""
    pieces: list[str] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
    return "".join(pieces)
