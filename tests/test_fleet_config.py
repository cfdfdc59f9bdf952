"""The fleet's configuration: `--config` with `[[models]]` tables (every value checked as a flag
is, relative paths taken next to the file), `--api-keys` files (checked without ever quoting a
key), `sluice serve` refusing a bad one with a message and exit status 2 and no traceback,
and the preprocessor built from it: one tokenizer load per distinct tokenizer, each model its
own template, window and token caches, bounded together; a body whose model decides its
template is read even under `bail-out`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from app.cli.command import parse
from app.cli.config_file import read_config
from app.cli.rooms import RoomMetrics, preprocess_settings
from app.config import ModelConfig, Settings
from app.errors import ConfigError
from app.models import ModelDirectory
from app.preprocess.api_keys import load_api_keys, parse_api_keys
from app.preprocess.dispatcher import Dispatcher
from app.preprocess.l1_cache import L1Cache, L1Store
from app.preprocess.pipeline import Preprocessor
from tests.fakes import write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FLEET = """
port = 9100
backends = ["http://gpu-9:8000"]

[[models]]
name = "deepseek-v4"
backends = ["http://gpu-1:8000", "http://gpu-2:8000/"]
aliases = ["chat-default"]
max-model-len = 65536

[[models]]
name = "small"
backends = "http://gpu-3:8000"
tokenizer = "words"
chat_template = "chatml"
"""


def write(tmp_path: Path, text: str, name: str = "fleet.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_fleet_file_becomes_settings_with_its_models(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path / "words")
    _, settings = parse(["serve", "--config", str(write(tmp_path, FLEET))])
    assert isinstance(settings, Settings)
    big, small = settings.models
    assert big == ModelConfig(
        "deepseek-v4",
        ("http://gpu-1:8000", "http://gpu-2:8000"),
        max_model_len=65536,
        aliases=("chat-default",),
    )
    # A relative path is the file's neighbour; a single URL a list of one.
    assert small.tokenizer == str(tmp_path / "words")
    assert small.backends == ("http://gpu-3:8000",)
    assert settings.all_backends == (
        "http://gpu-9:8000",
        "http://gpu-1:8000",
        "http://gpu-2:8000",
        "http://gpu-3:8000",
    )
    assert settings.port == 9100
    # Tables alone are enough backends for `serve`.
    _, alone = parse(["serve", "--config", str(write(tmp_path, FLEET.split("\n", 3)[3]))])
    assert isinstance(alone, Settings) and len(alone.all_backends) == 3


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ('backends = ["http://a:1"]', "name must be a string"),
        ('name = 3\nbackends = ["http://a:1"]', "name must be a string"),
        ('name = " "', "name must not be empty"),
        ('name = "m"\nbackend = ["http://a:1"]', "unknown key(s) backend"),
        ('name = "m"\nbackends = ["https://a:1"]', "only http://"),
        ('name = "m"\nbackends = [1]', "backends must be URLs or tables with a url"),
        ('name = "m"\nbackends = ["http://a:1", "http://a:1"]', "lists a URL twice"),
        ('name = "m"\nmax_model_len = 0', "max_model_len must be at least 1"),
        ('name = "m"\nmax_model_len = "big"', "max_model_len must be an integer"),
        ('name = "m"\nmax_model_len = true', "max_model_len must be an integer"),
        ('name = "m"\naliases = ["m"]', "aliases must differ"),
        ('name = "m"\naliases = [""]', "an alias must not be empty"),
        ('name = "m"\ntokenizer = 5', "tokenizer must be a string"),
        ('name = "m"\nchat_template = ""', "chat_template must not be empty"),
    ],
)
def test_every_value_of_a_model_table_is_checked(tmp_path: Path, table: str, words: str) -> None:
    config = write(tmp_path, f'backends = ["http://x:1"]\n[[models]]\n{table}\n')
    with pytest.raises(SystemExit, match="models\\[0\\]") as info:
        parse(["serve", "--config", str(config)])
    assert words in str(info.value) and info.value.code == 2


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('models = 3\nbackends = ["http://x:1"]', "must be tables"),
        (
            'backends = ["http://x:1"]\n[[models]]\nname = "a"\naliases = ["b"]\n'
            '[[models]]\nname = "b"',
            "the name 'b' is used by model 'a' already",
        ),
        ('backends = ["http://x:1"]\n[[models]]\nname = "a"\n[[models]]\nname = "a"', "twice"),
        ('[[models]]\nname = "a"\nbackends = []', "at least one --backend"),
    ],
)
def test_names_are_one_namespace_and_a_fleet_needs_backends(
    tmp_path: Path, text: str, words: str
) -> None:
    with pytest.raises(SystemExit, match=words):
        parse(["serve", "--config", str(write(tmp_path, text))])


def test_the_demo_refuses_tables_it_would_ignore(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="makes its own models"):
        parse(["demo", "--config", str(write(tmp_path, FLEET))])


def test_a_bad_fleet_file_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    config = write(
        tmp_path, '[[models]]\nname = "m"\nbackends = ["http://a:1"]\nmax_model_len = -1\n'
    )
    cases = {
        str(config): "sluice: --config models[0] ('m'): max_model_len must be at least 1\n",
        str(tmp_path / "missing.toml"): "sluice: cannot read --config: [Errno 2]",
    }
    for path, message in cases.items():
        completed = subprocess.run(
            [sys.executable, "-m", "app", "serve", "--config", path],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert completed.returncode == 2, completed.stderr
        assert completed.stderr.startswith(message), completed.stderr
        assert "Traceback" not in completed.stderr


def test_read_config_reports_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read --config"):
        read_config(str(write(tmp_path, "[[models]\n")))


# --- --api-keys --------------------------------------------------------------------------------

SECRET = "sk-live-4f1c9e"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "no [[keys]] tables"),
        ('[[keys]]\nkey = "sk-1"\n[other]\nx = 1', "unknown key(s) other"),
        ('[[keys]]\nkey = ""', "key must be a non-empty string"),
        (f'[[keys]]\nkey = "{SECRET} x"', "without spaces"),
        (f'[[keys]]\nkey = "{SECRET}"\n[[keys]]\nkey = "{SECRET}"', "keys[1] repeats"),
        (f'[[keys]]\nkey = "{SECRET}"\nmodels = []', "models is empty"),
        (f'[[keys]]\nkey = "{SECRET}"\nmodels = "m"', "models must be a list"),
        (f'[[keys]]\nkey = "{SECRET}"\ntokens_per_minute = -5', "tokens_per_minute"),
        (f'[[keys]]\nkey = "{SECRET}"\nrole = "admin"', "unknown key(s) role"),
        ('[[keys]\nkey = "x"', "cannot read --api-keys"),
    ],
)
def test_an_api_keys_file_is_checked_and_never_quoted(
    tmp_path: Path, text: str, words: str
) -> None:
    path = write(tmp_path, text, "keys.toml")
    with pytest.raises(ConfigError, match="api-keys") as info:
        load_api_keys(str(path))
    assert words in str(info.value) and SECRET not in str(info.value)
    with pytest.raises(SystemExit) as exiting:
        parse(["serve", "--backend", "http://a:1", "--api-keys", str(path)])
    assert exiting.value.code == 2 and SECRET not in str(exiting.value)


def test_a_key_is_found_by_its_bearer_token_and_shows_only_its_fingerprint() -> None:
    table = parse_api_keys(
        {"keys": [{"key": SECRET, "models": ["chat-default"], "tokens_per_minute": 100}]}
    )
    grant = table.find(f"Bearer {SECRET}".encode())
    assert grant is not None and grant.label.startswith("key-") and SECRET not in grant.label
    assert grant.tokens_per_minute == 100
    assert grant.allowed(ModelDirectory(frozenset({"big"}), {"chat-default": "big"})) == {"big"}
    for wrong in (
        None,
        b"",
        b"Bearer",
        SECRET.encode(),
        b"Bearer sk-other",
        b"Basic " + SECRET.encode(),
    ):
        assert table.find(wrong) is None
    open_grant = parse_api_keys({"keys": [{"key": "sk-2"}]}).find(b"bearer sk-2")
    assert open_grant is not None and open_grant.allowed(ModelDirectory()) is None


# --- the preprocessor of a fleet ---------------------------------------------------------------


async def test_each_model_has_its_tokenizer_template_and_window(tmp_path: Path) -> None:
    long_words = ["antidisestablishmentarianism", "floccinaucinihilipilification"]
    words = str(write_word_tokenizer(tmp_path / "words", long_words))
    settings = Settings(
        models=(
            ModelConfig("deep", ("http://a:1",)),
            ModelConfig("w1", ("http://b:1",), tokenizer=words),
            ModelConfig("w2", ("http://b:1",), tokenizer=words, chat_template="chatml"),
        )
    )
    preprocessor = Preprocessor(preprocess_settings(settings), RoomMetrics.create().preprocess)
    preps = preprocessor.preps
    # Two tokenizers for three models: w1 and w2 share one, loaded once.
    assert preps.tokenizers == 2
    assert preps.for_model("w1").tokens is preps.for_model("w2").tokens
    assert preps.for_model("deep") is preps.default
    assert preps.for_model("w1").template is not None
    assert preps.for_model("w1").template.origin == "shipped:chatml"  # found for its tokenizer
    directory = ModelDirectory(
        frozenset({"deep", "w1", "w2"}), {}, {"deep": 100, "w1": 100, "w2": 100}
    )
    text = " ".join(long_words * 20)  # 40 tokens for w1, several a word for DeepSeek's
    for model, fits in (("w1", True), ("deep", False)):
        body = json.dumps({"model": model, "prompt": text, "max_tokens": 10}).encode()
        if fits:
            prepared = await preprocessor.prepare("completion", body, models=directory)
            assert prepared.model == "w1" and prepared.token_ids is not None
            assert len(prepared.token_ids) == 40
        else:
            with pytest.raises(Exception, match="maximum context length is 100"):
                await preprocessor.prepare("completion", body, models=directory)
    snapshot = preprocessor.snapshot()
    assert snapshot["tokenizers"] == 2 and snapshot["models"]["w1"]["tokenizer"] == words


def test_l1_segments_of_two_tokenizers_share_one_bound_and_never_each_other() -> None:
    store = L1Store(max_bytes=10**6)

    def cache(namespace: int) -> L1Cache:
        from app.preprocess.boundaries import BoundaryFinder
        from app.preprocess.encoding import gil_releasing_encoder
        from app.preprocess.tokenizer_loading import load_tokenizer

        loaded = load_tokenizer(None)
        finder = BoundaryFinder.for_tokenizer(loaded.tokenizer)
        return L1Cache(finder, gil_releasing_encoder(loaded.tokenizer), store, namespace=namespace)

    first, second = cache(0), cache(1)
    text = "<｜User｜>hello<｜Assistant｜>hi<｜end▁of▁sentence｜><｜User｜>again"  # noqa: RUF001
    first.tokenize(text)
    segments = len(store)
    assert segments > 0 and second.tokenize(text).result == "miss"  # not the other's
    assert len(store) == 2 * segments and first.store is second.store
    store.drop_namespace(0)
    assert len(store) == segments and first.tokenize(text).result == "miss"


async def test_a_body_whose_model_must_be_read_waits_rather_than_bails_out() -> None:
    """Under `bail-out`, a render that cannot be skipped (several models: the body says
    which) waits for a worker; one that can still bails out."""
    gate = trio.Event()

    async def offload(job: Callable[[], int]) -> int:
        await gate.wait()
        return job()

    metrics = RoomMetrics.create()
    renders = Dispatcher(
        offload,
        workers=1,
        queue_limit=0,
        saturation="bail-out",
        phase=lambda name: nullcontext(),
        fallback_phase="template-fallback",
        queue_depth=metrics.preprocess.render_queue_depth,
        saturated=metrics.preprocess.tokenize_saturated,
    )
    waited: list[Any] = []

    async def must_read() -> None:
        waited.append(await renders.run(lambda: 3, inline_ok=False, may_bail=False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(renders.run, lambda: 1)  # the only worker, held at the gate
        await trio.testing.wait_all_tasks_blocked()
        assert await renders.run(lambda: 2, inline_ok=False) is None
        nursery.start_soon(must_read)
        await trio.testing.wait_all_tasks_blocked()
        assert waited == []
        gate.set()
    assert waited == [(3, "offloaded")]
