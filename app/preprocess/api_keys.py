"""`--api-keys FILE`: who may call the proxy, which models, how many tokens a minute.

    [[keys]]
    key = "sk-team-a-7f3c..."           # what the client sends as `Authorization: Bearer`
    models = ["deepseek-v4", "chat-default"]   # served names or aliases; absent: every model
    tokens_per_minute = 100000          # per model, as OpenAI's limits; absent: the flag's
    weight = 2                          # its share when engines are saturated; absent: 1
    priority = 0                        # its band when held: lower leaves first; absent: 0

A request without a listed key gets 401 `invalid_api_key`; a model its key may not use is
404, worded as for a model that does not exist. Keys are never kept, logged or shown: the
table holds their SHA-256 digests, a presented key is hashed and looked up (so no key is
compared byte by byte with a secret), and everything downstream sees its fingerprint label,
the same `key-<12 hex>` the metrics use without a file (accounting.py). Without the file
the proxy is open, as before.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import ClientError, ConfigError
from app.models import ModelDirectory
from app.preprocess.accounting import bearer_token, fingerprint

ENTRY_KEYS = frozenset({"key", "models", "tokens_per_minute", "weight", "priority"})


@dataclass(frozen=True)
class KeyGrant:
    label: str  # the key's fingerprint: metrics, budgets, the dashboard
    models: frozenset[str] | None  # names or aliases it may call; None: every model
    tokens_per_minute: int | None  # None: --tokens-per-minute
    weight: float = 1.0  # its share of what leaves the queue while engines are saturated
    priority: int = 0  # its requests' band when held (lower first); a body may only lower it

    def allowed(self, directory: ModelDirectory) -> frozenset[str] | None:
        """The served names this key may call now (an alias grants the model behind it)."""
        if self.models is None:
            return None
        return frozenset(directory.aliases.get(name, name) for name in self.models)


class KeyTable:
    def __init__(self, grants: Mapping[bytes, KeyGrant]) -> None:
        self._grants = dict(grants)  # SHA-256 of the key -> what it may do

    def __len__(self) -> int:
        return len(self._grants)

    def find(self, authorization: bytes | None) -> KeyGrant | None:
        """The grant of a `Bearer` key in the table, or None."""
        token = bearer_token(authorization)
        if token is None:
            return None
        return self._grants.get(hashlib.sha256(token).digest())


def invalid_api_key() -> ClientError:
    """401 in OpenAI's words, without echoing what was sent."""
    return ClientError(
        "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key this "
        "proxy knows.",
        None,
        "invalid_api_key",
        status=401,
    )


def load_api_keys(path: str) -> KeyTable:
    """The table of `path`, or a `ConfigError` that never quotes a key."""
    try:
        with Path(path).open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read --api-keys: {exc}") from None
    return parse_api_keys(data)


def parse_api_keys(data: Mapping[str, Any]) -> KeyTable:
    unknown = sorted(set(data) - {"keys"})
    if unknown:
        raise ConfigError(f"--api-keys: unknown key(s) {', '.join(unknown)}; write [[keys]] tables")
    entries = data.get("keys")
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, dict) for e in entries)
    ):
        raise ConfigError(
            "--api-keys: no [[keys]] tables (a file that lets nobody in is a mistake)"
        )
    grants: dict[bytes, KeyGrant] = {}
    first_at: dict[bytes, int] = {}
    for index, entry in enumerate(entries):
        digest, grant = _entry(f"--api-keys keys[{index}]", entry)
        if digest in grants:
            raise ConfigError(
                f"--api-keys keys[{index}] repeats the key of keys[{first_at[digest]}]"
            )
        grants[digest], first_at[digest] = grant, index
    return KeyTable(grants)


def _entry(where: str, entry: Mapping[str, Any]) -> tuple[bytes, KeyGrant]:
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        known = ", ".join(sorted(ENTRY_KEYS))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {known})")
    key = entry.get("key")
    if not isinstance(key, str) or not key or key != key.strip() or " " in key:
        raise ConfigError(f"{where}: key must be a non-empty string without spaces")
    models = entry.get("models")
    if models is not None:
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(f"{where}: models must be a list of model names")
        if not models:
            raise ConfigError(f"{where}: models is empty; leave it out to allow every model")
    limit = entry.get("tokens_per_minute")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ConfigError(f"{where}: tokens_per_minute must be an integer, 0 or more")
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < 1e6:
        raise ConfigError(f"{where}: weight must be a positive number")
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}: priority must be an integer (lower goes first)")
    token = key.encode()
    grant = KeyGrant(
        fingerprint(token),
        None if models is None else frozenset(models),
        limit or None,
        float(weight),
        priority,
    )
    return hashlib.sha256(token).digest(), grant
