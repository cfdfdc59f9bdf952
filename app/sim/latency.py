"""How long one step of the simulated GPU takes: pure arithmetic.

A real engine (vLLM V1) runs the whole batch forward once per step: every running sequence
that is decoding gets one token, and sequences that are prefilling get a chunk of their
prompt, all within one token budget (`scheduler.py`). So this model prices a step, not a
request:

    step = started * prefill_overhead
         + prefill_tokens * prefill_per_token
         + (inter_token_latency * load_factor(decoding) if any sequence decodes)

The first two terms are llm-d-inference-sim's `per-token` calculator
(`prefill-overhead + (n - n_cached) * prefill-time-per-token`), paid chunk by chunk; the last
is its `inter-token-latency` scaled by its `time-factor-under-load`, which "scales linearly
between 1.0 (one request in flight) and the configured value (at max-num-seqs)" (llm-d docs,
latency-simulation.md). A sequence alone therefore sees exactly llm-d's formula
(`prefill = overhead + uncached * per_token`, `decode = (out - 1) * inter_token`), and a
crowded GPU is slower for everyone on it, which is what routing has to weigh.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.sim.settings import SimSettings


@dataclass(frozen=True)
class Step:
    """What the GPU does in one forward pass."""

    prefill: tuple[tuple[int, int], ...]  # (sequence id, prompt tokens computed now)
    decode: tuple[int, ...]  # sequences producing one output token
    started: int  # sequences whose prefill begins in this step

    @property
    def prefill_tokens(self) -> int:
        return sum(tokens for _, tokens in self.prefill)

    @property
    def batched_tokens(self) -> int:
        return self.prefill_tokens + len(self.decode)


@dataclass(frozen=True)
class LatencyModel:
    prefill_overhead: float
    prefill_per_token: float
    inter_token_latency: float
    time_factor_under_load: float
    max_num_seqs: int

    @classmethod
    def from_settings(cls, settings: SimSettings) -> LatencyModel:
        return cls(
            settings.prefill_overhead,
            settings.prefill_per_token,
            settings.inter_token_latency,
            settings.time_factor_under_load,
            settings.max_num_seqs,
        )

    def load_factor(self, decoding: int) -> float:
        """1.0 for one decoding sequence, `time_factor_under_load` for a full batch."""
        if self.max_num_seqs <= 1 or decoding <= 1:
            return 1.0
        share = min(decoding - 1, self.max_num_seqs - 1) / (self.max_num_seqs - 1)
        return 1.0 + (self.time_factor_under_load - 1.0) * share

    def decode_step_seconds(self, decoding: int) -> float:
        if decoding == 0:
            return 0.0
        return self.inter_token_latency * self.load_factor(decoding)

    def prefill_step_seconds(self, step: Step) -> float:
        return step.started * self.prefill_overhead + step.prefill_tokens * self.prefill_per_token

    def step_seconds(self, step: Step) -> float:
        return self.prefill_step_seconds(step) + self.decode_step_seconds(len(step.decode))

    def prefill_seconds(self, uncached_prompt_tokens: int) -> float:
        """Time to the first token of a sequence alone whose prompt fits one step."""
        return self.prefill_overhead + uncached_prompt_tokens * self.prefill_per_token

    def decode_seconds(self, output_tokens: int) -> float:
        """Time from the first to the last token of a sequence decoding alone."""
        return max(output_tokens - 1, 0) * self.inter_token_latency
