"""What preprocessing reads of the configuration: start-up (app/cli/rooms.py) cuts it from
the whole `Settings`, so this room sees only its own knobs."""

from __future__ import annotations

from dataclasses import dataclass

from app.config import ModelConfig, Saturation, TokenizeMode
from app.models import AdapterConfig


@dataclass(frozen=True)
class PreprocessSettings:
    tokenizer: str | None  # the default tokenizer (--tokenizer); None: the bundled one
    chat_template: str | None
    models: tuple[ModelConfig, ...]  # the fleet's tables: each model's tokenizer and template
    adapters: tuple[AdapterConfig, ...]  # LoRA adapters: each prepared as its base model is
    max_model_len: int | None
    tokenize_mode: TokenizeMode
    tokenize_threads: int
    tokenize_queue: int
    render_workers: int
    saturation: Saturation
    l0_max_entries: int
    l0_max_text_bytes: int
    l1_max_memory: int
    api_keys: str | None  # a TOML file of keys; None: the proxy is open to anyone
    admission_timeout: float  # how long a request may be held, told to the decision
