"""Each model's way to prepare prompts: its tokenizer, chat template, render cost and token
caches, built once at startup.

The flags (`--tokenizer`, `--chat-template`) make the default, which every model without a
table of its own uses (those discovered from backends' `/v1/models` included). A
`[[models]]` table may name its own tokenizer and template; without a template of its own, a
model with its own tokenizer gets the one discovered next to that tokenizer, else
`--chat-template`'s. A tokenizer loads once however many models name it (loading is cached
per path, tokenizer_loading.py), and models that share a tokenizer share its
`Tokenization`: the same text has the same ids for both. Every tokenizer's caches sit in
one `TokenCaches`, bounded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from app.config import ModelConfig
from app.errors import ConfigError
from app.models import ModelDirectory
from app.preprocess.chat_template import (
    ChatTemplate,
    TemplateLoadError,
    calibrate_render_cost,
    load_chat_template,
)
from app.preprocess.dispatcher import Dispatcher, Phase
from app.preprocess.encoding import TokenizerFacts, facts_for
from app.preprocess.metrics import PreprocessMetrics
from app.preprocess.rendering import RenderPlan, RenderSpec
from app.preprocess.settings import PreprocessSettings
from app.preprocess.tokenization import TokenCaches, Tokenization
from app.preprocess.tokenizer_loading import LoadedTokenizer, TokenizerLoadError, load_tokenizer


class ModelDescription(TypedDict):
    tokenizer: str  # where it was loaded from
    chat_template: str | None  # where its template came from


@dataclass(frozen=True, eq=False)
class ModelPrep:
    loaded: LoadedTokenizer
    facts: TokenizerFacts
    template: ChatTemplate | None
    spec: RenderSpec
    tokens: Tokenization

    def describe(self) -> ModelDescription:
        return {
            "tokenizer": self.loaded.source,
            "chat_template": self.template.origin if self.template else None,
        }


class ModelPreps:
    def __init__(
        self,
        settings: PreprocessSettings,
        metrics: PreprocessMetrics,
        default_tokenizer: LoadedTokenizer,
        threads: Dispatcher,
        phase: Phase,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._threads = threads
        self._phase = phase
        self.caches = TokenCaches(settings)
        self._tokenizations: dict[int, Tokenization] = {}
        self._preps: dict[tuple[int, str | None], ModelPrep] = {}
        self.default = self._prep(default_tokenizer, settings.chat_template)
        self.by_model: dict[str, ModelPrep] = {
            model.name: self._configured(model, default_tokenizer) for model in settings.models
        }
        for adapter in settings.adapters:  # a LoRA adapter renders and tokenizes as its base
            base = self.by_model.get(adapter.base or "")
            if base is not None:
                self.by_model.setdefault(adapter.name, base)
        self._specs = {name: prep.spec for name, prep in self.by_model.items()}

    def _configured(self, model: ModelConfig, default_tokenizer: LoadedTokenizer) -> ModelPrep:
        try:
            if model.tokenizer is None:
                loaded = default_tokenizer
                template = model.chat_template or self._settings.chat_template
            else:
                loaded = load_tokenizer(model.tokenizer)
                template = model.chat_template
            return self._prep(loaded, template)
        except (TokenizerLoadError, TemplateLoadError) as exc:
            raise type(exc)(f"model {model.name!r}: {exc}") from exc

    def _prep(self, loaded: LoadedTokenizer, template_spec: str | None) -> ModelPrep:
        key = (id(loaded), template_spec)
        prep = self._preps.get(key)
        if prep is not None:
            return prep
        facts = facts_for(loaded)
        template = load_chat_template(template_spec, loaded, facts.added_tokens)
        cost = calibrate_render_cost(template) if template else None
        spec = RenderSpec(template, loaded.source, facts.vocab_size, cost, facts.max_token_bytes)
        prep = self._preps[key] = ModelPrep(
            loaded, facts, template, spec, self._tokenization(loaded, facts)
        )
        return prep

    def _tokenization(self, loaded: LoadedTokenizer, facts: TokenizerFacts) -> Tokenization:
        tokens = self._tokenizations.get(id(loaded))
        if tokens is None:
            tokens = self._tokenizations[id(loaded)] = Tokenization(
                self._settings,
                self._metrics,
                loaded.tokenizer,
                facts,
                self._threads,
                self._phase,
                self.caches,
            )
        return tokens

    @property
    def tokenizers(self) -> int:
        """Distinct tokenizers in use."""
        return len(self._tokenizations)

    def specs(self) -> list[RenderSpec]:
        """Every distinct spec, to warm the render workers up with."""
        return list(dict.fromkeys(prep.spec for prep in self._preps.values()))

    def for_model(self, model: str | None, models: ModelDirectory | None = None) -> ModelPrep:
        """`model`'s prep; an adapter's is its base's (`models` knows which), else the
        default's."""
        if model is None:
            return self.default
        prep = self.by_model.get(model)
        if prep is None and models is not None:
            prep = self.by_model.get(models.prepared_as(model))
        return prep or self.default

    def plan(self, models: ModelDirectory | None, allowed: frozenset[str] | None) -> RenderPlan:
        return RenderPlan(
            self.default.spec, self._specs, models, allowed, self._settings.max_model_len
        )

    def describe(self) -> dict[str, ModelDescription]:
        """Tokenizer and template of each configured model (others use the default's)."""
        return {name: prep.describe() for name, prep in self.by_model.items()}


def check_one_tokenizer(preps: ModelPreps) -> None:
    """`--forward tokens` compares every backend with one tokenizer, so a fleet whose models
    use several cannot use it."""
    if preps.tokenizers > 1:
        raise ConfigError(
            "--forward tokens needs every model to use the same tokenizer; these models "
            f"use {preps.tokenizers} different ones"
        )
