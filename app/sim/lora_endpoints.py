"""Loading and unloading LoRA adapters over HTTP, as vLLM and SGLang answer it.

vLLM (`vllm/entrypoints/openai/models/serving.py`, served when `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
is set, which the sim takes as given once LoRA is on): `POST /v1/load_lora_adapter` with
`lora_name` and `lora_path` (and `load_inplace`), `POST /v1/unload_lora_adapter` with
`lora_name`. A success is 200 with a plain sentence and no content type; a refusal is the
OpenAI error body: 400 `InvalidUserInput` for a missing field or a name already loaded, 404
`NotFoundError` for unloading an unknown name. Loads and unloads of one name are serialized
(vLLM's `lora_resolver_lock[name]`): of two concurrent loads of a new name one loads, the other
then finds it loaded and gets the 400. A load takes `--lora-load-time`.

SGLang (`tokenizer_manager.py`, with `--metrics-style sglang`): `POST /load_lora_adapter` and
`POST /unload_lora_adapter` answer `{"success", "error_message", "loaded_adapters"}`, 200 or
400; every update waits for one lock, and `--max-cpu-loras` plays SGLang's `max_loaded_loras`,
refusing a load beyond it instead of evicting.

The sim has no weights to read: any path loads.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import trio

from app.errors import ClientError
from app.http.exchange import Exchange
from app.preprocess.json_bodies import parse_json_object
from app.sim.inference import MAX_BODY_BYTES, Handler
from app.sim.lora import LoraRegistry
from app.sim.openai_format import request_error
from app.sim.settings import SimSettings


class LoraEndpoints:
    def __init__(self, settings: SimSettings, registry: LoraRegistry, created: int) -> None:
        self.settings = settings
        self.registry = registry
        self.created = created
        self._names: defaultdict[str, trio.Lock] = defaultdict(trio.Lock)
        self._sglang_updates = trio.Lock()
        for name, path in settings.lora_adapters:
            registry.register(name, path)  # vLLM loads them before it serves

    def routes(self) -> dict[str, dict[str, Handler]]:
        routes: dict[str, dict[str, Handler]] = {
            "/v1/load_lora_adapter": {"POST": self._load},
            "/v1/unload_lora_adapter": {"POST": self._unload},
        }
        if self.settings.metrics_style == "sglang":
            routes["/load_lora_adapter"] = {"POST": self._sglang_load}
            routes["/unload_lora_adapter"] = {"POST": self._sglang_unload}
        return routes

    def model_cards(self) -> list[dict[str, Any]]:
        """vLLM's cards of the loaded adapters: `root` the path, `parent` the base model."""
        return [
            {
                "id": adapter.name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": adapter.path,
                "parent": self.settings.served_models[0],
                "max_model_len": None,
            }
            for adapter in self.registry.adapters.values()
        ]

    async def _load(self, exchange: Exchange) -> None:
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        name, path = _text(payload, "lora_name"), _text(payload, "lora_path")
        inplace = payload.get("load_inplace") is True
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._names[name]:
            if not inplace and self.registry.get(name) is not None:
                raise _invalid(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
            await trio.sleep(self.settings.lora_load_time)
            self.registry.register(name, path, inplace=inplace)
        await _sentence(exchange, f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, exchange: Exchange) -> None:
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        name = _text(payload, "lora_name")
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._names[name]:
            if self.registry.get(name) is None:
                raise request_error(
                    f"The lora adapter '{name}' cannot be found.",
                    status=404,
                    type_="NotFoundError",
                    code=404,
                )
            self.registry.unregister(name)
        await _sentence(exchange, f"Success: LoRA adapter '{name}' removed successfully.")

    async def _sglang_load(self, exchange: Exchange) -> None:
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        name, path = _text(payload, "lora_name"), _text(payload, "lora_path")
        registry = self.registry
        async with self._sglang_updates:
            if len(registry.adapters) >= registry.max_cpu_loras:
                problem = (
                    f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded "
                    f"LoRA adapters is {registry.max_cpu_loras}. Please unload some LoRA "
                    "adapters before loading new ones."
                )
            elif registry.get(name) is not None:
                problem = f"Failed to load LoRA adapter {name} because it is already loaded"
            else:
                problem = None
                await trio.sleep(self.settings.lora_load_time)
                registry.register(name, path)
        await self._sglang_answer(exchange, problem)

    async def _sglang_unload(self, exchange: Exchange) -> None:
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        name = _text(payload, "lora_name")
        registry = self.registry
        async with self._sglang_updates:
            if registry.get(name) is None:
                problem: str | None = (
                    f"LoRA with name {name} does not exist. "
                    f"Loaded LoRAs: {registry.adapters.keys()}"
                )
            else:
                problem = None
                registry.unregister(name)
        await self._sglang_answer(exchange, problem)

    async def _sglang_answer(self, exchange: Exchange, problem: str | None) -> None:
        loaded = {adapter.name: adapter.path for adapter in self.registry.adapters.values()}
        await exchange.respond_json(
            400 if problem else 200,
            {
                "success": problem is None,
                "error_message": problem,
                "loaded_adapters": None if problem else loaded,
            },
        )


def _text(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    return value if isinstance(value, str) else ""


def _invalid(message: str) -> ClientError:
    return request_error(message, type_="InvalidUserInput")


async def _sentence(exchange: Exchange, text: str) -> None:
    # FastAPI's `Response(content=...)` with no media type: no Content-Type header.
    await exchange.respond(200, [], text.encode())
