"""The pooling endpoints' requests and answers, as vLLM's pooling servers shape them. Pure.

`/v1/embeddings` (vllm/entrypoints/pooling/embed), `/rerank` and `/score`
(pooling/scoring), `/classify` and `/pooling`: each input is tokenized, pooled by the engine
(a prefill with no decode) and answered with numbers derived from its token ids alone, so the
same input always gets the same vector and inputs sharing words get similar ones. The vector
is feature hashing of the ids (a signed count per bucket, normalised), which costs one step
per token, not one random draw per dimension per token; a relevance score is the cosine of
two such vectors mapped onto [0, 1], the range of a cross-encoder's sigmoid.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.sim.openai_format import request_error
from app.sim.settings import SimSettings
from app.sim.tokens import TextTokenizer

# Dimensions of an embedding unless the request asks for `dimensions`.
EMBEDDING_DIMENSIONS = 256
MAX_DIMENSIONS = 8192
# What a classification model's config names its two classes when it names none.
CLASS_LABELS = ("LABEL_0", "LABEL_1")
# Fibonacci hashing: spreads small ids (a real vocabulary's) over the buckets.
_GOLDEN = 0x9E3779B1

EncodingFormat = Literal["float", "base64"]


@dataclass(frozen=True)
class PoolingInput:
    """One prompt for the engine: its token ids, and whether it came as text."""

    tokens: list[int]
    as_text: bool


def read_inputs(
    value: Any, param: str, tokenizer: TextTokenizer, settings: SimSettings
) -> list[PoolingInput]:
    """vLLM's `input` forms: a string, a list of strings, a list of token ids, or a list of
    token-id lists; each checked against the context window as vLLM's pooling server does."""
    items: list[Any]
    if isinstance(value, str) or (isinstance(value, list) and value and _ints(value)):
        items = [value]
    elif isinstance(value, list) and value and all(_text_or_ids(item) for item in value):
        items = value
    else:
        raise request_error(
            f"`{param}` must be a string, a list of strings, a list of token ids or a "
            "list of token-id lists",
            param=param,
        )
    inputs = [_one_input(item, param, tokenizer) for item in items]
    for pooled in inputs:
        if len(pooled.tokens) > settings.max_model_len:
            raise request_error(
                f"This model's maximum context length is {settings.max_model_len} tokens. "
                f"However, you requested {len(pooled.tokens)} tokens in the input for "
                "embedding generation. Please reduce the length of the input.",
                param=param,
            )
    return inputs


def _one_input(item: Any, param: str, tokenizer: TextTokenizer) -> PoolingInput:
    if isinstance(item, str):
        return PoolingInput(tokenizer.encode(item), True)
    out_of_range = [token for token in item if not 0 <= token < tokenizer.vocab_size]
    if out_of_range:
        raise request_error(f"Token id {out_of_range[0]} is out of vocabulary", param=param)
    return PoolingInput(list(item), False)


def read_texts(value: Any, param: str) -> list[str]:
    """A string or a non-empty list of strings (the scoring endpoints' texts)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return list(value)
    raise request_error(f"`{param}` must be a string or a non-empty list of strings", param=param)


def read_encoding(payload: dict[str, Any]) -> EncodingFormat:
    encoding = payload.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise request_error(
            "`encoding_format` must be `float` or `base64`", param="encoding_format"
        )
    return "base64" if encoding == "base64" else "float"


def read_dimensions(payload: dict[str, Any]) -> int:
    dimensions = payload.get("dimensions")
    if dimensions is None:
        return EMBEDDING_DIMENSIONS
    if not _is_int(dimensions) or not 1 <= dimensions <= MAX_DIMENSIONS:
        raise request_error(
            f"`dimensions` must be an integer from 1 to {MAX_DIMENSIONS}", param="dimensions"
        )
    return int(dimensions)


def embedding(tokens: Sequence[int], dimensions: int = EMBEDDING_DIMENSIONS) -> list[float]:
    """A unit vector determined by the token ids (feature hashing with signs)."""
    vector = [0.0] * dimensions
    for token in tokens:
        mixed = (token * _GOLDEN) & 0xFFFFFFFF
        vector[(mixed >> 8) % dimensions] += 1.0 if mixed >> 31 else -1.0
    norm = math.sqrt(sum(value * value for value in vector))
    if norm == 0.0:  # no tokens, or ones that cancelled out: a fixed direction
        return [1.0 / math.sqrt(dimensions)] * dimensions
    return [value / norm for value in vector]


def relevance(query: Sequence[int], document: Sequence[int]) -> float:
    """A cross-encoder's score in [0, 1]: documents sharing the query's words rank higher."""
    cosine = sum(a * b for a, b in zip(embedding(query), embedding(document), strict=True))
    return (1.0 + cosine) / 2.0


def class_probabilities(tokens: Sequence[int]) -> list[float]:
    """A softmax over two logits read off the input's vector."""
    vector = embedding(tokens, 2 * len(CLASS_LABELS))
    logits = [4.0 * vector[index] for index in range(len(CLASS_LABELS))]
    top = max(logits)
    weights = [math.exp(logit - top) for logit in logits]
    return [weight / sum(weights) for weight in weights]


def encode_vector(vector: list[float], encoding: EncodingFormat) -> list[float] | str:
    """Floats, or base64 of little-endian float32 as the OpenAI SDK asks by default."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's `UsageInfo` for a pooling answer: prompt tokens only."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def listing(prefix: str, model: str, data: list[dict[str, Any]], prompt: int) -> dict[str, Any]:
    """The `{"object": "list", "data": [...]}` answer of embeddings, score, classify, pooling."""
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": pooling_usage(prompt),
    }


def rerank_answer(
    model: str, documents: list[str], scores: list[float], prompt: int, top_n: int
) -> dict[str, Any]:
    """Results by falling relevance, the first `top_n` of them (0: all), as vLLM's rerank."""
    order = sorted(range(len(documents)), key=scores.__getitem__, reverse=True)
    if 0 < top_n < len(order):
        order = order[:top_n]
    results = [
        {"index": index, "document": {"text": documents[index]}, "relevance_score": scores[index]}
        for index in order
    ]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        "results": results,
    }


def score_pairs(first: list[str], second: list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others, or the lists pairwise."""
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise request_error(
            "`text_1` and `text_2` must have the same length, or `text_1` one text",
            param="text_2",
        )
    return list(zip(first, second, strict=True))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_or_ids(item: Any) -> bool:
    return isinstance(item, str) or (_ints(item) and bool(item))


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(item) for item in value)
