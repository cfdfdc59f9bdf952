"""Reading `--config file.toml`: top-level keys are the flags, `[[models]]` tables the fleet.

    policy = "cache_aware"              # any flag, dashes or underscores
    backends = ["http://gpu-9:8000"]    # serve whatever their /v1/models lists

    [[models]]
    name = "deepseek-v4"                # the name its backends serve it under
    backends = ["http://gpu-1:8000", "http://gpu-2:8000"]
    tokenizer = "tokenizers/deepseek"   # else --tokenizer's
    chat_template = "deepseek_v3"       # else --chat-template's, or discovered
    max_model_len = 65536               # else --max-model-len, or the backends' own
    aliases = ["chat-default"]          # other names clients may send for it

A relative path in the file (`tokenizer`, `chat_template`, `api_keys`) is taken from the
file's own directory when something is there, so a fleet file travels with its tokenizers.
Every value is checked as a flag's would be; a wrong one is a `ConfigError` naming the table
and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from app.config import ModelConfig
from app.errors import ConfigError

PATH_KEYS = ("tokenizer", "chat_template", "api_keys")
MODEL_KEYS = frozenset(f.name for f in fields(ModelConfig))


def read_config(path: str | None) -> dict[str, Any]:
    """The file's top-level keys (dashes as underscores), `models` as `ModelConfig`s."""
    if path is None:
        return {}
    try:
        with Path(path).open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read --config: {exc}") from None
    base = Path(path).resolve().parent
    values = {key.replace("-", "_"): value for key, value in data.items()}
    for key in PATH_KEYS:
        if isinstance(values.get(key), str):
            values[key] = _near(base, values[key])
    if "models" in values:
        values["models"] = read_models(values["models"], base)
    return values


def read_models(tables: Any, base: Path) -> tuple[ModelConfig, ...]:
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError("--config: models must be tables, written [[models]]")
    return tuple(_model(index, table, base) for index, table in enumerate(tables))


def _model(index: int, table: dict[str, Any], base: Path) -> ModelConfig:
    values = {key.replace("-", "_"): value for key, value in table.items()}
    name = values.get("name")
    where = f"--config models[{index}]" + (f" ({name!r})" if isinstance(name, str) else "")
    unknown = sorted(set(values) - MODEL_KEYS)
    if unknown:
        known = ", ".join(sorted(MODEL_KEYS))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {known})")
    if not isinstance(name, str):
        raise ConfigError(f"{where}: name must be a string")
    for key in ("tokenizer", "chat_template"):
        if key in values:
            values[key] = _near(base, _string(where, key, values[key]))
    for key in ("backends", "aliases"):
        if key in values:
            values[key] = _strings(where, key, values[key])
    if "max_model_len" in values:
        length = values["max_model_len"]
        if not isinstance(length, int) or isinstance(length, bool):
            raise ConfigError(f"{where}: max_model_len must be an integer, not {length!r}")
    values["backends"] = tuple(url.rstrip("/") for url in values.get("backends", ()))
    try:
        return ModelConfig(**values)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _string(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key} must be a string, not {value!r}")
    return value


def _strings(where: str, key: str, value: Any) -> tuple[str, ...]:
    """A list of strings; a single string is a list of one."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where}: {key} must be a list of strings, not {value!r}")
    return tuple(value)


def _near(base: Path, value: str) -> str:
    """`value` as a path next to the config file, when something is there."""
    if not value.strip():
        return value  # refused by the checks, as written
    candidate = base / Path(value).expanduser()
    return str(candidate) if not Path(value).is_absolute() and candidate.exists() else value
