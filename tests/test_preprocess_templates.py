"""Chat template rendering and the request errors around it.

- The HF-compatible sandbox: tojson (non-ASCII kept, indent), raise_exception, strftime_now,
  loop controls, trim_blocks/lstrip_blocks, refused attribute escapes and mutation.
- The shipped DeepSeek-V3 template: system prompts, turns, tool calls and tool outputs.
- Shipped templates, which render outside the sandbox, render exactly as they do inside it;
  the default tokenizer's template is the shipped one, unsandboxed; a file's is sandboxed.
- Their plain Python renders (shipped_renders.py) give Jinja's string for 2,000 generated
  conversations each, and decline (Jinja renders, or refuses) whatever they do not take.
- Bad input, each a ClientError with a clear message: a template's raise_exception, a
  template crashing on the messages, non-text content parts, malformed content, batched and
  out-of-vocabulary completion prompts, reserved chat_template_kwargs, unpaired surrogates
  (valid JSON, invalid text), no template at all.
- Content as a list of text parts is flattened (joined with newlines).
"""

from __future__ import annotations

import datetime
import random
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import SandboxedEnvironment
from tokenizers import Tokenizer, models

from app.cli.rooms import RoomMetrics, preprocess_settings
from app.config import Settings
from app.errors import ClientError, answer_for
from app.preprocess.chat_template import SHIPPED_DIR, ChatTemplate, load_chat_template
from app.preprocess.encoding import facts_for
from app.preprocess.pipeline import Preprocessor
from app.preprocess.tokenizer_loading import load_tokenizer
from tests.fakes import prepare

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # noqa: RUF001


def template(source: str) -> ChatTemplate:
    return ChatTemplate("test", source, "<s>", "</s>")


def render(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return template(source).render(messages, add_generation_prompt=False, **kwargs)


USER = [{"role": "user", "content": "héllo"}]


def test_hf_environment_features() -> None:
    assert render("{{ messages[0] | tojson }}", USER) == '{"role": "user", "content": "héllo"}'
    assert render("{{ messages[0] | tojson(indent=2) }}", USER).startswith('{\n  "role"')
    year = str(datetime.datetime.now().year)
    assert render("{{ strftime_now('%Y') }}", USER) == year
    looped = "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}"
    assert render(looped, USER) == "1"
    blocks = "  {% if true %}\nA\n  {% endif %}\nB"
    assert render(blocks, USER) == "A\nB"
    assert render("{{ bos_token }}{{ eos_token }}{{ tools }}", USER, tools=[1]) == "<s></s>[1]"


def test_template_raise_exception_is_a_400_with_its_message() -> None:
    source = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    )
    with pytest.raises(ClientError) as info:
        render(source, USER)
    assert info.value.message == "System first!"
    assert (info.value.param, info.value.code) == ("messages", "chat_template_error")
    assert answer_for(info.value).body["error"]["type"] == "invalid_request_error"


def test_template_crash_and_sandbox_escapes_are_400s() -> None:
    with pytest.raises(ClientError, match="TypeError"):
        render("{{ messages[0].content + 1 }}", USER)
    with pytest.raises(ClientError, match="is unsafe"):
        render("{{ messages.__class__.__subclasses__() }}", USER)
    with pytest.raises(ClientError, match="is unsafe"):
        render("{{ messages.append(1) }}", USER)


def shipped(name: str, sandboxed: bool = False) -> ChatTemplate:
    source = (SHIPPED_DIR / f"{name}.jinja").read_text()
    return ChatTemplate(name, source, BOS, EOS, shipped=not sandboxed)


CALL = {"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "héllo ☃"}],
    [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "cold"},
        {"role": "assistant", "content": "wet"},
        {"role": "user", "content": "{{ 7 * 7 }} {% raw %}"},
    ],
]


SHIPPED_NAMES = ["deepseek_v3", "llama3", "chatml"]


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_shipped_templates_render_outside_the_sandbox_as_inside(name: str) -> None:
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            jinja = [
                shipped(name, sandboxed).render_with_jinja(
                    messages, add_generation_prompt=generation_prompt
                )
                for sandboxed in (False, True)
            ]
            assert jinja[0] == jinja[1]
            for extra in ({}, {"tools": tools}):
                rendered = shipped(name).render(
                    messages, add_generation_prompt=generation_prompt, **extra
                )
                assert rendered == jinja[0]


def generated_message(rng: random.Random) -> dict[str, Any]:
    """A message as `template_messages` hands it on, now and then with what no request
    passing the checks carries (a missing key, a number), to see the renders decline it."""
    texts = ["", "hi", "  padded \n", "héllo ☃", "{{ x }} {% raw %}", "\n\n", "a" * 40]
    message: dict[str, Any] = {
        "role": rng.choice(["system", "user", "user", "assistant", "assistant", "tool",
                            "developer", "function"]),
        "content": rng.choice([*texts, None]),
    }  # fmt: skip
    if message["role"] == "assistant" and rng.random() < 0.3:
        message["tool_calls"] = rng.choice([[CALL], [], None])
    if rng.random() < 0.03:
        del message[rng.choice(["role", "content"])]
    elif rng.random() < 0.03:
        message[rng.choice(["role", "content"])] = 7
    return message


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_plain_python_renders_match_jinja(name: str) -> None:
    template = shipped(name)
    direct = template.compiled.direct
    assert direct is not None
    rng = random.Random(name)
    taken = 0
    for _ in range(2000):
        messages = [generated_message(rng) for _ in range(rng.randint(1, 6))]
        generation_prompt = rng.random() < 0.7
        try:
            jinja: str | None = template.render_with_jinja(
                messages, add_generation_prompt=generation_prompt
            )
        except Exception:
            jinja = None
        plain = direct(messages, generation_prompt, BOS)
        if plain is not None:
            taken += 1
            assert plain == jinja, messages
        if jinja is None:
            with pytest.raises(ClientError):
                template.render(messages, add_generation_prompt=generation_prompt)
        else:
            assert template.render(messages, add_generation_prompt=generation_prompt) == jinja
    assert taken > 200  # the plain renders take ordinary conversations
    ordinary = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and?"},
    ]
    assert direct(ordinary, True, BOS) is not None


def test_a_file_with_a_shipped_templates_text_renders_in_plain_python(tmp_path: Path) -> None:
    source = (SHIPPED_DIR / "chatml.jinja").read_text()
    assert template(source).compiled.direct is not None
    assert template(source + " ").compiled.direct is None


def test_only_shipped_templates_leave_the_sandbox(tmp_path: Path) -> None:
    loaded = load_tokenizer(None)
    added = facts_for(loaded).added_tokens
    default = load_chat_template(None, loaded, added)
    assert default is not None and default.shipped and default.origin == "shipped:deepseek_v3"
    assert not isinstance(default.compiled.template.environment, SandboxedEnvironment)
    own = tmp_path / "t.jinja"
    own.write_text((SHIPPED_DIR / "deepseek_v3.jinja").read_text())
    from_file = load_chat_template(str(own), loaded, added)
    assert from_file is not None and not from_file.shipped
    assert isinstance(from_file.compiled.template.environment, SandboxedEnvironment)


def test_deepseek_template_turns_and_tools() -> None:
    deepseek = shipped("deepseek_v3")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "weather?"},
    ]
    assert deepseek.render(messages, add_generation_prompt=True) == (
        f"{BOS}A\n\nB<｜User｜>hi<｜Assistant｜>yo{EOS}<｜User｜>weather?<｜Assistant｜>"  # noqa: RUF001
    )
    call = {"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "cold"},
    ]
    rendered = deepseek.render(messages, add_generation_prompt=True)
    tool_call = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>'  # noqa: RUF001, E501
    assert rendered.endswith(
        f"<｜Assistant｜><｜tool▁calls▁begin｜>{tool_call}\n{tool_call}<｜tool▁calls▁end｜>{EOS}"  # noqa: RUF001
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>\n"  # noqa: RUF001
        "<｜tool▁output▁begin｜>cold<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"  # noqa: RUF001
    )


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor(preprocess_settings(Settings()), RoomMetrics.create().preprocess)


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **fields}


async def test_text_parts_are_flattened(preprocessor: Preprocessor) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    prepared = await prepare(preprocessor, "chat", chat({"role": "user", "content": parts}))
    assert prepared.prompt == f"{BOS}<｜User｜>one\ntwo<｜Assistant｜>"  # noqa: RUF001
    plain = await prepare(
        preprocessor, "chat", chat({"role": "user", "content": "x"}, add_generation_prompt=False)
    )
    assert plain.prompt == f"{BOS}<｜User｜>x"  # noqa: RUF001


@pytest.mark.parametrize(
    ("content", "param", "code", "words"),
    [
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
            "messages[0].content[1]",
            "unsupported_content",
            "'image_url' are not supported",
        ),
        ([{"type": "text", "text": 5}], "messages[0].content[0].text", "invalid_type", "string"),
        (42, "messages[0].content", "invalid_type", "must be a string"),
    ],
)
async def test_bad_content_is_refused(
    preprocessor: Preprocessor, content: Any, param: str, code: str, words: str
) -> None:
    with pytest.raises(ClientError) as info:
        await prepare(preprocessor, "chat", chat({"role": "user", "content": content}))
    assert (info.value.param, info.value.code) == (param, code)
    assert words in info.value.message


async def test_template_errors_reach_the_client(preprocessor: Preprocessor) -> None:
    with pytest.raises(ClientError, match="TypeError") as info:
        await prepare(preprocessor, "chat", chat({"role": "assistant", "content": None}))
    assert info.value.code == "chat_template_error"
    with pytest.raises(ClientError, match="may not set"):
        await prepare(
            preprocessor,
            "chat",
            chat({"role": "user", "content": "x"}, chat_template_kwargs={"messages": []}),
        )
    kwargs = chat({"role": "user", "content": "x"}, chat_template_kwargs={"thinking": True})
    assert (await prepare(preprocessor, "chat", kwargs)).prompt is not None


@pytest.mark.parametrize(
    ("prompt", "code", "words"),
    [
        (["one", "two"], "unsupported_batch", "one prompt per request"),
        ([1, 2, 10**9], "invalid_prompt", "outside the vocabulary"),
        ([-1], "invalid_type", "a list of token ids"),
        ([], "invalid_type", "a list of token ids"),
        ({"text": "x"}, "invalid_type", "a list of token ids"),
    ],
)
async def test_bad_completion_prompts_are_refused(
    preprocessor: Preprocessor, prompt: Any, code: str, words: str
) -> None:
    with pytest.raises(ClientError) as info:
        await prepare(preprocessor, "completion", {"model": "m", "prompt": prompt})
    assert (info.value.param, info.value.code) == ("prompt", code)
    assert words in info.value.message


async def test_unpaired_surrogates_are_refused(preprocessor: Preprocessor) -> None:
    with pytest.raises(ClientError, match="unpaired surrogate") as info:
        await prepare(preprocessor, "completion", {"model": "m", "prompt": "a\ud800b"})
    assert info.value.code == "invalid_text"
    with pytest.raises(ClientError, match="U\\+DC00"):
        await prepare(preprocessor, "chat", chat({"role": "user", "content": "\udc00"}))


async def test_completion_prompt_forms(preprocessor: Preprocessor) -> None:
    given = await prepare(preprocessor, "completion", {"model": "m", "prompt": [[5, 6]]})
    assert (given.tokenize_path, list(given.token_ids or [])) == ("given", [5, 6])
    text = await prepare(preprocessor, "completion", {"model": "m", "prompt": ["hello"]})
    assert text.prompt == "hello" and text.token_ids


async def test_no_template_means_chat_is_refused(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    bare = Preprocessor(
        preprocess_settings(Settings(tokenizer=str(tmp_path / "tokenizer.json"))),
        RoomMetrics.create().preprocess,
    )
    with pytest.raises(ClientError, match="--chat-template") as info:
        await prepare(bare, "chat", chat({"role": "user", "content": "a"}))
    assert info.value.code == "no_chat_template"
    assert list(
        (await prepare(bare, "completion", {"model": "m", "prompt": "a"})).token_ids or []
    ) == [1]
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).directory == tmp_path
