"""Test doubles shared by several test modules."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
import trio.testing
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from app.http.client import UpstreamResponse
from app.http.connection import ClientConnection
from app.http.exchange import Exchange, read_into
from app.http.fields import Headers
from app.http.relay_hub import RelayHub
from app.http.streams import ByteStream
from app.preprocess.pipeline import Prepared, Preprocessor
from app.preprocess.request_bodies import Kind
from app.preprocess.tokenizer_loading import EncodingLike, TokenizerLike
from app.proxy.relay import Passage, reply_from


async def prepare(
    preprocessor: Preprocessor, kind: Kind, payload: dict[str, Any], **options: Any
) -> Prepared:
    """`Preprocessor.prepare` on the body a client would send for `payload`."""
    return await preprocessor.prepare(kind, json.dumps(payload).encode(), **options)


async def read_exchange(stream: ByteStream, deadline: float) -> Exchange:
    """The first request on `stream`, its head read as the server's task (server.py) reads
    it, as an exchange with its handler to be."""
    connection = ClientConnection()
    with trio.fail_at(deadline):
        while (request := connection.next_request(trio.current_time())) is None:
            await read_into(connection, stream)
    return Exchange(connection, stream, request)


class GateTokenizer:
    """The default tokenizer, but GATE texts wait for `gate` in encode_batch_fast."""

    def __init__(self, real: TokenizerLike) -> None:
        self._real = real
        self.gate = threading.Event()
        self.encoded_chars = 0  # characters given to encode_batch_fast, all calls together
        self._arrivals = threading.Semaphore(0)  # one release per GATE text at the gate

    def encode(
        self,
        sequence: Any,
        pair: Any = None,
        is_pretokenized: bool = False,
        add_special_tokens: bool = True,
    ) -> EncodingLike:
        return self._real.encode(sequence, add_special_tokens=add_special_tokens)

    def encode_batch_fast(
        self, input: Sequence[Any], is_pretokenized: bool = False, add_special_tokens: bool = True
    ) -> Sequence[EncodingLike]:
        self.encoded_chars += sum(len(text) for text in input)
        if any("GATE" in text for text in input):
            self._arrivals.release()
            assert self.gate.wait(timeout=10), "the test never opened the gate"
        return self._real.encode_batch_fast(input, add_special_tokens=add_special_tokens)

    async def arrived(self) -> None:
        """Return once a worker thread waits at the gate (Trio cannot see threads block)."""
        await trio.to_thread.run_sync(self._arrivals.acquire)
        await trio.testing.wait_all_tasks_blocked()

    def get_added_tokens_decoder(self) -> Any:
        return self._real.get_added_tokens_decoder()

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._real.get_vocab_size(with_added_tokens)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return self._real.get_vocab(with_added_tokens)

    @property
    def normalizer(self) -> Any:
        return self._real.normalizer

    @property
    def decoder(self) -> Any:
        return self._real.decoder


def write_word_tokenizer(path: Path, words: Sequence[str] = ()) -> Path:
    """A second tokenizer, unlike the bundled one: a word a token (any word it does not know
    is its unknown token), ChatML's special tokens, so the shipped ChatML template fits it.
    Written as `path`/tokenizer.json; returns that file."""
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


async def relay(
    response: UpstreamResponse,
    exchange: Exchange,
    extra_headers: Headers,
    idle: float,
    hub: RelayHub,
) -> Passage:
    """What the proxy does with a backend's answer: its reply sent to the client, and its
    passage (its tail, whether it broke) returned. (The proxy then releases the response,
    whatever happened; the caller does here.)"""
    reply, passage = await reply_from(response, extra_headers, idle, hub)
    await exchange.send(reply)
    return passage
