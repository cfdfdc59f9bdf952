"""What every inference endpoint of the simulated backend shares, in one place.

Reading a request (the `hang` fault holds it after its body arrived, as a stuck engine
would), the model it names (vLLM's 404 for another), the monolithic server's own
preprocessing time for prompts sent as text, and the drawn `error_rate` 500: chat and
completions, the Responses and Messages APIs, the pooling endpoints and transcriptions all
meet the same faults and the same engine. The generating endpoints that disaggregation
serves (chat, completions, Responses) ask `leg` how the engine runs a request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from app.http.exchange import Exchange
from app.preprocess.json_bodies import parse_json_object
from app.sim.disaggregation import Disaggregation
from app.sim.engine import SimEngine
from app.sim.faults import SimFaults
from app.sim.generation import stream_sse
from app.sim.kv_transfer import Leg
from app.sim.lora import REQUEST_ADAPTER
from app.sim.openai_format import answering_model, request_error
from app.sim.settings import SimSettings
from app.sim.tokens import TextTokenizer, generated_pieces

MAX_BODY_BYTES = 32 * 1024 * 1024

Handler = Callable[[Exchange], Awaitable[None]]


@dataclass(eq=False)
class Inference:
    """The engine, tokenizer, settings and faults one simulated backend answers with."""

    settings: SimSettings
    tokenizer: TextTokenizer
    engine: SimEngine
    faults: SimFaults
    pd: Disaggregation
    # One GIL: a monolithic server preprocesses one request at a time.
    _preprocessing: trio.Lock = field(default_factory=trio.Lock, init=False)

    async def read_body(self, exchange: Exchange) -> bytes:
        body = await exchange.read_body(MAX_BODY_BYTES)
        if self.faults.hang:
            await trio.sleep_forever()  # until the client leaves (the server cancels us)
        return body

    async def read_json(self, exchange: Exchange) -> dict[str, Any]:
        return parse_json_object(await self.read_body(exchange))

    def model(self, payload: dict[str, Any]) -> str:
        """The name the answer carries; a loaded LoRA adapter's name also sets the adapter
        this task's request runs under (lora.py's REQUEST_ADAPTER), anything else the base."""
        requested = payload.get("model")
        lora = self.engine.lora
        adapter = lora.get(requested) if lora is not None and isinstance(requested, str) else None
        REQUEST_ADAPTER.set(None if adapter is None else adapter.tag)
        return answering_model(payload, self.settings) if adapter is None else adapter.name

    async def stream(
        self,
        exchange: Exchange,
        prompt: Sequence[int],
        output_tokens: int,
        *,
        token: Callable[[int], bytes],
        tail: Callable[[int], bytes],
        head: bytes = b"",
        leg: Leg | None = None,
    ) -> None:
        """`stream_sse` on this backend's engine, cut mid-stream when its fault says so."""
        await stream_sse(
            exchange,
            self.engine,
            prompt,
            output_tokens,
            self.faults.close_mid_stream,
            head=head,
            token=token,
            tail=tail,
            leg=leg,
        )

    async def leg(self, payload: dict[str, Any], prompt: Sequence[int], exchange: Exchange) -> Leg:
        """How the engine runs this request in a disaggregated fleet (disaggregation.py)."""
        return await self.pd.leg(payload, prompt, exchange)

    async def admit(self, prompt_tokens: int, *, as_text: bool = True) -> None:
        """The server's own work before the engine: preprocessing, then the error fault."""
        if as_text and self.settings.preprocess_per_token:
            async with self._preprocessing:
                await trio.sleep(self.settings.preprocess_per_token * prompt_tokens)
        if self.faults.draw_error():
            raise request_error(
                "Simulated internal server error",
                status=500,
                type_="InternalServerError",
                code=500,
            )

    def pieces(self, prompt: Sequence[int]) -> Iterator[str]:
        """The reproducible output text of a prompt, one piece per token."""
        return generated_pieces(prompt, self.settings.seed)
