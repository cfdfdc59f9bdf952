"""Prefill/decode disaggregation on the simulated engine, the pure part: what a request asks
of this engine, and the prefill side's table of KV held for a decode engine to take.

Design rules:
1. The engine's role decides what it reads (`plan_leg`): a `both` engine reads no transfer
   field (an engine with no KV connector); a `prefill` engine holds the KV of a request that
   asks for a remote decode (vLLM's `do_remote_decode`, or an SGLang `bootstrap_room`); a
   `decode` engine takes the KV its request names, and prefills locally when there is none
   (`no_params`) or it cannot be used (`unusable`), which is counted.
2. A held transfer pins its KV blocks (the table owns the allocation, so nothing evicts them)
   until it is taken or `timeout` seconds pass (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT). The
   caller releases what `take` and `expire` hand back.
3. The table is bounded twice: by time (rule 2) and by `capacity` entries; holding past
   capacity gives up the oldest first. Holding a key again gives up the earlier holding.
4. A take must name what was held: the key (vLLM: the X-Request-Id; SGLang: the room), the
   block ids (vLLM) and the prompt's length. Anything else takes nothing and leaves the
   holding to its expiry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from app.sim.kv_cache import KVAllocation

Reason = Literal["no_params", "unusable"]
REASONS: tuple[Reason, ...] = ("no_params", "unusable")
TransferRole = Literal["prefill", "decode"]
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_ROOM = (1 << 63) - 1


@dataclass(frozen=True)
class Held:
    """A finished prompt's KV, waiting on the prefill engine for a decode engine."""

    allocation: KVAllocation
    block_ids: tuple[int, ...]
    prompt_tokens: int
    expires_at: float


class TransferTable:
    """Held transfers by key, oldest first (rules 2-4)."""

    def __init__(self, timeout: float, capacity: int, block_size: int) -> None:
        if timeout <= 0 or capacity < 1 or block_size < 1:
            raise ValueError("a transfer table needs a positive timeout, capacity and block size")
        self.timeout = timeout
        self.capacity = capacity
        self.block_size = block_size
        self._held: OrderedDict[Any, Held] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def next_expiry(self) -> float | None:
        """When the oldest holding expires; every other expires later (one timeout for all)."""
        return next((held.expires_at for held in self._held.values()), None)

    def hold(
        self, key: object, allocation: KVAllocation, prompt_tokens: int, now: float
    ) -> tuple[Held, list[Held]]:
        """Hold `allocation` under `key`; returns the holding and what it displaced."""
        displaced: list[Held] = []
        earlier = self._held.pop(key, None)
        if earlier is not None:
            displaced.append(earlier)
        while len(self._held) >= self.capacity:
            displaced.append(self._held.popitem(last=False)[1])
        blocks = -(-prompt_tokens // self.block_size)  # the prompt's, not its output slots
        held = Held(allocation, allocation.block_ids[:blocks], prompt_tokens, now + self.timeout)
        self._held[key] = held
        return held, displaced

    def take(
        self, key: object, prompt_tokens: int, now: float, block_ids: tuple[int, ...] | None = None
    ) -> Held | None:
        """The holding under `key`, removed, if it is alive and matches (rule 4)."""
        held = self._held.get(key)
        if held is None or held.expires_at <= now or held.prompt_tokens != prompt_tokens:
            return None
        if block_ids is not None and block_ids != held.block_ids:
            return None
        return self._held.pop(key)

    def holds(self, key: object) -> bool:
        return key in self._held

    def expire(self, now: float) -> list[Held]:
        """Drop and return every holding whose time is up."""
        expired: list[Held] = []
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.expires_at > now:
                break
            del self._held[key]
            expired.append(held)
        return expired


@dataclass
class PdCounters:
    """What the engine's /metrics tells of disaggregation."""

    recomputed_requests: dict[Reason, int] = field(
        default_factory=lambda: dict.fromkeys(REASONS, 0)
    )
    recomputed_tokens: dict[Reason, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    transfers: dict[TransferRole, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    def recomputed(self, reason: Reason, prompt_tokens: int) -> None:
        self.recomputed_requests[reason] += 1
        self.recomputed_tokens[reason] += prompt_tokens


# --- what a request asks of this engine ----------------------------------------------------


@dataclass(frozen=True)
class RemotePrefill:
    """vLLM decode side: where the prompt's KV waits (the prefill's `kv_transfer_params`)."""

    engine_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int


@dataclass(frozen=True)
class Bootstrap:
    """SGLang: the prefill engine's bootstrap server and the room of each prompt."""

    host: str
    port: int
    rooms: tuple[int, ...]


@dataclass(frozen=True)
class Aggregated:
    """Nothing to transfer: the engine answers as an engine without a KV connector."""


@dataclass(frozen=True)
class Recompute:
    """A decode engine prefills locally, counted under `reason`."""

    reason: Reason


@dataclass(frozen=True)
class HoldForDecode:
    """A prefill engine answers one token and holds the KV: under the X-Request-Id (vLLM,
    no `room`) or under the bootstrap room (SGLang)."""

    room: int | None = None


LegPlan = Aggregated | Recompute | HoldForDecode | RemotePrefill | Bootstrap


def plan_leg(role: str, flow: str, payload: dict[str, Any], prompts: int) -> LegPlan:
    """What this engine does with the request's transfer fields (rule 1)."""
    if role == "both":
        return Aggregated()
    if flow == "sglang":
        return _plan_sglang(role, payload, prompts)
    params = payload.get("kv_transfer_params")
    if role == "prefill":
        wants_decode = isinstance(params, dict) and params.get("do_remote_decode") is True
        return HoldForDecode() if wants_decode else Aggregated()
    if params is None:
        return Recompute("no_params")
    return remote_prefill(params) or Recompute("unusable")


def _plan_sglang(role: str, payload: dict[str, Any], prompts: int) -> LegPlan:
    if not any(payload.get(name) is not None for name in BOOTSTRAP_FIELDS):
        return Aggregated() if role == "prefill" else Recompute("no_params")
    bootstrap = bootstrap_fields(payload, prompts)
    if role == "prefill":
        return Aggregated() if bootstrap is None else HoldForDecode(bootstrap.rooms[0])
    return bootstrap or Recompute("unusable")


def remote_prefill(params: object) -> RemotePrefill | None:
    """The prefill's `kv_transfer_params` as a decode engine reads them; None if unusable."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    engine_id, block_ids = params.get("remote_engine_id"), params.get("remote_block_ids")
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(engine_id, str) or not isinstance(host, str) or not _is_port(port):
        return None
    if not isinstance(block_ids, list) or not all(_is_int(block) for block in block_ids):
        return None
    return RemotePrefill(engine_id, tuple(block_ids), host, port)


def bootstrap_fields(payload: dict[str, Any], prompts: int) -> Bootstrap | None:
    """`bootstrap_host`, `bootstrap_port`, `bootstrap_room`: single values for one prompt,
    or arrays as long as the batch; None if they do not fit the request."""
    hosts, ports, rooms = (_as_list(payload.get(name)) for name in BOOTSTRAP_FIELDS)
    if not (len(hosts) == len(ports) == len(rooms) == prompts):
        return None
    if not all(isinstance(host, str) and host for host in hosts):
        return None
    if not all(_is_port(port) for port in ports):
        return None
    if not all(_is_int(room) and 0 <= room <= MAX_ROOM for room in rooms):
        return None
    if len(set(hosts)) != 1 or len(set(ports)) != 1 or len(set(rooms)) != prompts:
        return None  # one prefill engine per request: its batch shares one bootstrap server
    host, port = hosts[0], ports[0]
    return Bootstrap(host, port, tuple(rooms))


def answer_params(engine_id: str, held: Held, host: str, port: int) -> dict[str, Any]:
    """The top-level `kv_transfer_params` of a vLLM prefill engine's answer."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(held.block_ids),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def _as_list(value: object) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_port(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 65535


@dataclass
class Leg:
    """How this engine runs one request: decode only (`prefilled`), or one token whose KV
    goes to `keep` and whose answer gains `answer_fields` (a vLLM prefill's
    `kv_transfer_params`, set by `keep`); the default is an ordinary request."""

    prefilled: bool = False
    output_tokens: int | None = None
    keep: Callable[[KVAllocation], None] | None = None
    answer_fields: dict[str, Any] = field(default_factory=dict)
