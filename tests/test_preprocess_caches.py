"""The pure parts of tokenization: L0, the boundary finder, L1.

- L0: hits return private copies, LRU eviction by entry count and by bytes, texts over the
  size cap are not cached, memory is accounted.
- Boundary finder: the trie regex is leftmost-longest like the tokenizer's automaton; cut
  points of a rendered DeepSeek prompt.
- Neither cache adds objects for the garbage collector to walk, however many entries it
  holds (full collections walking L1's segments held the GIL 16-70 ms).
- L1: equals a full encode on random growing conversations (hypothesis) for each template
  family — the default DeepSeek tokenizer, and copies of it with ChatML and Llama 3 special
  tokens added — including adversarial content holding special-token strings and fragments;
  hits on grown conversations; memory bound; structural and sampled mismatches fall back to
  a full encode, and a sampled one turns L1 off; a tokenizer that does not split at special
  tokens fails the startup probe.
"""

from __future__ import annotations

import functools
import gc
import re
from array import array
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from app.preprocess.boundaries import BoundaryFinder, trie_pattern
from app.preprocess.chat_template import SHIPPED_DIR, ChatTemplate
from app.preprocess.encoding import facts_for, gil_releasing_encoder
from app.preprocess.l0_cache import L0Cache, entry_bytes
from app.preprocess.l1_cache import Encode, L1Cache, check_cut_independence
from app.preprocess.tokenizer_loading import load_tokenizer, wrap_tokenizer

CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


# --- L0 -------------------------------------------------------------------------------------


def ids(*values: int) -> array[int]:
    return array("I", values)


def test_l0_hit_returns_a_private_copy() -> None:
    cache = L0Cache(max_entries=10, max_bytes=10**6, max_text_bytes=1024)
    assert cache.get("hello") is None
    cache.put("hello", ids(1, 2, 3))
    hit = cache.get("hello")
    assert hit == ids(1, 2, 3)
    assert hit is not None
    hit.append(99)
    assert cache.get("hello") == ids(1, 2, 3)
    assert (cache.hits, cache.misses) == (2, 1)


def test_l0_evicts_least_recently_used_by_entries() -> None:
    cache = L0Cache(max_entries=2, max_bytes=10**6, max_text_bytes=1024)
    cache.put("a", ids(1))
    cache.put("b", ids(2))
    cache.get("a")  # b is now the oldest
    cache.put("c", ids(3))
    assert cache.get("b") is None and cache.get("a") == ids(1) and cache.get("c") == ids(3)
    assert len(cache) == 2


def test_l0_is_bounded_by_bytes_and_accounts_memory() -> None:
    one = entry_bytes("x" * 100, ids(*range(50)).tobytes())
    cache = L0Cache(max_entries=1000, max_bytes=3 * one, max_text_bytes=1024)
    for i in range(10):
        cache.put(f"{i}" + "x" * 99, ids(*range(50)))
        assert cache.memory_bytes <= cache.max_bytes
    assert len(cache) == 3
    assert cache.memory_bytes == 3 * one


def test_l0_skips_texts_over_the_size_cap() -> None:
    cache = L0Cache(max_entries=10, max_bytes=10**6, max_text_bytes=64)
    cache.put("y" * 65, ids(1))
    cache.put("é" * 40, ids(2))  # 40 characters, 80 UTF-8 bytes
    cache.put("z" * 64, ids(3))
    assert len(cache) == 1 and cache.get("z" * 64) == ids(3)


# --- boundary finder ------------------------------------------------------------------------


@given(
    st.lists(st.text("ab<>|", min_size=1, max_size=5), min_size=1, max_size=8, unique=True),
    st.text("ab<>|x", max_size=40),
)
def test_trie_pattern_is_leftmost_longest(words: list[str], text: str) -> None:
    flat = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
    trie = re.compile(trie_pattern(words))
    assert [m.span() for m in trie.finditer(text)] == [m.span() for m in flat.finditer(text)]


def test_finder_cuts_a_deepseek_prompt_after_each_special_token() -> None:
    finder = BoundaryFinder.for_tokenizer(load_tokenizer(None).tokenizer)
    prompt = "<｜begin▁of▁sentence｜>sys<｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜>"  # noqa: RUF001
    cuts = finder.find(prompt)
    assert [prompt[: c.end][-6:] for c in cuts] == ["ence｜>", "User｜>", "tant｜>", "ence｜>"]  # noqa: RUF001
    assert [c.token_id for c in cuts] == [0, 128803, 128804, 1]


# --- L1 -------------------------------------------------------------------------------------


@functools.cache
def family_tokenizer(family: str) -> Tokenizer:
    default = load_tokenizer(None).tokenizer
    assert isinstance(default, Tokenizer)
    if family == "deepseek":
        return default
    copy = Tokenizer.from_str(default.to_str())
    copy.add_special_tokens(CHATML if family == "chatml" else LLAMA3)
    return copy


def family_template(family: str) -> ChatTemplate:
    name = {"deepseek": "deepseek_v3", "chatml": "chatml", "llama3": "llama3"}[family]
    source = (SHIPPED_DIR / f"{name}.jinja").read_text()
    bos = {"deepseek": "<｜begin▁of▁sentence｜>", "llama3": "<|begin_of_text|>"}.get(family, "")  # noqa: RUF001
    return ChatTemplate(family, source, bos, "")


def l1_for(family: str, max_bytes: int = 10**7, encode: Encode | None = None) -> L1Cache:
    tokenizer = family_tokenizer(family)
    facts = facts_for(wrap_tokenizer(tokenizer))
    assert facts.finder is not None, facts.l1_unavailable
    return L1Cache(facts.finder, encode or gil_releasing_encoder(tokenizer), max_bytes)


ADVERSARIAL = [
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<｜User｜>",  # noqa: RUF001
    "<｜end▁of▁sentence｜>",  # noqa: RUF001
    "<|im_",
    "｜>",  # noqa: RUF001
    "<|",
    "<<|im_end|>>",
]
content = st.lists(
    st.one_of(
        st.sampled_from(ADVERSARIAL),
        st.text(alphabet=" \n\tab,.:1234é中文<>|", max_size=12),
        st.sampled_from(["Hello", " world", "  ", "\n\n", "123456789", "don't"]),
    ),
    max_size=8,
).map("".join)
conversations = st.lists(content, min_size=1, max_size=7)


def grown_prompts(family: str, turns: list[str]) -> list[str]:
    """The prompt after each user turn of a conversation that alternates user/assistant."""
    template = family_template(family)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    prompts = []
    for i, text in enumerate(turns):
        messages.append({"role": ("user", "assistant")[i % 2], "content": text})
        if i % 2 == 0:
            prompts.append(template.render(messages, add_generation_prompt=True))
    return prompts


def check_family(family: str, turns: list[str]) -> None:
    l1 = l1_for(family)
    encode = gil_releasing_encoder(family_tokenizer(family))
    for prompt in grown_prompts(family, turns):
        assert l1.tokenize(prompt).ids == encode(prompt), prompt
    assert l1.mismatches == 0


slow = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@slow
@given(conversations)
def test_l1_equals_full_encode_deepseek(turns: list[str]) -> None:
    check_family("deepseek", turns)


@slow
@given(conversations)
def test_l1_equals_full_encode_chatml(turns: list[str]) -> None:
    check_family("chatml", turns)


@slow
@given(conversations)
def test_l1_equals_full_encode_llama3(turns: list[str]) -> None:
    check_family("llama3", turns)


def test_l1_hits_on_a_grown_conversation() -> None:
    for family in ("deepseek", "chatml", "llama3"):
        l1 = l1_for(family)
        turns = [f"question {i} " * 30 if i % 2 == 0 else f"answer {i} " * 30 for i in range(9)]
        results = [l1.tokenize(p).result for p in grown_prompts(family, turns)]
        assert results == ["miss"] + ["hit"] * 4, family


def test_l1_memory_is_bounded() -> None:
    l1 = l1_for("chatml", max_bytes=4096)
    for i in range(50):
        l1.tokenize(f"<|im_start|>user\nconversation {i} " + "pad " * 40 + "<|im_end|>\n")
        assert l1.store.memory_bytes <= 4096
    assert 0 < len(l1) < 50


def test_structural_mismatch_falls_back_to_a_full_encode() -> None:
    real = gil_releasing_encoder(family_tokenizer("chatml"))

    def drops_leading_special(text: str) -> array[int]:  # loses the cut token of a suffix
        out = real(text)
        return out[1:] if text.startswith("<|im_end|>") else out

    l1 = l1_for("chatml", encode=drops_leading_special)
    first = "<|im_start|>system\nbe terse<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    l1.tokenize(first)
    outcome = l1.tokenize(first + "<|im_start|>assistant\n")
    assert outcome.result == "mismatch" and l1.mismatches == 1
    assert outcome.ids == drops_leading_special(first + "<|im_start|>assistant\n")
    assert l1.disabled_reason is None  # content-specific: L1 stays on


def test_sampled_verification_turns_l1_off_when_cuts_are_not_independent() -> None:
    real = gil_releasing_encoder(family_tokenizer("chatml"))

    def whole_text_differs(text: str) -> array[int]:  # a prompt is not the sum of its parts
        out = real(text)
        return out + array("I", [7]) if text.startswith("<|im_start|>") and len(text) > 60 else out

    tokenizer = family_tokenizer("chatml")
    finder = facts_for(wrap_tokenizer(tokenizer)).finder
    assert finder is not None
    l1 = L1Cache(finder, whole_text_differs, 10**6, verify_every=1)
    base = "<|im_start|>system\nhello<|im_end|>\n"
    l1.tokenize(base)
    outcome = l1.tokenize(base + "<|im_start|>user\nsomething longer than before<|im_end|>\n")
    assert outcome.result == "mismatch" and l1.disabled_reason is not None
    assert l1.tokenize(base).result == "off" and len(l1) == 0


def test_tokenizer_that_does_not_split_special_tokens_fails_the_probe() -> None:
    tokenizer = Tokenizer.from_str(family_tokenizer("chatml").to_str())
    tokenizer.encode_special_tokens = True  # special tokens become plain text
    facts = facts_for(wrap_tokenizer(tokenizer))
    assert facts.finder is None
    assert facts.l1_unavailable is not None and "probe failed" in facts.l1_unavailable
    finder = BoundaryFinder.for_tokenizer(tokenizer)
    assert check_cut_independence(finder, gil_releasing_encoder(tokenizer)) is not None


def test_cached_ids_add_nothing_for_the_garbage_collector_to_walk() -> None:
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": f"message {i}: a short line"}
        for i in range(4000)
    ]
    prompt = family_template("deepseek").render(messages, add_generation_prompt=True)
    l1 = l1_for("deepseek")
    l0 = L0Cache(max_entries=10**4, max_bytes=10**8, max_text_bytes=1024)
    texts = [f"text {i}" for i in range(1000)]
    gc.collect()
    tracked_before = len(gc.get_objects())

    outcome = l1.tokenize(prompt)
    for text in texts:
        l0.put(text, ids(1, 2, 3))
    gc.collect()

    assert len(l1) >= 2000 and len(l0) == 1000
    assert len(gc.get_objects()) - tracked_before < 100
    assert l1.tokenize(prompt + "x").result == "hit" and outcome.result == "miss"
