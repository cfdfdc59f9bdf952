"""Which served model a request names, and the LoRA adapters a fleet file names
(`AdapterConfig`). Pure, picklable, no Trio: render worker processes resolve the model of a
body they parse, with the same function the event loop uses.

A `ModelDirectory` is what the proxy knows at one moment: the names its backends serve
(configured tables, and what unconfigured backends' `/v1/models` list), the aliases clients
may use instead (`chat-default` -> a served name) and each model's context window where it
is known. `resolve` turns a request's `model` field into a served name:

- a served name is itself; an alias is the name it stands for;
- no `model` at all: the one model served, when there is exactly one;
- anything else, or a model the caller's API key may not use, is 404 `model_not_found`,
  worded the same either way, so that a key cannot learn which models exist beyond its own;
- while no model is known at all (no backend healthy yet, none listing its models), every
  request is 503 `no_healthy_backend`: nothing can be said to exist or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from app.errors import ClientError, Refused

# Served names one proxy tracks at once (configured and discovered together); names beyond
# are ignored, so that a backend listing thousands of adapters cannot grow every per-model
# structure, nor the metrics' label sets, without end.
MAX_MODELS = 64
# The `model` label of what was refused, or prepared, before a served model was known.
NO_MODEL = "(none)"
# Seconds a client is told to wait while no backend has said which models it serves.
NO_MODEL_RETRY_S = 2.0


@dataclass(frozen=True)
class ModelDirectory:
    served: frozenset[str] = frozenset()
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> served name
    windows: Mapping[str, int] = field(default_factory=dict)  # served name -> context window
    # A LoRA adapter -> its base model, whose tokenizer and template it is prepared with.
    bases: Mapping[str, str] = field(default_factory=dict)

    def prepared_as(self, model: str) -> str:
        """The model whose tokenizer and template `model`'s requests use: an adapter's base."""
        return self.bases.get(model, model)

    @property
    def only(self) -> str | None:
        """The one model served, when there is exactly one."""
        return next(iter(self.served)) if len(self.served) == 1 else None

    def needs_body(self) -> bool:
        """False when any request, whatever it names, may go on unread: one model, no alias
        to rewrite (a request that bails out of parsing is forwarded as the client sent it)."""
        return len(self.served) != 1 or bool(self.aliases)

    def resolve(self, requested: str | None, allowed: frozenset[str] | None = None) -> str:
        """The served name `requested` stands for; a `ClientError` (400, 404), or `Refused`
        (503) while no backend has said which models it serves."""
        if not self.served:
            raise no_model_known()
        if requested is None:
            only = self.only
            if only is None or (allowed is not None and only not in allowed):
                raise missing_model()
            return only
        name = self.aliases.get(requested, requested)
        if name not in self.served or (allowed is not None and name not in allowed):
            raise model_not_found(requested)
        return name

    def names_for(self, allowed: frozenset[str] | None = None) -> list[tuple[str, str]]:
        """(client-facing name, served name) for every name a client may send, served names
        first, each once; only those `allowed` when given."""
        visible = sorted(n for n in self.served if allowed is None or n in allowed)
        shown = set(visible)
        pairs = [(name, name) for name in visible]
        pairs += [
            (alias, target)
            for alias, target in sorted(self.aliases.items())
            if target in shown and alias not in shown
        ]
        return pairs


def resolve_model(
    directory: ModelDirectory | None, requested: str | None, allowed: frozenset[str] | None
) -> str | None:
    """The served model a request names; without a directory (a Preprocessor used alone)
    nothing is resolved (None), but a model must still be named."""
    if directory is not None:
        return directory.resolve(requested, allowed)
    if requested is None:
        raise missing_model()
    return None


def no_model_known() -> Refused:
    return Refused(
        503,
        "service_unavailable",
        "no_healthy_backend",
        "No backend has said which models it serves: none is healthy yet, or none lists its "
        "models at GET /v1/models (name those in a [[models]] table); try again shortly.",
        NO_MODEL_RETRY_S,
    )


def missing_model() -> ClientError:
    return ClientError("you must provide a model parameter", "model", "missing_required_parameter")


def model_not_found(requested: str) -> ClientError:
    """OpenAI's words for a model that does not exist or that the key may not use."""
    shown = requested if len(requested) <= 96 else requested[:95] + "…"
    return ClientError(
        f"The model `{shown}` does not exist or you do not have access to it.",
        "model",
        "model_not_found",
        status=404,
    )


@dataclass(frozen=True)
class AdapterConfig:
    """A LoRA adapter Sluice may load on demand (the fleet file's `[adapters]` table): the
    name clients send, where its engine finds its weights, and the base model it applies to
    (None: any engine's)."""

    name: str
    path: str
    base: str | None = None

    def __post_init__(self) -> None:
        if not self.name.strip() or not self.path.strip():
            raise ValueError("an adapter needs a name and a path")
        if self.base is not None and not self.base.strip():
            raise ValueError(f"adapter {self.name!r}: base must not be empty")
