"""Continuous batching with chunked prefill, the way vLLM V1 schedules a step. Pure.

Design rules:
1. One step spends at most `max_num_batched_tokens` tokens (vLLM's token budget, default
   2048 in `SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS`): first one token for each
   decoding sequence, then prompt chunks for the sequences already prefilling, in admission
   order, then the waiting sequences it admits, in arrival order.
2. At most `max_num_seqs` sequences are admitted (prefilling or decoding) at once.
3. Admission is first come, first served: a waiting sequence never overtakes another, save
   one passed over by rule 7, which keeps its place at the head.
4. The prefix cache is consulted when a sequence is admitted, not when it arrives (the
   `admit` callback answers how many prompt tokens are left to compute), as vLLM does.
5. The step that computes a prompt's last chunk also samples its first output token.
6. A sequence whose prompt's KV arrived from a prefill engine (disaggregation) is admitted as
   any other, but computes no prompt: it decodes in the step that admits it, at one token of
   budget and no prefill overhead, so a decode engine's steps carry no prompt chunks for it.
7. At most `max_loras` distinct LoRA adapters run at once (vLLM's `--max-loras`): a waiting
   sequence under another adapter is passed over while the batch has that many, and the
   sequences behind it are considered, as vLLM V1's scheduler skips it (base-model sequences
   and those under an adapter already running are admitted past it).

States of one sequence, and what moves it (anything else is a bug and raises):

    state       event                                   next state
    ---------   -------------------------------------   ----------
    (none)      arrive                                  WAITING
    (none)      arrive_prefilled (KV transferred)       WAITING (prefilled)
    WAITING     admitted by `plan` (rules 2, 3, 7)      PREFILLING
    WAITING     its adapter would exceed max_loras (7)  WAITING (passed over this step)
    WAITING     admitted by `plan`, prefilled (rule 6)  DECODING (token 0 out at its end)
    PREFILLING  `complete`: last chunk computed         DECODING (token 0 out)
    DECODING    `complete`: last output token out       (removed: finished)
    any         abort (the client went away)            (removed)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from app.errors import require_at_least
from app.sim.latency import Step


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"


@dataclass
class _Seq:
    output_tokens: int
    state: SeqState = SeqState.WAITING
    to_prefill: int = 0
    produced: int = 0
    prefilled: bool = False
    adapter: str | None = None  # the LoRA adapter it runs under (rule 7)


@dataclass(frozen=True)
class Progress:
    """A sequence that produced a token in the step just completed."""

    seq_id: int
    produced: int  # output tokens produced so far
    finished: bool


class StepScheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        admit: Callable[[int], int],
        max_loras: int = 0,
    ) -> None:
        require_at_least(
            1, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras  # 0: LoRA off, no sequence names an adapter
        self._admit = admit
        # Dicts keep insertion order: arrival order for waiting, admission order for running.
        self._waiting: dict[int, _Seq] = {}
        self._running: dict[int, _Seq] = {}

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def state(self, seq_id: int) -> SeqState | None:
        seq = self._running.get(seq_id) or self._waiting.get(seq_id)
        return None if seq is None else seq.state

    def arrive(self, seq_id: int, output_tokens: int, adapter: str | None = None) -> None:
        self._arrive(seq_id, _Seq(output_tokens, adapter=adapter))

    def arrive_prefilled(self, seq_id: int, output_tokens: int, adapter: str | None = None) -> None:
        """A sequence whose prompt's KV was transferred: it will skip PREFILLING (rule 6)."""
        self._arrive(seq_id, _Seq(output_tokens, prefilled=True, adapter=adapter))

    def _arrive(self, seq_id: int, seq: _Seq) -> None:
        if seq_id in self._waiting or seq_id in self._running:
            raise ValueError(f"sequence {seq_id} has already arrived")
        if seq.output_tokens < 1:
            raise ValueError("a sequence produces at least one token")
        if seq.adapter is not None and self.max_loras < 1:
            raise ValueError("a sequence names a LoRA adapter but max_loras is 0")
        self._waiting[seq_id] = seq

    def adapters(self) -> tuple[dict[str, int], dict[str, int]]:
        """Sequences per adapter, running and waiting (vLLM's `running_lora_adapters` and
        `waiting_lora_adapters`), in admission and arrival order."""
        return _per_adapter(self._running.values()), _per_adapter(self._waiting.values())

    def abort(self, seq_id: int) -> None:
        """Forget a sequence in any state; a no-op for one already finished."""
        self._waiting.pop(seq_id, None)
        self._running.pop(seq_id, None)

    def plan(self) -> Step:
        """The next step's work; admits waiting sequences that fit (rules 1-4, 6, 7)."""
        budget = self.max_num_batched_tokens
        decode: list[int] = []
        prefill: list[tuple[int, int]] = []
        for seq_id, seq in self._running.items():
            if budget == 0:
                break
            if seq.state is SeqState.DECODING:
                decode.append(seq_id)
                budget -= 1
            else:
                chunk = min(seq.to_prefill, budget)
                prefill.append((seq_id, chunk))
                budget -= chunk
        started = 0
        full = budget == 0 or len(self._running) >= self.max_num_seqs
        adapters = {seq.adapter for seq in self._running.values() if seq.adapter is not None}
        # A copy to admit from (admission removes from the dict); none while the batch is full.
        for seq_id, seq in [] if full else list(self._waiting.items()):
            if budget == 0 or len(self._running) >= self.max_num_seqs:
                break
            if seq.adapter is not None and seq.adapter not in adapters:
                if len(adapters) >= self.max_loras:
                    continue  # rule 7
                adapters.add(seq.adapter)
            del self._waiting[seq_id]
            self._running[seq_id] = seq
            if seq.prefilled:
                self._admit(seq_id)  # its KV blocks; nothing is left to compute (rule 6)
                seq.state = SeqState.DECODING
                decode.append(seq_id)
                budget -= 1
                continue
            seq.state = SeqState.PREFILLING
            seq.to_prefill = max(self._admit(seq_id), 1)  # vLLM recomputes the last token
            chunk = min(seq.to_prefill, budget)
            prefill.append((seq_id, chunk))
            budget -= chunk
            started += 1
        return Step(tuple(prefill), tuple(decode), started)

    def complete(self, step: Step) -> list[Progress]:
        """Apply a finished step; sequences aborted meanwhile are skipped (rule 5)."""
        progress: list[Progress] = []
        for seq_id, tokens in step.prefill:
            seq = self._running.get(seq_id)
            if seq is None:
                continue
            seq.to_prefill -= tokens
            if seq.to_prefill == 0:
                seq.state = SeqState.DECODING
                progress.append(self._produce(seq_id, seq))
        for seq_id in step.decode:
            seq = self._running.get(seq_id)
            if seq is not None:
                progress.append(self._produce(seq_id, seq))
        return progress

    def _produce(self, seq_id: int, seq: _Seq) -> Progress:
        seq.produced += 1
        finished = seq.produced == seq.output_tokens
        if finished:
            del self._running[seq_id]
        return Progress(seq_id, seq.produced, finished)


def _per_adapter(seqs: Iterable[_Seq]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in seqs:
        if seq.adapter is not None:
            counts[seq.adapter] = counts.get(seq.adapter, 0) + 1
    return counts
