"""Does a backend tokenize exactly as Sluice does? `--forward tokens` sends ids only to those.

Token ids sent to a model with another vocabulary are silent garbage, so the answer must come
from the backend itself: Sluice asks its `POST /tokenize` for the ids of a fixed probe text and
compares them with its own, id by id. vLLM and SGLang take `{"prompt", "add_special_tokens"}`
(and `model`); llama.cpp takes `{"content", "add_special"}`, so that shape is tried when the
first is refused (4xx other than 404) or not understood (200 with no tokens: llama.cpp ignores
unknown keys and tokenizes nothing). Both answer `{"tokens": [...]}`.

Outcomes: "verified"; "refused" (a mismatch, no /tokenize, an answer that cannot be read: the
backend takes no traffic until it is re-admitted and checked again); "unchecked" (a timeout or
a 5xx: the next health check tries again). Checks run at start-up (before the proxy listens)
and from the health checker whenever a healthy backend is due one, i.e. after re-admission.
Passthrough mode never sets a probe, so nothing here sends a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import trio

from app.errors import UpstreamError
from app.fleet.backends import Backend, TokenizerOutcome, TokenizerProbe
from app.fleet.pool import BackendPool
from app.http.fetch import Fetched, Fetcher

log = logging.getLogger("sluice.tokenizer_check")

TOKENIZE_PATH = "/tokenize"

# Fixed, so every start and every backend is compared on the same text. It covers what
# tokenizers most often disagree on: scripts (Latin with diacritics, Cyrillic, Greek, CJK,
# Hangul, Arabic, Devanagari), a combining accent vs a precomposed one and full-width forms
# (normalizers), emoji with a skin-tone modifier (byte fallback), digit runs and number
# formats (digit splitting), punctuation and markup, and whitespace runs: spaces, a tab,
# three newlines, CRLF and a no-break space (pre-tokenizers). Look-alike characters (Greek
# omicron, full-width forms) are the point, hence the noqa.
PROBE_TEXT = (
    "Sluice tokenizer probe. Hello, world! It's 2024-06-01T12:34:56Z; pi~3.14159, "
    '1,234,567.89 (+42%) & 0x1F #tag @user {"k": [1, 2]} <p>x</p> a_b-c/d\\e\n'
    "Grüße, naïve café vs cafe\u0301 · Привет, мир! · Γειά σου κόσμε · 你好，世界。"  # noqa: RUF001
    "こんにちは、世界！· 안녕하세요 · مرحبا بالعالم · नमस्ते · ＡＢＣ１２３ 🙂🚀👍🏽\n"  # noqa: RUF001
    "  two spaces,\ttab,   three spaces\n\n\nthree newlines\r\nCRLF\u00a0no-break   end"
)

CANNOT_VERIFY = "cannot verify that it tokenizes as Sluice does, so it takes no traffic"


def build_probe(
    encode: Callable[[str], Sequence[int]], special_tokens: Sequence[str]
) -> TokenizerProbe:
    """The probe text, plus the tokenizer's first special token (lowest id) when it has one:
    a special-token string in a prompt must come out as that token's single id on both sides
    (rendered chat prompts are full of them)."""
    text = PROBE_TEXT
    if special_tokens:
        text += f"\n{special_tokens[0]}right after a special token"
    return TokenizerProbe(text, tuple(encode(text)))


def vllm_body(probe: TokenizerProbe, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": probe.text, "add_special_tokens": False}
    if model is not None:  # vLLM answers 404 for a model it does not serve: use its own id
        body["model"] = model
    return body


def llama_cpp_body(probe: TokenizerProbe) -> dict[str, Any]:
    return {"content": probe.text, "add_special": False, "parse_special": True}


def compare_tokens(backend_ids: Sequence[int], expected: Sequence[int]) -> TokenizerOutcome:
    """Verified only when every id matches; else where the first difference is (0-based)."""
    for index, (theirs, ours) in enumerate(zip(backend_ids, expected, strict=False)):
        if theirs != ours:
            return TokenizerOutcome(
                "refused", f"mismatch at token {index}: backend {theirs} vs sluice {ours}"
            )
    if len(backend_ids) != len(expected):
        return TokenizerOutcome(
            "refused",
            f"mismatch at token {min(len(backend_ids), len(expected))}: backend gave "
            f"{len(backend_ids)} tokens, sluice {len(expected)}",
        )
    return TokenizerOutcome("verified", f"verified: same {len(expected)} ids for the probe")


def judge_answer(status: int, payload: Any, probe: TokenizerProbe) -> TokenizerOutcome:
    """What one /tokenize answer (status, parsed JSON or None) says about the backend."""
    if status == 404:
        return TokenizerOutcome("refused", f"no {TOKENIZE_PATH} endpoint (404): {CANNOT_VERIFY}")
    if 400 <= status < 500:
        return TokenizerOutcome(
            "refused", f"{TOKENIZE_PATH} refused the probe ({status}): {CANNOT_VERIFY}"
        )
    if status != 200:
        return TokenizerOutcome(
            "unchecked", f"{TOKENIZE_PATH} answered {status}; retrying at the next health check"
        )
    tokens = _tokens(payload)
    if tokens is None:
        return TokenizerOutcome(
            "refused", f"{TOKENIZE_PATH} answered without a list of token ids: {CANNOT_VERIFY}"
        )
    return compare_tokens(tokens, probe.expected)


def _tokens(payload: Any) -> list[int] | None:
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list):
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return None
    return tokens


def _needs_second_shape(response: Fetched) -> bool:
    if response.status == 200:
        return _tokens(_json(response)) == []  # the probe text is never empty
    return 400 <= response.status < 500 and response.status != 404


def _json(response: Fetched) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


async def _ask(client: Fetcher, backend: Backend, probe: TokenizerProbe) -> TokenizerOutcome:
    model = backend.models[0]["id"] if backend.models else None
    response = await client.post_json(backend.url, TOKENIZE_PATH, vllm_body(probe, model))
    if _needs_second_shape(response):
        response = await client.post_json(backend.url, TOKENIZE_PATH, llama_cpp_body(probe))
    return judge_answer(response.status, _json(response), probe)


async def check_tokenizer(
    pool: BackendPool, backend: Backend, client: Fetcher, seconds: float
) -> None:
    """Check `backend` if it is due a check (tokens mode, healthy, not checked since it was
    admitted); a no-op otherwise, and always in passthrough mode."""
    probe = pool.claim_tokenizer_check(backend)
    if probe is None:
        return
    # Cancelled half-way (shutdown): back to "unchecked", never stuck in "checking".
    outcome = TokenizerOutcome("unchecked", "the check was interrupted")
    try:
        with trio.fail_after(seconds):
            outcome = await _ask(client, backend, probe)
    except trio.TooSlowError:
        outcome = TokenizerOutcome(
            "unchecked", f"{TOKENIZE_PATH} timed out after {seconds:g}s; retrying"
        )
    except UpstreamError as exc:
        outcome = TokenizerOutcome("unchecked", f"{TOKENIZE_PATH} failed ({exc}); retrying")
    finally:
        pool.tokenizer_checked(backend, outcome)
    if outcome.state == "verified":
        log.info("backend %s tokenizes as Sluice does: %s", backend.url, outcome.detail)
    elif outcome.state == "refused":
        log.error(
            "backend %s will get no traffic with --forward tokens: %s", backend.url, outcome.detail
        )
    else:
        log.warning("backend %s: tokenizer check incomplete: %s", backend.url, outcome.detail)


async def check_tokenizers_at_startup(pool: BackendPool, seconds: float) -> None:
    """Check every healthy backend at once, before the proxy listens (tokens mode only)."""
    if pool.tokenizer_probe is None:
        return
    client = Fetcher(connect_timeout=seconds)
    try:
        async with trio.open_nursery() as nursery:
            for backend in pool.backends:
                nursery.start_soon(check_tokenizer, pool, backend, client, seconds)
    finally:
        await client.aclose()
