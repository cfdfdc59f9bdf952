"""A disaggregated answer's usage as the prefill engine computed it. Pure.

A decode engine counts the whole transferred prompt as cached: its `cached_tokens` says
what the transfer brought, not what any prefix cache saved. The client, the key's budget
and the routing checks want the prefill engine's figure, so the decode's answer passes
through `PrefillCachedTokens`, which writes that figure over every `"cached_tokens": N` it
carries (the usage object at the end of a body, or in the last events of a stream).

It works a line at a time: what follows a read's last newline waits for the next read (or
the end), so a number split between two reads is still whole when it is rewritten. Event
streams end every event with a newline, so nothing of a stream is held back in practice;
an unstreamed answer's body is rewritten once it is whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from app.proxy.relay import Converter

_CACHED = re.compile(rb'("cached_tokens"\s*:\s*)\d+')
_NAME = b'"cached_tokens"'


@dataclass(slots=True)
class PrefillFigure:
    """The prefill engine's cached prompt tokens, once its answer came (SGLang's legs run
    side by side: the decode's answer may start first). None: not known (yet)."""

    cached_tokens: int | None = None


class PrefillCachedTokens:
    __slots__ = ("_figure", "_held")

    def __init__(self, figure: PrefillFigure) -> None:
        self._figure = figure
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        data = self._held + data if self._held else data
        cut = data.rfind(b"\n") + 1
        self._held = data[cut:]
        return self._rewrite(data[:cut]) if cut else b""

    def finish(self) -> bytes:
        rest, self._held = self._held, b""
        return self._rewrite(rest)

    def _rewrite(self, data: bytes) -> bytes:
        cached = self._figure.cached_tokens
        if cached is None or _NAME not in data:
            return data
        return _CACHED.sub(rb"\g<1>%d" % cached, data)


class Chained:
    """Converters one after another: each feeds the next what it let through."""

    __slots__ = ("_converters",)

    def __init__(self, converters: Sequence[Converter]) -> None:
        self._converters = tuple(converters)

    def feed(self, data: bytes) -> bytes:
        for converter in self._converters:
            data = converter.feed(data)
        return data

    def finish(self) -> bytes:
        data = b""
        for converter in self._converters:
            data = converter.feed(data) + converter.finish() if data else converter.finish()
        return data
