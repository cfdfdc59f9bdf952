"""The two doors into a Sluice, for a benchmark that runs its parts through both.

- `proxy`: Sluice's own HTTP proxy (`sluice serve`); clients send to its URL.
- `epp`: a real Envoy in front of the same backends, with Sluice (`sluice serve --epp-port
  0`) as its endpoint picker: clients send to Envoy's listener, Envoy asks the picker over
  ext_proc where each request goes (`sluice envoy` as load/envoy_stack.py starts it).

Either way one Sluice process admits, holds and routes: its /metrics, dashboard and
held-with-room are read at `Door.sluice` as usual (the Stack asks it at its stop), and
`Door.pids` are the processes whose CPU the door costs (Sluice, then Envoy). Everything binds
127.0.0.1; the Stack stops Envoy before its Sluice.

    door = await open_door(stack, "epp", sims, *flags)   # door.url: where clients send
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from load.envoy_stack import epp_address, start_envoy
from load.harness import fmt
from load.processes import Stack, tree_cpu

DOORS = ("proxy", "epp")


@dataclass(frozen=True)
class Door:
    name: str  # "proxy" or "epp"
    url: str  # where clients send
    sluice: str  # the Sluice's proxy URL: /metrics, `Stack.dashboard`
    pids: tuple[int, ...]  # Sluice's, then Envoy's

    def cpu(self) -> tuple[float, ...]:
        """CPU seconds so far of each of the door's processes (and their children)."""
        return tuple(tree_cpu(pid) for pid in self.pids)


def doors(choice: str) -> tuple[str, ...]:
    """`--door proxy|epp|both` as the doors to run."""
    return DOORS if choice == "both" else (choice,)


def label(variant: str, door: str) -> str:
    """A variant's name through a door: itself through the proxy (as before doors), else
    `variant:door`."""
    return variant if door == "proxy" else f"{variant}:{door}"


def split(name: str) -> tuple[str, str]:
    """`label`'s inverse: (variant, door)."""
    variant, _, door = name.partition(":")
    return variant, door or "proxy"


async def open_door(stack: Stack, door: str, backends: str | Sequence[str], *flags: str) -> Door:
    """Sluice before `backends` with `flags`, and the door's way in."""
    if door == "proxy":
        url = await stack.proxy(backends, *flags)
        return Door(door, url, url, (stack.pids[url],))
    if door != "epp":
        raise ValueError(f"no door {door!r}: one of {', '.join(DOORS)}")
    sluice = await stack.proxy(backends, "--epp-port", "0", *flags)
    gpus = [backends] if isinstance(backends, str) else list(backends)
    envoy = await start_envoy(stack, gpus, await epp_address(stack, sluice))
    return Door(door, envoy.url, sluice, (stack.pids[sluice], envoy.pids["envoy"]))


def side_by_side(rows: Sequence[tuple[str, str, Sequence[Any]]], digits: int) -> list[list[Any]]:
    """Table rows of (name, door, cells), one row a name: each cell its doors' figures in
    DOORS order, `proxy | epp` (a name seen through one door keeps its figures as they are),
    so that a table is as long with both doors as with one."""
    grouped: dict[str, dict[str, Sequence[Any]]] = {}
    for name, door, cells in rows:
        grouped.setdefault(name, {})[door] = cells
    out: list[list[Any]] = []
    for name, by_door in grouped.items():
        if len(by_door) == 1:
            out.append([name, *next(iter(by_door.values()))])
            continue
        ordered = [by_door[door] for door in DOORS if door in by_door]
        columns = zip(*ordered, strict=True)
        out.append([name, *(" | ".join(fmt(c, digits) for c in cells) for cells in columns)])
    return out
