"""Prefill/decode disaggregation on the simulated engine, the I/O part: a vLLM decode
engine's pull from its prefill engine (`POST /sim/kv_transfer/take` there), an SGLang prefill
engine's bootstrap server where decode engines wait for their rooms, the task that lets held
KV expire, and the receiving of a transferred prompt.

Design rules:
1. What a request asks and what the table holds are decided in kv_transfer.py; this module
   only talks and waits.
2. Receiving KV takes `kv_transfer_per_token` per prompt token on the decode engine, outside
   the GPU's steps (a NIXL read does not stall the batch), before the sequence arrives
   prefilled.
3. vLLM's flow recovers: a pull that fails (unreachable, unknown, expired) is counted
   `unusable` and the prompt is prefilled locally, as vLLM's `kv_load_failure_policy`
   "recompute" does. SGLang's does not: a room that never comes, or a bootstrap server that
   cannot be reached, fails the request with a 500, as SGLang aborts it.
4. A client that leaves cancels the pull or the wait with its request; the prefill's blocks
   are then released by their expiry, not by the decode engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from app.errors import ClientError, UpstreamError
from app.http.exchange import Exchange
from app.http.fetch import Fetcher
from app.http.server import HttpServer
from app.preprocess.json_bodies import parse_json_object
from app.sim.engine import SimEngine
from app.sim.kv_cache import KVAllocation
from app.sim.kv_transfer import (
    Aggregated,
    Bootstrap,
    Held,
    HoldForDecode,
    Leg,
    PdCounters,
    Recompute,
    RemotePrefill,
    TransferTable,
    answer_params,
    plan_leg,
)
from app.sim.openai_format import request_error
from app.sim.settings import SimSettings

TAKE_PATH = "/sim/kv_transfer/take"
ROOM_PATH = "/sim/bootstrap/room"
MAX_BODY_BYTES = 1 << 20
# Addresses a server listens on that a peer cannot dial: advertised as loopback.
ANY_ADDRESS = ("", "0.0.0.0", "::")


class Disaggregation:
    """One engine's side of disaggregation: its plans, its held KV, its counters."""

    def __init__(self, settings: SimSettings, engine: SimEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.engine_id = f"sim-{uuid.uuid4().hex[:16]}"
        self.held = TransferTable(
            settings.kv_transfer_timeout, settings.kv_cache_blocks, settings.block_size
        )
        self.counters = PdCounters()
        self.host = "127.0.0.1" if settings.host in ANY_ADDRESS else settings.host
        self.port = settings.port  # the bound one once serving (`serving`)
        self.bootstrap_port: int | None = None
        self._changed = trio.Event()
        self._fetcher = Fetcher(
            connect_timeout=settings.kv_transfer_timeout, max_idle_per_backend=16
        )

    @property
    def runs_bootstrap_server(self) -> bool:
        return self.settings.role == "prefill" and self.settings.pd_protocol == "sglang"

    @property
    def mode(self) -> str:
        """SGLang's `disaggregation_mode`: "null" for an engine that does both."""
        return "null" if self.settings.role == "both" else self.settings.role

    def serving(self, url: str) -> None:
        """The engine's own server is up at `url`: its port is what the answers advertise."""
        self.port = int(url.rsplit(":", 1)[1])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expire held KV (and serve the bootstrap server) for as long as the engine serves."""
        try:
            async with trio.open_nursery() as nursery:
                if self.runs_bootstrap_server:
                    server = HttpServer(self._bootstrap)
                    url: str = await nursery.start(
                        server.serve, self.settings.host, self.settings.bootstrap_port, 128
                    )
                    self.bootstrap_port = int(url.rsplit(":", 1)[1])
                nursery.start_soon(self._expire)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._fetcher.aclose()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Block until `condition()` holds; re-checked whenever held KV changes or a request
        starts waiting for its KV."""
        while not condition():
            await self._changed.wait()

    def routes(self) -> dict[str, dict[str, Callable[[Exchange], Awaitable[None]]]]:
        return {TAKE_PATH: {"POST": self._take}}

    # --- a request's leg ---------------------------------------------------------------

    async def leg(self, payload: dict[str, Any], prompt: Sequence[int], exchange: Exchange) -> Leg:
        """What this engine does for the request, after any transfer it waits for."""
        settings = self.settings
        plan = plan_leg(settings.role, settings.pd_protocol, payload, prompts=1)
        if isinstance(plan, Aggregated):
            return Leg()
        if isinstance(plan, Recompute):
            self.counters.recomputed(plan.reason, len(prompt))
            return Leg()
        if isinstance(plan, HoldForDecode):
            return self._holding(plan, len(prompt), exchange)
        self.engine.receiving_kv += 1  # waiting for its KV: vLLM counts it waiting too
        self._notify()
        try:
            received = await self._receive(plan, len(prompt), exchange)
        finally:
            self.engine.receiving_kv -= 1
        if not received:
            self.counters.recomputed("unusable", len(prompt))
            return Leg()
        self.counters.transfers["decode"] += 1
        return Leg(prefilled=True)

    async def _receive(
        self, plan: RemotePrefill | Bootstrap, prompt_tokens: int, exchange: Exchange
    ) -> bool:
        """Take the prompt's KV and spend the time it takes to arrive; False if it cannot be
        had (vLLM's flow), a 500 if it never comes (SGLang's)."""
        if isinstance(plan, RemotePrefill):
            if not await self._pull(plan, prompt_tokens, exchange):
                return False
        else:
            await self._wait_for_room(plan, prompt_tokens)
        await trio.sleep(self.settings.kv_transfer_per_token * prompt_tokens)
        return True

    def _holding(self, plan: HoldForDecode, prompt_tokens: int, exchange: Exchange) -> Leg:
        leg = Leg(output_tokens=1)
        if plan.room is not None:
            key: tuple[str, object] = ("room", plan.room)
        else:
            request_id = exchange.header(b"x-request-id")
            key = ("vllm", request_id.decode("latin-1") if request_id else uuid.uuid4().hex)

        def keep(allocation: KVAllocation) -> None:
            held, displaced = self.held.hold(key, allocation, prompt_tokens, trio.current_time())
            self._release(displaced)
            if plan.room is None:
                params = answer_params(self.engine_id, held, self.host, self.port)
                leg.answer_fields["kv_transfer_params"] = params
            self._notify()

        leg.keep = keep
        return leg

    async def _pull(self, remote: RemotePrefill, prompt_tokens: int, exchange: Exchange) -> bool:
        """Take the KV from the prefill engine; False if it cannot be had."""
        request_id = exchange.header(b"x-request-id")
        if request_id is None:
            return False
        body = {
            "remote_engine_id": remote.engine_id,
            "block_ids": list(remote.block_ids),
            "prompt_tokens": prompt_tokens,
        }
        with trio.move_on_after(self.settings.kv_transfer_timeout):
            try:
                fetched = await self._fetcher.post_json(
                    f"http://{remote.host}:{remote.port}",
                    TAKE_PATH,
                    body,
                    [(b"x-request-id", request_id)],
                )
            except UpstreamError:
                return False
            return fetched.status == 200
        return False

    async def _wait_for_room(self, bootstrap: Bootstrap, prompt_tokens: int) -> None:
        """Wait on the prefill's bootstrap server until its room is ready, then take it."""
        (room,) = bootstrap.rooms
        body = {"room": room, "prompt_tokens": prompt_tokens}
        where = f"http://{bootstrap.host}:{bootstrap.port}"
        status = None
        with trio.move_on_after(self.settings.kv_transfer_timeout):
            try:
                status = (await self._fetcher.post_json(where, ROOM_PATH, body)).status
            except UpstreamError as exc:
                raise transfer_failed(f"bootstrap server {where} unreachable: {exc}") from None
        if status != 200:
            raise transfer_failed(
                f"KV of bootstrap room {room} did not arrive from {where} within "
                f"{self.settings.kv_transfer_timeout:g}s"
            )

    # --- the prefill side ---------------------------------------------------------------

    async def _take(self, exchange: Exchange) -> None:
        """vLLM's pull: the KV held under this X-Request-Id, handed out and released here."""
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        request_id = exchange.header(b"x-request-id")
        block_ids = payload.get("block_ids")
        prompt_tokens = payload.get("prompt_tokens")
        held = None
        ours = payload.get("remote_engine_id") == self.engine_id
        if ours and request_id and isinstance(block_ids, list) and isinstance(prompt_tokens, int):
            key = ("vllm", request_id.decode("latin-1"))
            held = self.held.take(key, prompt_tokens, trio.current_time(), tuple(block_ids))
        await self._hand_out(held, exchange)

    async def _bootstrap(self, exchange: Exchange) -> None:
        """SGLang's bootstrap server: wait (long-poll) for a room's KV, then hand it out."""
        if exchange.path != ROOM_PATH or exchange.method != "POST":
            await exchange.respond_json(404, {"detail": "Not Found"})
            return
        payload = parse_json_object(await exchange.read_body(MAX_BODY_BYTES))
        room, prompt_tokens = payload.get("room"), payload.get("prompt_tokens")
        if not isinstance(room, int) or not isinstance(prompt_tokens, int):
            await exchange.respond_json(400, {"detail": "send an integer room and prompt_tokens"})
            return
        key = ("room", room)
        with trio.move_on_after(self.settings.kv_transfer_timeout):
            await self.wait_until(lambda: self.held.holds(key))
        held = self.held.take(key, prompt_tokens, trio.current_time())
        await self._hand_out(held, exchange)

    async def _hand_out(self, held: Held | None, exchange: Exchange) -> None:
        """Released here once handed out, before the answer (which may not reach its asker)."""
        if held is None:
            await exchange.respond_json(404, {"detail": "no such KV transfer held"})
            return
        self._release([held])
        self.counters.transfers["prefill"] += 1
        await exchange.respond_json(200, {"taken": True})

    async def _expire(self) -> None:
        while True:
            due = self.held.next_expiry
            if due is None:
                await self._changed.wait()
                continue
            await trio.sleep_until(due)
            self._release(self.held.expire(trio.current_time()))

    def _release(self, gone: Sequence[Held]) -> None:
        for held in gone:
            self.engine.kv_cache.release(held.allocation)
        if gone:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def transfer_failed(message: str) -> ClientError:
    """A decode engine's answer when the KV it waits for cannot come (SGLang's flow)."""
    return request_error(message, status=500, type_="InternalServerError", code=500)
