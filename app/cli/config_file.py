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

    [adapters]                          # LoRA adapters, loaded with --lora-load-on-demand
    sql-lora = "/adapters/sql"          # name = where the engine finds its weights
    chat-lora = { path = "/adapters/chat", base = "deepseek-v4" }  # only on that base

    [[models]]                          # disaggregated: prefill and decode engines
    name = "deepseek-v4-pd"
    backends = [
        { url = "http://p-1:8000", role = "prefill", bootstrap_port = 8998 },
        { url = "http://d-1:8000", role = "decode" },
    ]

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

from app.config import BackendRole, ModelConfig
from app.errors import ConfigError
from app.models import AdapterConfig

PATH_KEYS = ("tokenizer", "chat_template", "api_keys")
MODEL_KEYS = frozenset(f.name for f in fields(ModelConfig))
BACKEND_TABLE_KEYS = frozenset({"url", "role", "bootstrap_port"})


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
    if "adapters" in values:
        values["adapters"] = read_adapters(values["adapters"])
    return values


def read_adapters(table: Any) -> tuple[AdapterConfig, ...]:
    """`[adapters]`: `name = "path"`, or `name = { path = "...", base = "model" }`. A path
    is the engine's, not this file's: it is passed on as written."""
    if not isinstance(table, dict):
        raise ConfigError("--config: adapters must be a table, written [adapters]")
    adapters = []
    for name, value in table.items():
        where = f"--config adapters.{name}"
        entry = {"path": value} if isinstance(value, str) else value
        if not isinstance(entry, dict) or set(entry) - {"path", "base"}:
            raise ConfigError(f"{where}: expected a path, or a table with path and base")
        path, base = entry.get("path"), entry.get("base")
        if not isinstance(path, str) or not (base is None or isinstance(base, str)):
            raise ConfigError(f"{where}: path and base must be strings")
        try:
            adapters.append(AdapterConfig(name, path, base))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return tuple(adapters)


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
    if "roles" in values:
        raise ConfigError(f"{where}: unknown key(s) roles: give a backend's role in its table")
    backends, values["roles"] = _backends(where, values.get("backends", []))
    values["backends"] = backends
    if "aliases" in values:
        values["aliases"] = _strings(where, "aliases", values["aliases"])
    if "max_model_len" in values:
        length = values["max_model_len"]
        if not isinstance(length, int) or isinstance(length, bool):
            raise ConfigError(f"{where}: max_model_len must be an integer, not {length!r}")
    try:
        return ModelConfig(**values)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _backends(where: str, value: Any) -> tuple[tuple[str, ...], tuple[BackendRole, ...]]:
    """A model's `backends`: URLs, or tables `{url = ..., role = "prefill", bootstrap_port =
    8998}` for engines of disaggregated serving; the URLs, and the roles other than both."""
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: backends must be a list, not {value!r}")
    urls: list[str] = []
    roles: list[BackendRole] = []
    for entry in entries:
        if isinstance(entry, str):
            urls.append(entry.rstrip("/"))
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{where}: backends must be URLs or tables with a url, not {entry!r}")
        unknown = sorted(set(entry) - BACKEND_TABLE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown backend key(s) {', '.join(unknown)}")
        url = entry["url"].rstrip("/")
        urls.append(url)
        role, port = entry.get("role", "both"), entry.get("bootstrap_port")
        if not isinstance(role, str) or not (port is None or type(port) is int):
            raise ConfigError(
                f"{where}: backend {url}: role is a string, bootstrap_port an integer"
            )
        try:
            if role != "both" or port is not None:
                roles.append(BackendRole(url, role, port))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return tuple(urls), tuple(roles)


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
