"""The simulated GPU at work: the pure `scheduler`, `latency` and `kv_cache`, played out in time.

One task (`run`) is the GPU: it plans a step, sleeps for what the step costs and hands the
tokens it produced to the requests, which wait in `generate`. GPU time is `trio.sleep`, so a
busy simulated GPU costs its host loop little. A sequence cancelled anywhere (waiting,
prefilling or decoding) leaves the batch and gives back its KV blocks at once, which is how a
client disconnect frees capacity. A pooling request (embeddings, scores: `pool`) is a prefill
with no decode: the step that computes its prompt's last chunk gives its answer.

LoRA (lora.py): a request runs under the adapter its task names (`REQUEST_ADAPTER`); the
scheduler keeps at most `max_loras` adapters in the batch, its prefix-cache blocks are keyed by
the adapter, a step whose adapter was evicted from memory pays `lora_load_time` per reload, and
each step records the adapters running and waiting for `vllm:lora_requests_info`.

Disaggregation (kv_transfer.py): a sequence whose prompt's KV came from a prefill engine
arrives `prefilled` and decodes from the step that admits it, its prompt put in this
engine's prefix cache and reported cached whole; a prefill engine's sequence may `keep` its
KV when it finishes, handing its allocation to whoever holds it for a decode engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from app.sim.kv_cache import KVAllocation, LoraTag, PrefixKVCache
from app.sim.latency import LatencyModel, Step
from app.sim.lora import REQUEST_ADAPTER, LoraRegistry
from app.sim.observed import QUEUE_TIME_BUCKETS, TOKEN_GAP_BUCKETS, Observed
from app.sim.scheduler import StepScheduler
from app.sim.settings import SimSettings

EmitToken = Callable[[int], Awaitable[None]]
# Takes a finished sequence's KV blocks instead of their release (a prefill engine's hold).
KeepKv = Callable[[KVAllocation], None]


@dataclass
class _Request:
    prompt: Sequence[int]
    output_tokens: int
    arrived: float = 0.0
    admitted: float | None = None
    allocation: KVAllocation | None = None
    produced: int = 0
    changed: trio.Event = field(default_factory=trio.Event)
    # A pooling sequence: its one "output" is the pooled prompt, not a generated token.
    pooling: bool = False
    # Its prompt's KV was transferred: no prompt to compute (scheduler.py, rule 6).
    prefilled: bool = False
    lora: LoraTag | None = None


class SimEngine:
    def __init__(self, settings: SimSettings) -> None:
        self.latency = LatencyModel.from_settings(settings)
        self.kv_cache = PrefixKVCache(settings.kv_cache_blocks, settings.block_size)
        self.scheduler = StepScheduler(
            settings.max_num_seqs, settings.max_num_batched_tokens, self._admit, settings.max_loras
        )
        self.lora = (
            LoraRegistry(settings.max_loras, settings.max_cpu_loras or settings.max_loras)
            if settings.max_loras
            else None
        )
        self.lora_load_time = settings.lora_load_time
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        # What engines other than vLLM report (app/sim/metrics.py): GPU time and steps by
        # phase, sequences in the batch summed over steps, and the prefix-cache hit rate of
        # the last step that admitted prompts (SGLang's `cache_hit_rate` is that of the last
        # prefill batch).
        self.prefill_seconds_total = 0.0
        self.decode_seconds_total = 0.0
        self.prefill_steps = 0
        self.decode_steps = 0
        self.batched_seqs_total = 0
        self.last_prefill_hit_rate = 0.0
        # vLLM's histograms: a finished request's time in the queue, and the gap between two
        # tokens of a sequence (one step).
        self.queue_times = Observed(QUEUE_TIME_BUCKETS)
        self.token_gaps = Observed(TOKEN_GAP_BUCKETS)
        # Requests whose prompt's KV is on its way from a prefill engine (disaggregation.py):
        # not yet in the scheduler, but waiting, as vLLM counts them (WAITING_FOR_REMOTE_KVS).
        self.receiving_kv = 0
        self._admitted_prompt_tokens = 0
        self._admitted_cached_tokens = 0
        self._seq_ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._work = trio.Event()
        self._changed = trio.Event()
        self._started = False

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting + self.receiving_kv

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The GPU: one step after another while there is work, idle otherwise."""
        self._started = True
        task_status.started()
        while True:
            if not self.scheduler.has_work:
                self._work = trio.Event()
                await self._work.wait()
                continue
            step = self.scheduler.plan()
            self._notify()  # admissions change running/waiting
            self._account(step)
            step_seconds = self.latency.step_seconds(step)
            await trio.sleep(step_seconds + self._lora_step(step))
            self.steps += 1
            if step.decode:
                self.token_gaps.observe(step_seconds, len(step.decode))
            for progress in self.scheduler.complete(step):
                request = self._requests[progress.seq_id]
                if not request.pooling:
                    self.generation_tokens_total += progress.produced - request.produced
                request.produced = progress.produced
                request.changed.set()
            self._record_lora()
            self._notify()

    def _lora_step(self, step: Step) -> float:
        """Seconds the step spends loading again adapters evicted from memory."""
        if self.lora is None:
            return 0.0
        seq_ids = [seq_id for seq_id, _ in step.prefill] + list(step.decode)
        names = {lora.name for i in seq_ids if (lora := self._requests[i].lora) is not None}
        return self.lora.activate(names) * self.lora_load_time

    def _record_lora(self) -> None:
        if self.lora is not None:
            running, waiting = self.scheduler.adapters()
            self.lora.record_step(list(running), list(waiting), time.time())

    async def generate(
        self,
        prompt: Sequence[int],
        output_tokens: int,
        emit: EmitToken,
        *,
        prefilled: bool = False,
        keep: KeepKv | None = None,
    ) -> int:
        """Queue, prefill (unless `prefilled`), then call `emit(i)` as output token i is
        produced; a finished sequence's KV goes to `keep` if given, else is released.

        Returns how many prompt tokens the prefix cache served (all of them when prefilled).
        """
        return await self._run(_Request(prompt, output_tokens, prefilled=prefilled), emit, keep)

    async def pool(self, prompt: Sequence[int]) -> int:
        """Queue and prefill a pooling request (an embedding, a score): no token is decoded
        or counted as generated. Returns how many prompt tokens the prefix cache served."""

        async def pooled(_index: int) -> None:
            pass

        return await self._run(_Request(prompt, 1, pooling=True), pooled)

    async def _run(self, request: _Request, emit: EmitToken, keep: KeepKv | None = None) -> int:
        if not self._started:
            raise RuntimeError("SimEngine.run must be running before generate is called")
        seq_id = next(self._seq_ids)
        request.arrived = trio.current_time()
        request.lora = REQUEST_ADAPTER.get()
        adapter = None if request.lora is None else request.lora.name
        if self.lora is not None and adapter is not None:
            self.lora.counted_request(adapter)
        self._requests[seq_id] = request
        output_tokens = request.output_tokens
        kept = False
        try:
            if request.prefilled:
                self.scheduler.arrive_prefilled(seq_id, output_tokens, adapter)
            else:
                self.scheduler.arrive(seq_id, output_tokens, adapter)
            self._record_lora()
            self._work.set()
            self._notify()
            emitted = 0
            while emitted < output_tokens:
                while request.produced == emitted:
                    request.changed = trio.Event()
                    await request.changed.wait()
                while emitted < request.produced:
                    await emit(emitted)
                    emitted += 1
            assert request.allocation is not None
            if request.admitted is not None:
                self.queue_times.observe(request.admitted - request.arrived)
            if keep is not None:
                keep(request.allocation)
                kept = True
            return len(request.prompt) if request.prefilled else request.allocation.cached_tokens
        finally:
            self.scheduler.abort(seq_id)
            del self._requests[seq_id]
            if request.allocation is not None and not kept:
                self.kv_cache.release(request.allocation)
            self._notify()

    def _admit(self, seq_id: int) -> int:
        """The scheduler admits a sequence: hold its KV blocks; how much is left to compute."""
        request = self._requests[seq_id]
        request.admitted = trio.current_time()
        # A pooling sequence holds no slot for output: its one step ends with the prefill.
        output_slots = 0 if request.pooling else request.output_tokens
        request.allocation = self.kv_cache.allocate(request.prompt, output_slots, request.lora)
        self.prompt_tokens_total += len(request.prompt)
        self._admitted_prompt_tokens += len(request.prompt)
        self._admitted_cached_tokens += request.allocation.cached_tokens
        return request.allocation.uncached_tokens

    def _account(self, step: Step) -> None:
        self.prefill_seconds_total += self.latency.prefill_step_seconds(step)
        self.decode_seconds_total += self.latency.decode_step_seconds(len(step.decode))
        self.prefill_steps += bool(step.prefill)
        self.decode_steps += bool(step.decode)
        self.batched_seqs_total += len(step.prefill) + len(step.decode)
        if self._admitted_prompt_tokens:
            self.last_prefill_hit_rate = self._admitted_cached_tokens / self._admitted_prompt_tokens
            self._admitted_prompt_tokens = self._admitted_cached_tokens = 0

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Block until `condition()` holds; it is re-checked whenever a sequence moves."""
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
