"""The models the proxy serves, as its backends and configuration tell them. Pure: the caller
passes the backends (and `now` where health matters).

Served names are the configured models (`[[models]]` tables: served even while all their
backends are down, which is then a 503, not a 404) and the names unconfigured backends'
`/v1/models` list (their last list, so a model whose only backend is briefly down is not
forgotten in between), at most `MAX_MODELS` in all, configured ones first. Adapters Sluice
may load on demand (`[adapters]` with `--lora-load-on-demand`) are served names too, listed
while an engine of their base takes traffic. Aliases come from the tables. A model's context
window is its table's `max_model_len`, else `--max-model-len`, else the smallest
`max_model_len` its healthy backends report for it; a LoRA adapter's is its base model's
(engines list adapters without one).

`directory()` is called once per request: it is rebuilt only when a backend's health or
model list changed since the last call, so a request pays one pass over the backends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from app.config import ModelConfig
from app.fleet.backends import Backend
from app.models import MAX_MODELS, AdapterConfig, ModelDirectory

log = logging.getLogger("sluice.models")

DEFAULT_OWNER = "sluice"


def configured_backends(models: Sequence[ModelConfig]) -> dict[str, tuple[str, ...]]:
    """Backend URL -> the models the tables name for it, in their order (a backend may
    serve several)."""
    served: dict[str, list[str]] = {}
    for model in models:
        for url in model.backends:
            served.setdefault(url.rstrip("/"), []).append(model.name)
    return {url: tuple(names) for url, names in served.items()}


class ModelCatalog:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        default_window: int | None,
        loadable: Sequence[AdapterConfig] = (),
    ) -> None:
        """`loadable`: the adapters Sluice loads on demand."""
        self.configured = {model.name: model for model in models}
        self.loadable = {adapter.name: adapter for adapter in loadable}
        self._aliases = {alias: model.name for model in models for alias in model.aliases}
        self._default_window = default_window
        self._key: tuple[Any, ...] | None = None
        self._directory = ModelDirectory()
        self._ignored: set[str] = set()  # names past MAX_MODELS, logged once each
        self.created = int(time.time())

    def directory(self, backends: Sequence[Backend]) -> ModelDirectory:
        key = tuple([(id(b), b.healthy, b.models_version) for b in backends])
        if key != self._key:
            self._key, self._directory = key, self._build(backends)
        return self._directory

    def _build(self, backends: Sequence[Backend]) -> ModelDirectory:
        served = dict.fromkeys([*self.configured, *self.loadable][:MAX_MODELS])
        for backend in backends:
            if backend.configured is not None:
                continue
            for card in backend.models:
                name = card["id"]
                if name in served:
                    continue
                if len(served) >= MAX_MODELS:
                    if name not in self._ignored:
                        self._ignored.add(name)
                        log.warning(
                            "backend %s lists model %r beyond the %d models Sluice tracks: "
                            "not served",
                            backend.url,
                            name,
                            MAX_MODELS,
                        )
                    continue
                served[name] = None
        windows = {}
        for name in served:
            window = self._window(name, backends)
            if window is not None:
                windows[name] = window
        bases = {
            name: base
            for name in served
            if (base := self.base_of(name, backends)) is not None and base != name
        }
        return ModelDirectory(frozenset(served), dict(self._aliases), windows, bases)

    def _window(self, name: str, backends: Sequence[Backend]) -> int | None:
        table = self.configured.get(name)
        if table is not None and table.max_model_len is not None:
            return table.max_model_len
        if self._default_window is not None:
            return self._default_window
        reported = [
            length
            for b in backends
            if b.healthy and name in b.served
            for length in (b.max_model_len_for(name),)
            if length is not None
        ]
        if reported:
            return min(reported)
        base = self.base_of(name, backends)
        return None if base is None or base == name else self._window(base, backends)

    def base_of(self, adapter: str, backends: Sequence[Backend]) -> str | None:
        """The base model of a LoRA adapter (its engines' cards' `parent`, else its table's
        `base`); None for a model that is no adapter, or one whose base is any engine's."""
        for backend in backends:
            parent = backend.adapters.parents.get(adapter)
            if parent is not None:
                return parent
        table = self.loadable.get(adapter)
        return table.base if table is not None else None

    def cards(
        self,
        directory: ModelDirectory,
        backends: Sequence[Backend],
        now: float,
        allowed: frozenset[str] | None,
    ) -> list[dict[str, Any]]:
        """`/v1/models`: one card for each model with a backend taking its traffic, and for
        each of its aliases, the caller may use (OpenAI's shape, plus vLLM's `max_model_len`
        and `root`: the served name an alias stands for)."""
        cards = []
        for name, target in directory.names_for(allowed):
            base = self.base_of(target, backends)
            serving = [b for b in backends if target in b.served and b.takes_traffic(now, target)]
            if not serving and target in self.loadable:
                serving = [b for b in backends if base is None or base in b.served]
                serving = [b for b in serving if b.takes_traffic(now, base)]
            if not serving:
                continue
            own = _card(serving, target)
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": own.get("created", self.created),
                    "owned_by": own.get("owned_by", DEFAULT_OWNER),
                    "root": target,
                    "parent": base,
                    "max_model_len": directory.windows.get(target),
                }
            )
        return cards


def _card(backends: Sequence[Backend], name: str) -> dict[str, Any]:
    """The first backend's own card for `name`, to take its `owned_by` and `created` from."""
    for backend in backends:
        for card in backend.models:
            if card.get("id") == name:
                return {
                    key: card[key]
                    for key in ("owned_by", "created")
                    if isinstance(card.get(key), str | int)
                }
    return {}
