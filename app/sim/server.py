"""The simulated GPU server: vLLM's HTTP surface over the simulated engine.

It is served by the proxy's own HTTP/1.1 server (app/http/server.py), as lean as a
real engine's uvicorn: a simulated backend on hypercorn spent ~95 µs of CPU per streamed
token, so at 200 streams its own loop, not its GPU model, set the pace of every benchmark
run against it.

Endpoints, as vLLM answers them: `POST /v1/chat/completions`, `POST /v1/completions`,
`POST /v1/responses` with `GET`/`DELETE /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` (responses_endpoints.py), Anthropic's `POST /v1/messages`
(messages_api.py), the pooling endpoints `POST /v1/embeddings`, `/rerank`, `/score`,
`/classify`, `/pooling` (pooling_endpoints.py), `POST /v1/audio/transcriptions` and
`/translations` (transcription.py), `POST /tokenize`, `POST /detokenize`, `GET /v1/models`,
`GET /health`, `GET /metrics`, `GET /version`; with `--max-loras`, vLLM's LoRA adapter
endpoints (lora_endpoints.py; SGLang's too with `--metrics-style sglang`). An unknown path
is FastAPI's `{"detail": "Not Found"}` 404 and a known one with another method its 405, as from vLLM
(whose exception handler is registered for FastAPI's `HTTPException`, which Starlette's
routing 404 and 405 are not).

Three of its own: `POST /sim/faults` to change the faults at run time, `POST /sim/evict` to
empty the prefix cache (as memory pressure would; told as `AllBlocksCleared` to KV event
subscribers), `GET /sim/state` for the engine's numbers as JSON, plus what tests of a proxy
need to see: how many /tokenize calls came, in which form the prompts arrived (messages,
text or token ids) and the W3C `traceparent` headers of the latest requests. With
`--kv-events-endpoint` it publishes vLLM's KV-cache events (`kv_publisher.py`).

With `--role prefill|decode` it plays one side of prefill/decode disaggregation
(disaggregation.py): a vLLM prefill engine answers `POST /sim/kv_transfer/take`, an SGLang
one runs a bootstrap server, and `GET /get_server_info` reports `disaggregation_mode` and
`disaggregation_bootstrap_port` as SGLang's does.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from functools import partial
from typing import Any

import trio

from app.errors import ClientError
from app.http.exchange import Exchange
from app.http.server import HttpServer
from app.preprocess.json_bodies import parse_json_object
from app.sim.disaggregation import Disaggregation
from app.sim.engine import SimEngine
from app.sim.faults import SimFaults
from app.sim.generation import answer_stream, answer_whole
from app.sim.inference import MAX_BODY_BYTES, Handler, Inference
from app.sim.kv_publisher import SimKvPublisher
from app.sim.lora_endpoints import LoraEndpoints
from app.sim.messages_api import MessagesEndpoints
from app.sim.metrics import SimMetrics
from app.sim.openai_format import (
    Kind,
    PromptForm,
    ResponseShapes,
    chat_prompt_text,
    parse_generation,
    request_error,
)
from app.sim.pooling_endpoints import PoolingEndpoints
from app.sim.responses_endpoints import ResponsesEndpoints
from app.sim.settings import SimSettings
from app.sim.tokens import TextTokenizer, sim_tokenizer
from app.sim.transcription import TranscriptionEndpoint

# What `GET /version` reports; SMG asks for it when it registers a worker.
VERSION = "0.0.0+sluice.sim"
# Where the imitated engine states how many sequences it runs at once (app/fleet/engine_limits.py).
STATED_LIMIT_PATHS = {"sglang": "/get_server_info", "llamacpp": "/props", "tgi": "/info"}
# How many requests' `traceparent` headers /sim/state shows.
TRACEPARENTS_KEPT = 1000

JSON = [(b"content-type", b"application/json")]


def stated_about(settings: SimSettings) -> dict[str, Any]:
    """What the imitated engine says about itself where it states its limit (a few of its
    fields): SGLang's /get_server_info, llama.cpp's /props, TGI's /info (whose
    `max_batch_size` is null unless TGI was given one, as by default)."""
    model, seqs = settings.served_models[0], settings.max_num_seqs
    if settings.metrics_style == "sglang":
        state = {"effective_max_running_requests_per_dp": seqs, "last_gen_throughput": 0.0}
        return {"model_path": model, "max_running_requests": None, "dp_size": 1,
                "internal_states": [state], "version": VERSION}  # fmt: skip
    if settings.metrics_style == "llamacpp":
        return {"model_alias": model, "total_slots": seqs, "build_info": VERSION}
    return {"model_id": model, "max_batch_size": None, "max_concurrent_requests": 128,
            "version": VERSION}  # fmt: skip


class SimServer:
    """The handler of one simulated backend; its engine and faults are open to inspection."""

    def __init__(self, settings: SimSettings, tokenizer: TextTokenizer | None = None) -> None:
        self.settings = settings
        self.tokenize_requests = 0
        self.prompts_by_form: dict[PromptForm, int] = {"messages": 0, "text": 0, "token_ids": 0}
        self.traceparents: deque[str] = deque(maxlen=TRACEPARENTS_KEPT)
        self.engine = SimEngine(settings)
        self.faults = SimFaults.from_settings(settings)
        self.kv_publisher: SimKvPublisher | None = None
        if settings.kv_events_endpoint:
            self.kv_publisher = SimKvPublisher(
                settings.kv_events_endpoint, settings.kv_events_replay_endpoint, self.faults
            )
            self.engine.kv_cache.on_events = self.kv_publisher.publish
        self.created = int(time.time())
        self.pd = Disaggregation(settings, self.engine)
        lora = self.engine.lora
        self.lora = None if lora is None else LoraEndpoints(settings, lora, self.created)
        self.metrics = SimMetrics(self.engine, settings, self.pd.counters)
        # Every inference endpoint answers through this one: one engine, one set of faults,
        # one preprocessing lock.
        self.inference = Inference(
            settings,
            tokenizer or sim_tokenizer(settings.tokenize_with),
            self.engine,
            self.faults,
            self.pd,
        )
        self.responses = ResponsesEndpoints(self.inference)
        transcription = TranscriptionEndpoint(self.inference)
        messages = MessagesEndpoints(self.inference)
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": partial(self._generate, "chat")},
            "/v1/completions": {"POST": partial(self._generate, "completion")},
            "/v1/responses": {"POST": self.responses.create},
            "/v1/audio/transcriptions": {"POST": transcription.transcribe},
            # vLLM's translations endpoint answers in the same shapes; the sim's words are
            # no language in particular.
            "/v1/audio/translations": {"POST": transcription.transcribe},
            "/v1/messages": {"POST": messages.create},
            "/v1/messages/count_tokens": {"POST": messages.count_tokens},
            **PoolingEndpoints(self.inference).routes(),
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/version": {"GET": self._version},
            "/sim/faults": {"POST": self._set_faults},
            "/sim/state": {"GET": self._state},
            "/sim/evict": {"POST": self._evict},
            **self.pd.routes(),
            **(self.lora.routes() if self.lora else {}),
        }
        if settings.metrics_style in STATED_LIMIT_PATHS:
            self._routes[STATED_LIMIT_PATHS[settings.metrics_style]] = {"GET": self._about}
        if settings.pd_protocol == "sglang":
            self._routes["/get_server_info"] = {"GET": self._about}

    async def __call__(self, exchange: Exchange) -> None:
        traceparent = exchange.header(b"traceparent")
        if traceparent is not None:
            self.traceparents.append(traceparent.decode("latin-1"))
        methods = self._routes.get(exchange.path) or self.responses.route(exchange.path)
        if methods is None:
            await exchange.respond_json(404, {"detail": "Not Found"})
            return
        handler = methods.get(exchange.method)
        if handler is None and exchange.method == "HEAD":
            handler = methods.get("GET")  # Starlette answers HEAD wherever GET is routed
        if handler is None:
            allowed = ", ".join([*methods, *(["HEAD"] if "GET" in methods else [])]).encode()
            await exchange.respond_json(
                405, {"detail": "Method Not Allowed"}, [(b"allow", allowed)]
            )
            return
        try:
            await handler(exchange)
        except ClientError as exc:
            if not exchange.started:
                await exchange.respond_error(exc)

    async def _generate(self, kind: Kind, exchange: Exchange) -> None:
        inference = self.inference
        payload = await inference.read_json(exchange)
        model = inference.model(payload)
        request = parse_generation(kind, payload, self.inference.tokenizer, self.settings)
        self.prompts_by_form[request.prompt_form] += 1
        as_text = request.prompt_form != "token_ids"
        await inference.admit(len(request.prompt_tokens), as_text=as_text)
        leg = await inference.leg(payload, request.prompt_tokens, exchange)
        if leg.output_tokens is not None:
            request = dataclasses.replace(
                request, output_tokens=leg.output_tokens, finish_reason="length"
            )
        shapes = ResponseShapes(kind, model)
        pieces = inference.pieces(request.prompt_tokens)
        if request.stream:
            drop = self.faults.close_mid_stream
            await answer_stream(request, shapes, self.engine, pieces, drop, exchange, leg)
        else:
            await answer_whole(request, shapes, self.engine, pieces, exchange, leg)

    async def _models(self, exchange: Exchange) -> None:
        # As vLLM lists its served names: one card each, all rooted in the same weights.
        served = self.settings.served_models
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": served[0],
                "parent": None,
                "max_model_len": self.settings.max_model_len,
            }
            for name in served
        ]
        if self.lora is not None:
            cards += self.lora.model_cards()
        await exchange.respond_json(200, {"object": "list", "data": cards})

    async def _health(self, exchange: Exchange) -> None:
        await exchange.respond(503 if self.faults.unhealthy else 200, JSON, b"")

    async def _metrics(self, exchange: Exchange) -> None:
        text_plain = [(b"content-type", b"text/plain; version=0.0.4")]
        await exchange.respond(200, text_plain, self.metrics.exposition())

    async def _version(self, exchange: Exchange) -> None:
        await exchange.respond_json(200, {"version": VERSION})

    async def _about(self, exchange: Exchange) -> None:
        if exchange.path != "/get_server_info":
            await exchange.respond_json(200, stated_about(self.settings))
            return
        # SGLang's, whatever the metrics style: every server argument, these two among them.
        about = stated_about(dataclasses.replace(self.settings, metrics_style="sglang"))
        about["disaggregation_mode"] = self.pd.mode
        about["disaggregation_bootstrap_port"] = (
            self.pd.bootstrap_port or self.settings.bootstrap_port
        )
        await exchange.respond_json(200, about)

    async def _tokenize(self, exchange: Exchange) -> None:
        self.tokenize_requests += 1
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        self.inference.model(payload)  # vLLM's /tokenize checks the model too
        if "messages" in payload:
            text = chat_prompt_text(payload)
        elif isinstance(payload.get("prompt"), str):
            text = payload["prompt"]
        else:
            raise request_error("send a string `prompt` or a list of `messages`", param="prompt")
        tokens = self.inference.tokenizer.encode(text)
        await exchange.respond_json(
            200,
            {
                "count": len(tokens),
                "max_model_len": self.settings.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            },
        )

    async def _detokenize(self, exchange: Exchange) -> None:
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        self.inference.model(payload)
        tokens = payload.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(token, int) and not isinstance(token, bool) for token in tokens
        ):
            raise request_error("`tokens` must be a list of token ids", param="tokens")
        tokenizer = self.inference.tokenizer
        out_of_range = [token for token in tokens if not 0 <= token < tokenizer.vocab_size]
        if out_of_range:
            raise request_error(f"Token id {out_of_range[0]} is out of vocabulary", param="tokens")
        await exchange.respond_json(200, {"prompt": tokenizer.decode(tokens)})

    async def _set_faults(self, exchange: Exchange) -> None:
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        try:
            self.faults.update(payload)
        except ValueError as exc:
            raise request_error(str(exc)) from None
        await exchange.respond_json(200, self.faults.as_dict())

    async def _evict(self, exchange: Exchange) -> None:
        """Drop every cached prefix no running sequence holds, as memory pressure would."""
        evicted = self.engine.kv_cache.evict_all()
        await exchange.respond_json(200, {"evicted_blocks": evicted})

    async def _state(self, exchange: Exchange) -> None:
        await exchange.respond_json(200, self.state())

    def state(self) -> dict[str, Any]:
        kv_cache = self.engine.kv_cache
        return {
            "models": list(self.settings.served_models),
            "running": self.engine.running,
            "waiting": self.engine.waiting,
            "steps": self.engine.steps,
            "kv_cache_usage_perc": kv_cache.usage,
            "prefix_cache_queries": kv_cache.query_tokens,
            "prefix_cache_hits": kv_cache.hit_tokens,
            "prompt_tokens": self.engine.prompt_tokens_total,
            "generation_tokens": self.engine.generation_tokens_total,
            "tokenize_with": self.settings.tokenize_with,
            "tokenize_requests": self.tokenize_requests,
            "prompts_by_form": dict(self.prompts_by_form),
            "faults": self.faults.as_dict(),
            "stored_responses": len(self.responses.store),
            "pd": {
                "role": self.settings.role,
                "flow": self.settings.pd_protocol,
                "engine_id": self.pd.engine_id,
                "held_transfers": len(self.pd.held),
                "bootstrap_port": self.pd.bootstrap_port,
            },
            "lora": None if self.engine.lora is None else self.engine.lora.state(),
            "traceparents": list(self.traceparents),
            "kv_events": None
            if self.kv_publisher is None
            else {
                "endpoint": self.kv_publisher.endpoint,
                "replay_endpoint": self.kv_publisher.replay_endpoint,
                "published": self.kv_publisher.published,
            },
        }


def create_sim_app(settings: SimSettings, tokenizer: TextTokenizer | None = None) -> SimServer:
    return SimServer(settings, tokenizer)


async def serve_sim(
    settings: SimSettings,
    *,
    app: SimServer | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a simulated backend until cancelled; reports its base URL, e.g. for port 0.

    Pass `app` to keep a handle on the server (its engine and faults) while it serves.
    """
    server = app or create_sim_app(settings)
    async with trio.open_nursery() as nursery:
        if server.kv_publisher is not None:
            await nursery.start(server.kv_publisher.run)
        await nursery.start(server.engine.run)
        await nursery.start(server.responses.run)
        await nursery.start(server.pd.run)
        url: str = await nursery.start(
            HttpServer(server).serve, settings.host, settings.port, settings.backlog
        )
        server.pd.serving(url)
        task_status.started(url)
