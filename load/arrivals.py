"""When requests arrive: open-loop arrival schedules, pure and seeded.

An open-loop load generator decides every send time in advance and never waits on the
server, so a slow answer cannot delay (and hide) the requests behind it: no coordinated
omission. The processes are vllm bench serve's: Poisson (exponential gaps), constant, and
gamma with a burstiness factor (shape k, mean gap 1/rate; k = 1 is Poisson, k < 1 burstier,
k > 1 smoother).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

Process = Literal["poisson", "constant", "gamma"]
PROCESSES: tuple[Process, ...] = ("poisson", "constant", "gamma")


def gaps(
    process: Process, rate: float, rng: random.Random, burstiness: float = 1.0
) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds, mean 1/rate."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    while True:
        if process == "constant":
            yield 1.0 / rate
        elif process == "poisson":
            yield rng.expovariate(rate)
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def schedule(
    process: Process, rate: float, duration: float, seed: int = 0, burstiness: float = 1.0
) -> list[float]:
    """Send times in [0, duration), in order."""
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    for gap in gaps(process, rate, rng, burstiness):
        now += gap
        if now >= duration:
            return times
        times.append(now)
    return times  # unreachable: gaps() is endless
