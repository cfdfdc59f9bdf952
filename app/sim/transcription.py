"""`POST /v1/audio/transcriptions` (and `/v1/audio/translations`, the same shapes) as vLLM
serves it, for any audio at all.

The form is read strictly (multipart.py); the audio is not decoded. Its bytes become the
prompt: one token per 20 ms of audio taken as 16 kHz 16-bit mono PCM (a speech encoder's
frame rate), each id a checksum of its 640 bytes, so the same file is the same prompt (and
hits the prefix cache) and its transcript, the generated words of that prompt, is the same
every time. The prompt and the transcript go through the engine like any generation.

Shapes as vLLM's (vllm/entrypoints/speech_to_text): `json` is `{"text", "usage": {"type":
"duration", "seconds"}}`; `verbose_json` adds the duration, language and segments; `text`
is answered with the same JSON as `json`, as vLLM does (its router serialises every
non-streaming answer as JSON); `stream=true` sends `transcription.chunk` events and
`data: [DONE]`.
"""

from __future__ import annotations

import math
import time
import uuid
import zlib
from typing import Any

from app.http.exchange import Exchange
from app.sim.generation import collect, sse_data
from app.sim.inference import Inference
from app.sim.multipart import FormError, FormPart, boundary_of, read_form
from app.sim.openai_format import check_context_length, request_error
from app.sim.tokens import VOCAB_SIZE

# 16 kHz, 16-bit, mono: the bytes of one second of audio as the sim reckons its duration.
BYTES_PER_SECOND = 32_000
BYTES_PER_TOKEN = 640  # 20 ms
FORMATS = ("json", "text", "verbose_json")
# FastAPI's reading of a form boolean.
_TRUE = frozenset({"1", "true", "on", "yes", "t", "y"})
_FALSE = frozenset({"0", "false", "off", "no", "f", "n"})


def audio_prompt(audio: bytes) -> list[int]:
    """One token id per 20 ms of audio, at least one."""
    chunks = range(0, max(len(audio), 1), BYTES_PER_TOKEN)
    return [zlib.crc32(audio[at : at + BYTES_PER_TOKEN]) % VOCAB_SIZE for at in chunks]


class TranscriptionEndpoint:
    def __init__(self, inference: Inference) -> None:
        self.inference = inference

    async def transcribe(self, exchange: Exchange) -> None:
        inference = self.inference
        body = await inference.read_body(exchange)
        try:
            parts = read_form(body, boundary_of(exchange.header(b"content-type")))
            fields = {part.name: part for part in parts}
            audio = _audio(fields.get("file"))
            text_fields = {name: part.text() for name, part in fields.items() if name != "file"}
        except FormError as exc:
            raise request_error(f"Invalid multipart/form-data: {exc}") from None
        model = inference.model({"model": text_fields.get("model")})
        response_format = text_fields.get("response_format") or "json"
        if response_format not in FORMATS:
            raise request_error(
                "Currently only support response_format: `text`, `json` or `verbose_json`",
                param="response_format",
            )
        stream = _boolean(text_fields, "stream")
        if stream and response_format == "verbose_json":
            raise request_error("verbose_json format doesn't support streaming case")
        limit = _positive(text_fields, "max_completion_tokens")
        output_tokens = limit or inference.settings.default_max_tokens
        prompt = audio_prompt(audio)
        check_context_length(inference.settings, len(prompt), output_tokens, "prompt")
        await inference.admit(len(prompt), as_text=False)
        pieces = inference.pieces(prompt)
        seconds = len(audio) / BYTES_PER_SECOND
        if stream:
            chunks = _Chunks(model, "length" if limit else "stop", output_tokens)
            include_usage = _boolean(text_fields, "stream_include_usage")
            await inference.stream(
                exchange,
                prompt,
                output_tokens,
                token=lambda index: sse_data(chunks.token(index, next(pieces))),
                tail=lambda _cached: chunks.tail(len(prompt), include_usage),
            )
            return
        text, _cached = await collect(inference.engine, prompt, output_tokens, pieces)
        if response_format == "verbose_json":
            language = text_fields.get("language") or "en"
            await exchange.respond_json(200, _verbose(text, seconds, language))
        else:
            usage = {"type": "duration", "seconds": math.ceil(seconds)}
            await exchange.respond_json(200, {"text": text, "usage": usage})


def _audio(part: FormPart | None) -> bytes:
    if part is None:
        raise FormError("the `file` field is missing")
    if part.filename is None:
        raise FormError("`file` must be a file upload, not a text field")
    return part.data


def _boolean(fields: dict[str, str], name: str) -> bool:
    value = fields.get(name, "false").strip().lower()
    if value not in _TRUE | _FALSE:
        raise request_error(f"`{name}` must be a boolean", param=name)
    return value in _TRUE


def _positive(fields: dict[str, str], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise request_error(f"`{name}` must be a positive integer", param=name)
    return int(value)


def _verbose(text: str, seconds: float, language: str) -> dict[str, Any]:
    segment: dict[str, Any] = {
        "id": 0,
        "avg_logprob": -0.25,
        "compression_ratio": 1.0,
        "end": seconds,
        "no_speech_prob": None,
        "seek": 0,
        "start": 0.0,
        "temperature": 0.0,
        "text": text,
        "tokens": [],
    }
    return {
        "duration": seconds,
        "language": language,
        "text": text,
        "segments": [segment],
        "words": None,
    }


class _Chunks:
    """vLLM's `transcription.chunk` stream events of one answer."""

    def __init__(self, model: str, finish_reason: str, output_tokens: int) -> None:
        self.id = f"trsc-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.finish_reason = finish_reason
        self.last = output_tokens - 1
        self.output_tokens = output_tokens

    def token(self, index: int, piece: str) -> dict[str, Any]:
        finish_reason = self.finish_reason if index == self.last else None
        choice = {"delta": {"content": piece}, "finish_reason": finish_reason, "stop_reason": None}
        return self._chunk([choice])

    def tail(self, prompt_tokens: int, include_usage: bool) -> bytes:
        done = b"data: [DONE]\n\n"
        if not include_usage:
            return done
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": prompt_tokens + self.output_tokens,
        }
        return sse_data(self._chunk([], usage=usage)) + done

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "transcription.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
