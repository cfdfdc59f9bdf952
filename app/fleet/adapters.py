"""LoRA adapters on an engine, as Sluice knows them. Pure: the caller passes `now`.

What an engine says:
- its `/v1/models` lists each adapter it has loaded as a card whose `parent` names the base
  model (vLLM; `root` is the adapter's path): those are served names like any model, and an
  adapter uses its parent's tokenizer, chat template and context window;
- vLLM's `vllm:lora_requests_info` gauge carries, in labels, the adapters of the requests
  it runs (`running_lora_adapters`, comma-separated), of those it queues
  (`waiting_lora_adapters`) and how many adapters one batch may use (`max_lora`); its value
  is when it was written, so of several samples the newest counts (as the GIE's EPP reads
  it).

An adapter stays in its GPU slot after its requests end, until `max_lora` others push it out
(vLLM's slots are LRU), while `running_lora_adapters` forgets it as soon as its last request
ends. So `Residency` models an engine's slots: the last `max_lora` distinct adapters seen
running there, by its reports and by the requests Sluice sends it since (a report is up to
0.5 s old; without this a burst for a new adapter would spread over every engine with a free
slot before the next report). An engine that reports no `max_lora` has no modelled slots:
affinity then knows only which engines list the adapter.

The affinity tiers are the lora-affinity scorer's (gateway-api-inference-extension): the
adapter resident (1.0), a free slot (0.8), the adapter queued there (0.6), else none (0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from app.fleet.engine_metrics import samples

LORA_INFO = "vllm:lora_requests_info"
Tier = Literal["resident", "free-slot", "queued", "none"]
TIER_ORDER: dict[Tier, int] = {"resident": 3, "free-slot": 2, "queued": 1, "none": 0}


@dataclass(frozen=True)
class LoraReport:
    """One reading of `vllm:lora_requests_info`."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int | None


def _names(value: str) -> tuple[str, ...]:
    return tuple(name for name in (part.strip() for part in value.split(",")) if name)


def read_lora(text: str) -> LoraReport | None:
    """The newest `vllm:lora_requests_info` sample of a Prometheus exposition, or None."""
    newest = None
    for sample in samples(text, LORA_INFO):
        if newest is None or sample.value >= newest.value:
            newest = sample
    if newest is None:
        return None
    labels = dict(newest.labels)
    raw_max = labels.get("max_lora", "").strip()
    return LoraReport(
        running=_names(labels.get("running_lora_adapters", "")),
        waiting=_names(labels.get("waiting_lora_adapters", "")),
        max_lora=int(raw_max) if raw_max.isdigit() and int(raw_max) > 0 else None,
    )


def adapter_parents(cards: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Adapter name -> its base model, for the `/v1/models` cards that have a `parent`."""
    return {
        card["id"]: parent
        for card in cards
        if isinstance(parent := card.get("parent"), str) and parent and parent != card["id"]
    }


class AdaptersBlock(TypedDict):
    """A backend's LoRA adapters in the dashboard's snapshot."""

    listed: list[str]  # what its /v1/models lists as adapters
    resident: list[str]  # what its slots are believed to hold, least recently used first
    waiting: list[str]  # adapters its engine queues requests for
    max_lora: int | None  # adapters one batch may run, as its engine reports


@dataclass
class Residency:
    """One engine's adapters: what it lists, what its slots hold (modelled), what it queues."""

    parents: dict[str, str] = field(default_factory=dict)  # listed adapter -> base model
    max_lora: int | None = None
    waiting: frozenset[str] = frozenset()
    # Most recently used last: at most `max_lora` of them once that is known.
    _slots: dict[str, float] = field(default_factory=dict)

    def listed(self, cards: Sequence[Mapping[str, Any]]) -> None:
        """Its `/v1/models` answer: which adapters it has loaded, and their bases."""
        self.parents = adapter_parents(cards)
        for gone in [name for name in self._slots if name not in self.parents]:
            del self._slots[gone]

    def reported(self, report: LoraReport | None, now: float) -> None:
        """A reading of its `/metrics` (None: it reports no adapters)."""
        if report is None:
            self.max_lora, self.waiting = None, frozenset()
            return
        self.max_lora, self.waiting = report.max_lora, frozenset(report.waiting)
        self.used(report.running, now)

    def used(self, adapters: Iterable[str], now: float) -> None:
        """These adapters run there now (a report, or a request Sluice sends it)."""
        for name in adapters:
            self._slots.pop(name, None)
            self._slots[name] = now
        if self.max_lora is not None:
            while len(self._slots) > self.max_lora:
                del self._slots[next(iter(self._slots))]

    def forget(self, adapter: str) -> None:
        """It was unloaded."""
        self._slots.pop(adapter, None)
        self.parents.pop(adapter, None)

    @property
    def resident(self) -> tuple[str, ...]:
        """The adapters its slots are believed to hold, least recently used first."""
        return tuple(self._slots)

    def last_used(self, adapter: str) -> float | None:
        return self._slots.get(adapter)

    def snapshot(self) -> AdaptersBlock:
        return {
            "listed": sorted(self.parents),
            "resident": list(self._slots),
            "waiting": sorted(self.waiting),
            "max_lora": self.max_lora,
        }

    def tier(self, adapter: str) -> Tier:
        """How well it suits a request for `adapter` (the lora-affinity scorer's order)."""
        if adapter in self._slots:
            return "resident"
        taken = len(self.waiting.union(self._slots))
        if self.max_lora is not None and taken < self.max_lora:
            return "free-slot"
        if adapter in self.waiting:
            return "queued"
        return "none"
