"""The LoRA adapters one simulated engine knows, as vLLM's serving layer and worker keep them. Pure.

Design rules (vLLM's, `vllm/entrypoints/openai/models/serving.py` and the worker's LRU cache):
1. An adapter is registered by name with a path and a `lora_int_id` from one counter; a name
   is registered once (a second load is refused unless `load_inplace`, which keeps the id).
   Registered names are what `/v1/models` lists (`parent` the base model, `root` the path) and
   what a request's `model` may name; an unregistered name is an unknown model.
2. At most `max_cpu_loras` adapters' weights are resident (vLLM's `--max-cpu-loras`, default
   `--max-loras`): loading one more evicts the least recently used, still registered, whose
   next step pays the load again (`activate`). Registration itself is not bounded, as in vLLM.
3. `vllm:lora_requests_info` is a gauge whose labels change: every step sets the series of
   the current labels to the wall-clock time and the older series stay, as prometheus_client
   keeps every label set it was given; a reader takes the series with the largest value.
   The sim keeps the latest `INFO_SERIES_KEPT` label sets so that a long run's scrape stays
   small (vLLM keeps all).

Which adapter a request runs under travels with the request's task (`REQUEST_ADAPTER`): every
endpoint names its model through `Inference.model`, and the engine reads it when the request
arrives, so no endpoint needs to carry it.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from app.errors import require_at_least
from app.sim.kv_cache import LoraTag

# The adapter the request served by the current task runs under (None: the base model).
REQUEST_ADAPTER: ContextVar[LoraTag | None] = ContextVar("sim_request_adapter", default=None)
INFO_SERIES_KEPT = 64


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    lora_int_id: int

    @property
    def tag(self) -> LoraTag:
        return LoraTag(self.name, self.lora_int_id)


class LoraRegistry:
    """The adapters registered by name (rule 1), those resident (rule 2), and the series of
    `vllm:lora_requests_info` (rule 3)."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        require_at_least(1, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
        self.adapters: dict[str, Adapter] = {}
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.loads_total = 0  # loads asked for: the endpoints and `--lora-modules`
        self.reloads_total = 0  # evicted adapters loaded again by a step (rule 2)
        self.requests_by_adapter: dict[str, int] = {}
        # (running, waiting) label values -> when a step last set that series.
        self._info: OrderedDict[tuple[str, str], float] = OrderedDict()

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def register(self, name: str, path: str, *, inplace: bool = False) -> Adapter:
        """Record a load that just finished (rule 1); its weights are now resident."""
        known = self.adapters.get(name)
        if known is not None and not inplace:
            raise ValueError(f"adapter {name} is already registered")
        if known is None:
            self._next_id += 1
        lora_int_id = known.lora_int_id if known is not None else self._next_id
        adapter = Adapter(name, path, lora_int_id)
        self.adapters[name] = adapter
        self._make_resident(name)
        self.loads_total += 1
        return adapter

    def unregister(self, name: str) -> Adapter:
        adapter = self.adapters.pop(name)
        self._resident.pop(name, None)
        return adapter

    def counted_request(self, name: str) -> None:
        self.requests_by_adapter[name] = self.requests_by_adapter.get(name, 0) + 1

    def activate(self, names: set[str]) -> int:
        """A step runs these adapters: how many had to be loaded again first (rule 2)."""
        reloads = 0
        for name in sorted(names):
            if name not in self._resident:
                reloads += 1
            self._make_resident(name)
        self.reloads_total += reloads
        return reloads

    def _make_resident(self, name: str) -> None:
        self._resident[name] = None
        self._resident.move_to_end(name)
        while len(self._resident) > self.max_cpu_loras:
            self._resident.popitem(last=False)

    def state(self) -> dict[str, Any]:
        """What `/sim/state` shows."""
        return {
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_cpu_loras,
            "adapters": {name: adapter.path for name, adapter in self.adapters.items()},
            "resident": list(self._resident),
            "loads": self.loads_total,
            "reloads": self.reloads_total,
            "requests_by_adapter": dict(self.requests_by_adapter),
        }

    def record_step(self, running: list[str], waiting: list[str], now: float) -> None:
        """A step's adapters with requests running and waiting, set to `now` (rule 3)."""
        key = (",".join(running), ",".join(waiting))
        self._info[key] = now
        self._info.move_to_end(key)
        while len(self._info) > INFO_SERIES_KEPT:
            self._info.popitem(last=False)

    def info_series(self) -> list[tuple[str, str, float]]:
        """(running_lora_adapters, waiting_lora_adapters, timestamp) for each series kept."""
        return [(running, waiting, when) for (running, waiting), when in self._info.items()]
