"""How long the simulated GPU takes, and who gets to run: pure arithmetic and bookkeeping.

Timing follows llm-d-inference-sim: prefill costs a fixed overhead plus a price per prompt
token the prefix cache did not cover; after the first token, every output token costs one
inter-token latency. Admission is vLLM's continuous batching reduced to its visible effect:
at most `max_running` sequences run at once, the others wait in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.sim.settings import SimSettings


@dataclass(frozen=True)
class LatencyModel:
    prefill_overhead: float
    prefill_per_token: float
    inter_token_latency: float

    @classmethod
    def from_settings(cls, settings: SimSettings) -> LatencyModel:
        return cls(
            settings.prefill_overhead, settings.prefill_per_token, settings.inter_token_latency
        )

    def prefill_seconds(self, uncached_prompt_tokens: int) -> float:
        """Time to the first output token, once the sequence runs."""
        return self.prefill_overhead + uncached_prompt_tokens * self.prefill_per_token

    def token_gap_seconds(self, output_index: int) -> float:
        """The wait before output token `output_index`; the first comes with the prefill."""
        return 0.0 if output_index == 0 else self.inter_token_latency

    def decode_seconds(self, output_tokens: int) -> float:
        return max(output_tokens - 1, 0) * self.inter_token_latency


class BatchAdmission:
    """Running and waiting sequences, by id; admission is first come, first served."""

    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        self.max_running = max_running
        self._running: set[int] = set()
        # A dict is an ordered set with O(1) removal, for waiters that give up.
        self._waiting: dict[int, None] = {}

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def arrive(self, seq_id: int) -> bool:
        """Queue a new sequence; True when it runs at once."""
        if seq_id in self._running or seq_id in self._waiting:
            raise ValueError(f"sequence {seq_id} has already arrived")
        if not self._waiting and len(self._running) < self.max_running:
            self._running.add(seq_id)
            return True
        self._waiting[seq_id] = None
        return False

    def leave(self, seq_id: int) -> list[int]:
        """Remove a finished or abandoned sequence; returns the waiters admitted in its place."""
        if seq_id in self._waiting:
            del self._waiting[seq_id]
            return []
        self._running.remove(seq_id)
        admitted: list[int] = []
        while self._waiting and len(self._running) < self.max_running:
            next_id = next(iter(self._waiting))
            del self._waiting[next_id]
            self._running.add(next_id)
            admitted.append(next_id)
        return admitted
