"""Loading LoRA adapters on demand, the edge: adapter_ledger.py decides, this carries it out
over HTTP and tells the ledger how it went.

`ready(model, has_room)` is asked before a request for a model is routed: for an adapter of
the `[adapters]` table that no engine taking its traffic lists, it starts the adapter's one
load (in this loader's own nursery, so a client that leaves does not cut it) and waits for
it, at most `wait_timeout` seconds; a load that failed or took longer is a 503 in OpenAI's
shape (`adapter_not_loaded`). Every other request for it meanwhile waits on the same load.
For one that engines list but none of them has room (`has_room`: the gate holds requests
back from it, or its engine queues them), it may start loading it on one more engine
(adapter_ledger.py, `replicate`) and does not wait: the request goes the usual way, and the
new engine joins the adapter's pool once loaded.

The engines' endpoints: vLLM `POST /v1/load_lora_adapter` with `{"lora_name",
"lora_path"}` and `/v1/unload_lora_adapter` with `{"lora_name"}` (a vLLM started with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); SGLang the same bodies on `/load_lora_adapter` and
`/unload_lora_adapter`. An engine whose metrics are SGLang's is asked on SGLang's paths,
any other on vLLM's; a 404 or 405 there is asked on the other's, and the paths that
answered are kept for that engine. vLLM's 400 for an adapter it "has already loaded" is a
success.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import trio

from app.errors import Refused, UpstreamError
from app.fleet.adapter_ledger import AdapterLedger, Flight, Placement
from app.fleet.backends import Backend
from app.fleet.metrics import FleetMetrics
from app.fleet.pool import BackendPool
from app.http.fetch import Fetcher
from app.models import AdapterConfig

log = logging.getLogger("sluice.adapters")

Flavour = Literal["vllm", "sglang"]
PATHS: dict[Flavour, tuple[str, str]] = {
    "vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "sglang": ("/load_lora_adapter", "/unload_lora_adapter"),
}
# An engine reads an adapter's weights from its disk (or a hub): seconds, not milliseconds.
CALL_TIMEOUT_S = 60.0
RETRY_AFTER_S = 2.0


def adapter_not_loaded(adapter: str, why: str) -> Refused:
    return Refused(
        503,
        "service_unavailable",
        "adapter_not_loaded",
        f"The LoRA adapter {adapter} could not be loaded on an engine: {why}",
        RETRY_AFTER_S,
    )


class AdapterLoader:
    def __init__(
        self,
        pool: BackendPool,
        client: Fetcher,
        table: Sequence[AdapterConfig],
        metrics: FleetMetrics,
        *,
        wait_timeout: float,
    ) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.wait_timeout = wait_timeout
        self.ledger = AdapterLedger(table)
        self._landed: dict[str, trio.Event] = {}  # by adapter: its current flight is over
        self._flavours: dict[str, Flavour] = {}  # by backend id: whose paths it answered
        self._takeoffs, self._flights = trio.open_memory_channel[Flight](math.inf)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Each flight in a task of this loader's, not of the request that started it: a
        client that leaves does not cut a load the others wait for."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for flight in self._flights:
                nursery.start_soon(self._fly, flight)

    async def ready(self, model: str | None, has_room: Callable[[Backend], bool]) -> None:
        """Return once `model` can be routed: at once for any model but an adapter of the
        table that no engine lists; for that one, once its load landed. `Refused` (503)
        when the load failed or outlasted `wait_timeout`."""
        ledger = self.ledger
        if model is None or model not in ledger.table:
            return
        now = trio.current_time()
        listing = ledger.ready_on(model, self.pool.backends, now)
        if listing:
            replica = ledger.replicate(model, listing, self.pool.backends, now, has_room)
            if replica is not None:
                self._take_off(replica)
            return
        flight = ledger.begin(model)
        if flight is not None:
            self._take_off(flight)
        flight, landed = ledger.flights[model], self._landed[model]
        with trio.move_on_after(self.wait_timeout):
            await landed.wait()
        if flight.loaded_on is not None:
            return
        why = flight.error or f"not loaded within {self.wait_timeout:g}s"
        raise adapter_not_loaded(model, why)

    def _take_off(self, flight: Flight) -> None:
        self._landed[flight.adapter] = trio.Event()
        self._takeoffs.send_nowait(flight)

    async def _fly(self, flight: Flight) -> None:
        if flight.replica_on is not None:
            await self._replicate(flight, flight.replica_on)
            return
        ledger = self.ledger
        placement = ledger.place(flight, self.pool.backends, trio.current_time())
        if placement is None:
            ledger.gave_up(flight, "no engine of its base model takes traffic")
        while placement is not None:
            failure = await self._attempt(flight.adapter, placement)
            if failure is None:
                ledger.loaded(flight, placement.backend)
                log.info("LoRA adapter %s loaded on %s", flight.adapter, placement.backend.url)
                break
            error, refused = failure
            log.warning("loading LoRA adapter %s failed: %s", flight.adapter, error)
            retry = ledger.failed(
                flight, placement, error, self.pool.backends, trio.current_time(), refused=refused
            )
            if retry is None:
                break
            await trio.sleep(retry.after_s)
            placement = retry.placement
        self._landed[flight.adapter].set()

    async def _replicate(self, flight: Flight, backend: Backend) -> None:
        """One attempt on the engine `replicate` chose; a failure waits for the next chance."""
        failure = await self._attempt(flight.adapter, Placement(backend, None))
        if failure is None:
            self.ledger.loaded(flight, backend)
            log.info(
                "LoRA adapter %s (hot) loaded on one more engine, %s", flight.adapter, backend.url
            )
        else:
            self.ledger.gave_up(flight, failure[0])
            log.warning(
                "loading hot LoRA adapter %s on one more engine failed: %s",
                flight.adapter,
                failure[0],
            )
        self._landed[flight.adapter].set()

    async def _attempt(self, adapter: str, placement: Placement) -> tuple[str, bool] | None:
        """One try: unload the victim, load the adapter. None when it is loaded; else what
        went wrong and whether the engine refused (rather than failed to answer)."""
        backend, victim = placement.backend, placement.evict
        if victim is not None:
            status, _ = await self._call(backend, 1, {"lora_name": victim})
            unloaded = status == 200
            outcome = "unloaded" if unloaded else "failed"
            self.metrics.lora_unloads.labels(backend=backend.url, outcome=outcome).inc()
            if unloaded:
                self.ledger.unloaded(backend, victim)
                log.info("LoRA adapter %s unloaded from %s to make room", victim, backend.url)
        path = self.ledger.table[adapter].path
        status, text = await self._call(backend, 0, {"lora_name": adapter, "lora_path": path})
        already = status == 400 and "already" in text.lower()
        outcome = "loaded" if status == 200 or already else "failed"
        self.metrics.lora_loads.labels(backend=backend.url, outcome=outcome).inc()
        if outcome == "loaded":
            return None
        if status is None:
            return f"{backend.url}: {text}", False
        return f"{backend.url} answered {status}: {text[:200]}", True

    async def _call(
        self, backend: Backend, which: Literal[0, 1], body: dict[str, Any]
    ) -> tuple[int | None, str]:
        """POST to the engine's load (0) or unload (1) endpoint: (status, text), or (None,
        why) when it did not answer."""
        flavour = self._flavours.get(backend.id)
        if flavour is None:
            engine = backend.engine.name if backend.engine is not None else None
            flavour = "sglang" if engine == "sglang" else "vllm"
        other: Flavour = "vllm" if flavour == "sglang" else "sglang"
        try:
            with trio.fail_after(CALL_TIMEOUT_S):
                answer = await self.client.post_json(backend.url, PATHS[flavour][which], body)
                if answer.status in (404, 405) and backend.id not in self._flavours:
                    flavour = other
                    answer = await self.client.post_json(backend.url, PATHS[other][which], body)
        except trio.TooSlowError:
            return None, f"no answer within {CALL_TIMEOUT_S:g}s"
        except UpstreamError as exc:
            return None, str(exc)
        if answer.status not in (404, 405):
            self._flavours[backend.id] = flavour
        return answer.status, answer.text
