"""Chat templates: discovered like SMG, rendered like Hugging Face, sandboxed unless ours.

A template found in a model directory or given as a file is code from whoever published the
model, so it runs in Jinja2's `ImmutableSandboxedEnvironment` (no attribute escapes, no
mutation of the request's lists and dicts). The templates shipped here (chat_templates/) are
ours, so they run in a plain `Environment` with the same settings: the sandbox's checks cost
about half of a small render and guard nothing the shipped files do not already avoid (tests
render each both ways and compare). Their text also renders the usual conversations without
Jinja at all (shipped_renders.py). Either environment matches
`transformers.apply_chat_template`: `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension, a `tojson` filter that keeps non-ASCII text and takes `indent`, and the globals
`raise_exception` and `strftime_now`. Templates receive `messages`, `add_generation_prompt`,
`tools`, `documents`, `bos_token`, `eos_token` and any `chat_template_kwargs` the request
carries.

Discovery order (SMG's): `--chat-template` (a path, or the name of a shipped template),
`chat_template.json`, `chat_template.jinja`, any other `.jinja` file in the tokenizer's
directory, the `chat_template` field of `tokenizer_config.json` (a string, or a list of named
templates of which `default` is used). Sluice adds a last step: a shipped template chosen by
the special tokens the tokenizer really has — how the bundled DeepSeek tokenizer, whose
config has no template, gets DeepSeek-V3's format.

Renders are not cached (app/README.md says why): a grown conversation cannot be rendered
from its new turns alone, and the verbatim repeats an exact cache would catch are L0's.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from jinja2 import Environment, Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.errors import ClientError, ConfigError
from app.preprocess.shipped_renders import BY_NAME, DirectRender

if TYPE_CHECKING:  # render worker processes import this module without the tokenizer
    from app.preprocess.tokenizer_loading import LoadedTokenizer

SHIPPED_DIR = Path(__file__).parent / "chat_templates"


class TemplateLoadError(ConfigError):
    """The configured chat template cannot be read or compiled; a startup error."""


class TemplateRaisedError(ClientError):
    """`raise_exception(message)` called by a template: a 400 whose message is for the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "messages", "chat_template_error")


@dataclass(frozen=True)
class ShippedFamily:
    name: str  # file stem in chat_templates/
    markers: tuple[str, ...]  # the tokenizer must have all of these added tokens
    bos_token: str | None
    eos_token: str | None


SHIPPED = (
    ShippedFamily(
        "deepseek_v3",
        ("<｜User｜>", "<｜Assistant｜>"),  # noqa: RUF001 - DeepSeek's bars are fullwidth
        "<｜begin▁of▁sentence｜>",  # noqa: RUF001
        "<｜end▁of▁sentence｜>",  # noqa: RUF001
    ),
    ShippedFamily(
        "llama3",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    ShippedFamily("chatml", ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>"),
)


@dataclass(frozen=True)
class ChatTemplate:
    origin: str  # where it came from, for logs and the dashboard
    source: str
    bos_token: str
    eos_token: str
    shipped: bool = False  # one of chat_templates/: ours, rendered without the sandbox

    @property
    def compiled(self) -> CompiledTemplate:
        return compile_template(self.source, sandboxed=not self.shipped)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Any = None,
        documents: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt, or a ClientError carrying the template's own message. A shipped
        template renders the conversations it can in plain Python (shipped_renders.py)."""
        compiled = self.compiled
        direct = compiled.direct
        try:
            # The shipped templates read no tools or documents; extra variables could
            # shadow the globals they call, so only Jinja renders with them.
            if direct is not None and not extra:
                prompt = direct(messages, add_generation_prompt, self.bos_token)
                if prompt is not None:
                    return prompt
            return compiled.render(
                self._variables(messages, add_generation_prompt, tools, documents, extra)
            )
        except TemplateRaisedError:
            raise
        except Exception as exc:  # any failure of a template on these messages is a 400
            raise ClientError(
                f"the chat template ({self.origin}) failed on these messages: "
                f"{type(exc).__name__}: {exc}",
                "messages",
                "chat_template_error",
            ) from exc

    def render_with_jinja(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool
    ) -> str:
        """The prompt as Jinja renders it, for what a render costs when no plain Python
        render takes the conversation (the cost model's calibration, benchmarks)."""
        variables = self._variables(messages, add_generation_prompt, None, None, None)
        return self.compiled.render(variables)

    def _variables(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Any,
        documents: Any,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        variables = dict(extra or {})
        variables.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return variables


@dataclass(frozen=True)
class RenderCost:
    """Seconds a render takes: base + per message + per character of content.

    Jinja2 is pure Python: the cost grows with the number of messages, not tokens, so
    `per_message` is measured per template at startup — templates differ by 15x (DeepSeek-V3's
    namespace bookkeeping: ~3.5 µs a message here; ChatML: ~0.2 µs). Content size costs only
    string copies: ~0.1 ns a character when they stay in cache, but up to ~2 ns with the
    allocator's page faults on prompts of hundreds of KiB (56 µs for 64 KiB, 0.1-0.6 ms for
    256 KiB, noisy), so `per_char` is that measured worst case, not calibrated.
    """

    base: float
    per_message: float
    per_char: float = 2e-9

    def estimate(self, messages: int, chars: int) -> float:
        return self.base + self.per_message * messages + self.per_char * chars


# For templates that refuse the calibration conversation: four times DeepSeek-V3's cost.
CONSERVATIVE_RENDER_COST = RenderCost(base=200e-6, per_message=16e-6)


def calibrate_render_cost(template: ChatTemplate) -> RenderCost:
    """Time Jinja's renders of two synthetic conversations: 4 and 68 short messages.

    Jinja's, even for a shipped template: a conversation its plain Python render declines
    (tool calls) costs that much, and the estimate must not send such a render to the loop.
    The plain renders, ~10x cheaper, are then estimated high, which at worst sends a long
    conversation to a render worker as before."""

    def conversation(n: int) -> list[dict[str, Any]]:
        turns = [
            {"role": ("user", "assistant")[i % 2], "content": "lorem ipsum " * 8}
            for i in range(n - 1)
        ]
        return [{"role": "system", "content": "You are a calibration probe."}, *turns]

    def seconds(messages: list[dict[str, Any]]) -> float:
        best = math.inf
        for _ in range(3):  # the minimum: calibration must not learn from a noisy neighbour
            start = time.perf_counter()
            template.render_with_jinja(messages, add_generation_prompt=True)
            best = min(best, time.perf_counter() - start)
        return best

    try:
        few, many = seconds(conversation(4)), seconds(conversation(68))
    except Exception:  # any failure of the template on these messages
        return CONSERVATIVE_RENDER_COST
    return RenderCost(base=few, per_message=max(many - few, 0.0) / 64)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaisedError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and forces ASCII; templates expect HF's.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment(sandboxed: bool) -> Environment:
    kind = ImmutableSandboxedEnvironment if sandboxed else Environment
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class CompiledTemplate:
    """A compiled template and its environment's globals, merged once.

    `Template.render` merges the globals (a ChainMap of the template's over the
    environment's) into a new dict on every call: ~5 of a one-message render's 13 µs.
    Rendering from a copy of the merged dict does the rest of what it does."""

    def __init__(self, template: Template, direct: DirectRender | None) -> None:
        self.template = template
        self.direct = direct
        self._globals = dict(template.globals)

    def render(self, variables: dict[str, Any]) -> str:
        context = dict(self._globals)
        context.update(variables)
        template = self.template
        return "".join(template.root_render_func(template.new_context(context, shared=True)))


@functools.lru_cache(maxsize=64)
def compile_template(source: str, *, sandboxed: bool = True) -> CompiledTemplate:
    """Compiled once per distinct source (compiling costs milliseconds; rendering far less).
    A source that is a shipped template's text also gets that template's plain Python
    render, sandboxed or not: it renders the same string."""
    template = _environment(sandboxed).from_string(source)
    return CompiledTemplate(template, _direct_renders().get(source))


@functools.cache
def _direct_renders() -> dict[str, DirectRender]:
    return {_read_text(SHIPPED_DIR / f"{name}.jinja"): render for name, render in BY_NAME.items()}


def shipped_family(added_tokens: Collection[str]) -> ShippedFamily | None:
    for family in SHIPPED:
        if all(marker in added_tokens for marker in family.markers):
            return family
    return None


def load_chat_template(
    explicit: str | None, loaded: LoadedTokenizer, added_tokens: Collection[str]
) -> ChatTemplate | None:
    """The template for this tokenizer, by the discovery order above; None if there is none
    (then only /v1/completions works)."""
    found = _find_source(explicit, loaded, added_tokens)
    if found is None:
        return None
    origin, source, shipped = found
    try:
        compile_template(source, sandboxed=not shipped)
    except TemplateError as exc:
        raise TemplateLoadError(f"chat template {origin} does not compile: {exc}") from exc
    family = shipped_family(added_tokens)

    def special(configured: str | None, default: str | None) -> str:
        # tokenizer_config.json wins; else the family's token if the tokenizer has it.
        if configured is not None:
            return configured
        return default if default is not None and default in added_tokens else ""

    return ChatTemplate(
        origin=origin,
        source=source,
        bos_token=special(loaded.bos_token, family.bos_token if family else None),
        eos_token=special(loaded.eos_token, family.eos_token if family else None),
        shipped=shipped,
    )


def _find_source(
    explicit: str | None, loaded: LoadedTokenizer, added_tokens: Collection[str]
) -> tuple[str, str, bool] | None:
    """Where the template came from, its source, and whether it is one of ours."""
    if explicit is not None:
        return _explicit_source(explicit)
    directory = loaded.directory
    if directory is not None:
        json_file = directory / "chat_template.json"
        if json_file.is_file():
            data = _read_json(json_file)
            field = data.get("chat_template") if isinstance(data, dict) else None
            return str(json_file), _pick_named(field, json_file), False
        jinja_files = sorted(directory.glob("*.jinja"))
        preferred = directory / "chat_template.jinja"
        if preferred in jinja_files:
            jinja_files.remove(preferred)
            jinja_files.insert(0, preferred)
        if jinja_files:
            return str(jinja_files[0]), _read_text(jinja_files[0]), False
    if loaded.config_chat_template is not None:
        where = f"{loaded.directory or loaded.source}/tokenizer_config.json"
        return f"{where} (chat_template)", _pick_named(loaded.config_chat_template, where), False
    family = shipped_family(added_tokens)
    if family is not None:
        return _shipped_source(family.name)
    return None


def _explicit_source(explicit: str) -> tuple[str, str, bool]:
    path = Path(explicit).expanduser()
    if path.is_file():
        if path.suffix == ".json":
            data = _read_json(path)
            field = data.get("chat_template") if isinstance(data, dict) else None
            return str(path), _pick_named(field, path), False
        return str(path), _read_text(path), False
    if any(family.name == explicit for family in SHIPPED):
        return _shipped_source(explicit)
    names = ", ".join(family.name for family in SHIPPED)
    raise TemplateLoadError(
        f"--chat-template {explicit!r}: no such file, and not a shipped template ({names})"
    )


def _shipped_source(name: str) -> tuple[str, str, bool]:
    path = SHIPPED_DIR / f"{name}.jinja"
    return f"shipped:{name}", _read_text(path), True


def _pick_named(field: Any, where: object) -> str:
    """A template string, or the `default` entry of HF's list-of-named-templates form."""
    if isinstance(field, str):
        return field
    if isinstance(field, list):
        named = {
            entry.get("name"): entry.get("template") for entry in field if isinstance(entry, dict)
        }
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise TemplateLoadError(
            f"{where}: chat_template lists templates {sorted(map(str, named))} but none named "
            f"'default'; pass --chat-template with the one to use"
        )
    raise TemplateLoadError(f"{where}: chat_template is neither a string nor a list")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateLoadError(f"cannot read chat template {path}: {exc}") from exc


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TemplateLoadError(f"cannot read {path}: {exc}") from exc
