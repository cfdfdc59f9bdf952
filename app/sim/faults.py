"""Failures the simulated backend can be told to show, changeable while it runs.

Tests and the demo flip these through `POST /sim/faults` to kill and revive a backend without
killing its process. The error rate draws from a seeded generator so runs repeat exactly.
"""

from __future__ import annotations

import random
from dataclasses import InitVar, asdict, dataclass, fields
from typing import Any

from app.sim.settings import SimSettings


@dataclass
class SimFaults:
    # Fraction of inference requests answered 500.
    error_rate: float = 0.0
    # Inference requests are read and then never answered.
    hang: bool = False
    # Streams stop before their last token and the connection drops without an end.
    close_mid_stream: bool = False
    # /health answers 503.
    unhealthy: bool = False
    # The next this many KV event messages are left off the PUB socket (replay keeps them).
    drop_kv_events: int = 0
    seed: InitVar[int] = 0

    def __post_init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    @classmethod
    def from_settings(cls, settings: SimSettings) -> SimFaults:
        return cls(
            error_rate=settings.error_rate,
            hang=settings.hang,
            close_mid_stream=settings.close_mid_stream,
            unhealthy=settings.start_unhealthy,
            seed=settings.seed,
        )

    def draw_error(self) -> bool:
        return self._rng.random() < self.error_rate

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a JSON object of changes; `start_unhealthy` is accepted for `unhealthy`.

        Raises ValueError, changing nothing, when a key or a value is wrong.
        """
        renamed = {
            ("unhealthy" if key == "start_unhealthy" else key): v for key, v in changes.items()
        }
        unknown = set(renamed) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown fault(s): {', '.join(sorted(unknown))}")
        for key, value in renamed.items():
            if key == "error_rate":
                is_number = isinstance(value, int | float) and not isinstance(value, bool)
                if not is_number or not 0.0 <= value <= 1.0:
                    raise ValueError("error_rate must be a number between 0 and 1")
            elif key == "drop_kv_events":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError("drop_kv_events must be a non-negative integer")
            elif not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false")
        for key, value in renamed.items():
            setattr(self, key, float(value) if key == "error_rate" else value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
