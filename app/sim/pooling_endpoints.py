"""The simulated backend's pooling endpoints over HTTP, on the engine's load model.

Each input (or each query-document pair, which a cross-encoder reads as one prompt) is one
pooling sequence on the simulated GPU: queued, prefilled chunk by chunk with the chat
traffic, its prompt tokens counted in `vllm:prompt_tokens_total` and none generated. The
inputs of one request run at once, as vLLM submits them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from app.http.exchange import Exchange
from app.sim.inference import Handler, Inference
from app.sim.openai_format import request_error
from app.sim.pooling import (
    CLASS_LABELS,
    PoolingInput,
    class_probabilities,
    embedding,
    encode_vector,
    listing,
    read_dimensions,
    read_encoding,
    read_inputs,
    read_texts,
    relevance,
    rerank_answer,
    score_pairs,
)


@dataclass(frozen=True)
class PoolingEndpoints:
    inference: Inference

    def routes(self) -> dict[str, dict[str, Handler]]:
        """Where vLLM mounts each (the unversioned paths are its own names for them)."""
        return {
            "/v1/embeddings": {"POST": self.embeddings},
            "/pooling": {"POST": self.pooling},
            "/classify": {"POST": self.classify},
            "/v1/classify": {"POST": self.classify},
            "/score": {"POST": self.score},
            "/v1/score": {"POST": self.score},
            "/rerank": {"POST": self.rerank},
            "/v1/rerank": {"POST": self.rerank},
            "/v2/rerank": {"POST": self.rerank},
        }

    async def embeddings(self, exchange: Exchange) -> None:
        await self._vectors(exchange, "embd", "embedding", "embedding")

    async def pooling(self, exchange: Exchange) -> None:
        await self._vectors(exchange, "pool", "pooling", "data")

    async def _vectors(self, exchange: Exchange, prefix: str, object_: str, field: str) -> None:
        inference = self.inference
        payload = await inference.read_json(exchange)
        model = inference.model(payload)
        encoding = read_encoding(payload)
        dimensions = read_dimensions(payload)
        inputs = read_inputs(payload.get("input"), "input", inference.tokenizer, inference.settings)
        prompt = await self._pool(inputs)
        data = [
            {
                "index": index,
                "object": object_,
                field: encode_vector(embedding(pooled.tokens, dimensions), encoding),
            }
            for index, pooled in enumerate(inputs)
        ]
        await exchange.respond_json(200, listing(prefix, model, data, prompt))

    async def classify(self, exchange: Exchange) -> None:
        inference = self.inference
        payload = await inference.read_json(exchange)
        model = inference.model(payload)
        inputs = read_inputs(payload.get("input"), "input", inference.tokenizer, inference.settings)
        prompt = await self._pool(inputs)
        data = []
        for index, pooled in enumerate(inputs):
            probs = class_probabilities(pooled.tokens)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                {
                    "index": index,
                    "label": CLASS_LABELS[best],
                    "probs": probs,
                    "num_classes": len(probs),
                }
            )
        await exchange.respond_json(200, listing("classify", model, data, prompt))

    async def score(self, exchange: Exchange) -> None:
        payload = await self.inference.read_json(exchange)
        model = self.inference.model(payload)
        # vLLM's newer names for the two sides are accepted too.
        first = read_texts(_either(payload, "text_1", "queries"), "text_1")
        second = read_texts(_either(payload, "text_2", "documents"), "text_2")
        scores, prompt = await self._score(score_pairs(first, second))
        data = [
            {"index": index, "object": "score", "score": score}
            for index, score in enumerate(scores)
        ]
        await exchange.respond_json(200, listing("score", model, data, prompt))

    async def rerank(self, exchange: Exchange) -> None:
        payload = await self.inference.read_json(exchange)
        model = self.inference.model(payload)
        query = payload.get("query")
        if not isinstance(query, str):
            raise request_error("`query` must be a string", param="query")
        documents = read_texts(payload.get("documents"), "documents")
        top_n = payload.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise request_error("`top_n` must be a non-negative integer", param="top_n")
        scores, prompt = await self._score([(query, document) for document in documents])
        await exchange.respond_json(200, rerank_answer(model, documents, scores, prompt, top_n))

    async def _score(self, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
        """Each pair one prompt (the query's tokens, then the document's); their scores."""
        encode = self.inference.tokenizer.encode
        encoded = [(encode(first), encode(second)) for first, second in pairs]
        inputs = [PoolingInput(first + second, True) for first, second in encoded]
        limit = self.inference.settings.max_model_len
        for pooled in inputs:
            if len(pooled.tokens) > limit:
                raise request_error(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(pooled.tokens)} tokens in the input for scoring. "
                    "Please reduce the length of the input.",
                )
        prompt = await self._pool(inputs)
        return [relevance(first, second) for first, second in encoded], prompt

    async def _pool(self, inputs: Sequence[PoolingInput]) -> int:
        """Admit the request, then pool every input at once; the prompt tokens counted."""
        prompt = sum(len(pooled.tokens) for pooled in inputs)
        await self.inference.admit(prompt, as_text=any(pooled.as_text for pooled in inputs))
        engine = self.inference.engine
        async with trio.open_nursery() as nursery:
            for pooled in inputs:
                nursery.start_soon(engine.pool, pooled.tokens)
        return prompt


def _either(payload: dict[str, Any], name: str, other: str) -> Any:
    return payload[name] if name in payload else payload.get(other)
