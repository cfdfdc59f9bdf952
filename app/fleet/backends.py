"""Backend state: health, in-flight load, the models it serves and a circuit breaker per
model. Pure: the caller passes `now`.

A backend serves the models its configuration names (a `[[models]]` table) or, when none
does, those its `/v1/models` lists (refreshed by every health check). Each model it serves
is a pool it belongs to (pool.py).

A backend takes a model's traffic when its last active health check passed and its breaker
for that model is not open. A breaker opens after `failures_to_open` consecutive failed
requests for that model and stays open for `cooldown` seconds; then it is half-open: the next
failure opens it at once, the next success closes it. Per model, because one model of a
server can fail alone (a broken LoRA adapter) while its others answer.

Load, for the policies, is `load`: the requests on the backend, its queue counted once more,
and the prompt tokens this process's requests still have to prefill (in units of
`TOKENS_PER_LOAD`). The requests on it are this process's own, counted at once as they are
sent, start and end (`sent`, `started`, `ended`, whichever door sent them), plus those its
engine last reported beyond them (`others_inflight`, scraped by `load_scraper.py`), taken to
have moved since as ours did, in the fleet's proportion (`engines_reported`): one replica
alone and each of N replicas weigh a GPU alike.

With `--forward tokens` a backend takes traffic only once its /tokenize answered the probe
with Sluice's ids, checked again each time it becomes healthy (it may have been replaced by
another model while it was down): token ids mean something only to Sluice's vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from app.config import Role
from app.fleet.adapters import Residency
from app.fleet.engine_metrics import EngineLoad
from app.fleet.room import EngineRoom, Seen
from app.models import MAX_MODELS

# "not required": passthrough mode. "unchecked" -> "checking" -> "verified" | "refused";
# a check that could not finish (timeout, 5xx) goes back to "unchecked" and is retried.
TokenizerState = Literal["not required", "unchecked", "checking", "verified", "refused"]


@dataclass(frozen=True)
class TokenizerProbe:
    """What `--forward tokens` asks each backend to tokenize (fleet/tokenizer_check.py)."""

    text: str
    expected: tuple[int, ...]  # Sluice's ids for `text`, without post-processor tokens


@dataclass(frozen=True)
class TokenizerOutcome:
    state: Literal["verified", "refused", "unchecked"]
    detail: str


TRAFFIC_TOKENIZER_STATES = frozenset({"not required", "verified"})
# Uncached prompt tokens that weigh as much as one request in flight: about one step of
# vLLM's default token budget (2048), i.e. a prefill that delays everyone on that GPU by a
# step or two.
TOKENS_PER_LOAD = 1024


# A report older than this says nothing of others' requests: while requests flow, engines are
# read every 0.5 s, and one that has not answered for this long may be a stale picture.
STALE_REPORT_S = 2.0


def backend_id(url: str) -> str:
    """A short stable name for a backend URL (the same in every replica and every run)."""
    return "b-" + hashlib.blake2b(url.encode(), digest_size=4).hexdigest()


def endpoint_of(url: str) -> str:
    """`host:port` of a backend URL (the scheme's port when it names none)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class Asked:
    """A report of an engine, as it was asked for: when, how many of our requests were on
    it, and whether one of ours had waited unstarted since the report before."""

    at: float
    ours: int
    ours_waited: bool


@dataclass
class Breaker:
    consecutive_failures: int = 0
    open_until: float = 0.0
    half_open: bool = False

    def state(self, now: float) -> str:
        return "open" if now < self.open_until else "half-open" if self.half_open else "closed"


BREAKER_SEVERITY = {"closed": 0, "half-open": 1, "open": 2}
# The breaker of callers that name no model (every model's requests count as one).
ANY_MODEL = ""
# 5xx answers that mean the backend, not the request, is in trouble: its breaker hears.
FAULT_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = False
    # This process's own requests on it, exact and at once, whichever door sent them: in
    # flight (sent, not ended), and of those the ones whose first byte has not come (queued
    # at its engine, or prefilling).
    inflight: int = 0
    unstarted: int = 0
    pending_tokens: int = 0  # uncached prompt tokens of the requests in flight
    changed_at: float = -math.inf  # when our requests on it last changed: sent, started, ended
    # Its engine's last report (the load scraper's), as of when it was asked for.
    engine: EngineLoad | None = None
    reported_at: float = -math.inf
    reported_running: int = 0
    reported_waiting: int = 0
    others_inflight: int = 0  # what it ran or queued then beyond our own in flight
    inflight_at_report: int = 0  # our own in flight then
    others_per_own: float = 0.0  # the fleet's, at the last scrapes (`engines_reported`)
    unstarted_at_ask: int = 0  # ours unstarted when its last report was asked for
    left_unstarted: int = 0  # of ours, those that started, or ended unstarted, since
    room: EngineRoom = field(default_factory=EngineRoom)  # sequences it runs at once
    probed_at: float = -math.inf  # when one of ours last went past its room
    probe_path: str = "/health"
    models: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models cards
    # The models a configuration names for it, in the order of its tables; None: those its
    # /v1/models lists.
    configured: tuple[str, ...] | None = None
    # Its part in disaggregated serving (a `both` engine does a request whole), and for an
    # SGLang prefill engine, its bootstrap server's port.
    role: Role = "both"
    bootstrap_port: int | None = None
    last_error: str | None = None
    source: str = "static"  # what found it (app/fleet/discovery.py), and when (trio's clock)
    joined_at: float | None = None  # None: at start
    tokenizer_state: TokenizerState = "not required"
    tokenizer_detail: str | None = None  # what the last tokenizer check found
    breakers: dict[str, Breaker] = field(default_factory=dict)  # by model, once one failed
    models_version: int = 0  # counts `set_models` calls: whoever derived from them can tell
    adapters: Residency = field(default_factory=Residency)  # its LoRA adapters (adapters.py)
    id: str = field(init=False)
    endpoint: str = field(init=False)  # `host:port`, as a gateway names it (app/epp/)
    served: frozenset[str] = field(init=False)  # the models whose pools it is in
    # Its first model: configured first, or first in its list (vLLM lists its base model
    # before its LoRA adapters). The one its engine's KV events are about.
    primary: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.id = backend_id(self.url)
        self.endpoint = endpoint_of(self.url)
        self.served = frozenset(self.configured or ())
        self.primary = self.configured[0] if self.configured else None

    def set_models(self, cards: list[dict[str, Any]]) -> None:
        """Its /v1/models answer; what it serves, when no configuration says."""
        self.models = cards
        self.models_version += 1
        if self.configured is None:
            self.served = frozenset(card["id"] for card in cards[:MAX_MODELS])
            self.primary = cards[0]["id"] if cards else None

    def sent(self, now: float) -> None:
        """One of our requests goes to it (past its room: a probe of more room)."""
        self.inflight += 1
        self.unstarted += 1
        self.changed_at = now
        room = self.room.room
        if room is not None and self.on_engine(now) > room:
            self.probed_at = now

    def started(self, now: float) -> None:
        """The first byte of one of our requests' answers came: its engine runs it."""
        self.unstarted -= 1
        self.left_unstarted += 1
        self.changed_at = now

    def ended(self, now: float, started: bool) -> None:
        """One of our requests on it ended (`started`: its first byte had come)."""
        self.inflight -= 1
        if not started:
            self.unstarted -= 1
            self.left_unstarted += 1
        self.changed_at = now

    def asking(self, now: float) -> Asked:
        """A report of its engine is asked for now: what to read it against. Fewer of ours
        left the unstarted since the last report was asked than were unstarted then, so
        one of those is unstarted still: it waited a whole interval, where a request that
        only waits a step for the token budget would have started."""
        waited = self.left_unstarted < self.unstarted_at_ask
        self.unstarted_at_ask, self.left_unstarted = self.unstarted, 0
        return Asked(now, self.inflight, waited)

    @property
    def load(self) -> float:
        """Requests on it, those queued counted once more (a waiting request delays every
        one behind it), and the prefill this process's requests still need. Our own
        requests count as they are now; others' as of the engine's last report, moved since
        as ours moved, `others_per_own` of theirs for each of ours."""
        others = self.others_inflight + self.others_per_own * (
            self.inflight - self.inflight_at_report
        )
        requests = self.inflight + max(others, 0.0) + self.reported_waiting
        return requests + self.pending_tokens / TOKENS_PER_LOAD

    def report_current(self, now: float) -> bool:
        """Whether its engine's last report still says something of others' requests."""
        return self.engine is not None and now - self.reported_at <= STALE_REPORT_S

    def on_engine(self, now: float) -> int:
        """Everyone's requests its engine runs or queues now, as far as the proxy knows: what
        its last report counted, if we changed nothing since; else our own as they are and
        others' as last reported (none once that report is stale)."""
        if not self.report_current(now):
            return self.inflight
        if self.report_fresh:
            return self.reported_running + self.reported_waiting
        return self.others_inflight + self.inflight

    @property
    def report_fresh(self) -> bool:
        """Whether its engine's last report was asked for after our last change on it: it
        then counts every one of our requests as they still are."""
        return self.reported_at > self.changed_at

    def engine_reported(self, engine: EngineLoad | None, asked: Asked | None = None) -> None:
        """What its engine's metrics said (None: it reports no load), against what was
        `asked` (default: now, as many of ours as now, none of them waiting long). What it
        ran and queued beyond our requests then is other senders' work."""
        asked = asked or Asked(0.0, self.inflight, False)
        self.engine = engine
        self.reported_at = asked.at
        if engine is None:
            self.reported_waiting = self.reported_running = self.others_inflight = 0
            if self.room.basis != "stated":
                self.room.forgotten("its engine reports no load")
            return
        if engine.restarted:
            self.room.restarted("its engine restarted (a counter went back or a new start)")
        self.reported_waiting = engine.waiting or 0
        self.reported_running = engine.running or 0
        running_or_waiting = self.reported_running + self.reported_waiting
        self.others_inflight = max(running_or_waiting - asked.ours, 0)
        self.inflight_at_report = asked.ours
        self.room.reported(
            Seen(
                self.reported_running,
                self.reported_waiting,
                asked.ours_waited,
                engine.queue_wait_s,
                engine.step_s,
            )
        )

    @property
    def reported_kv_usage(self) -> float | None:
        return None if self.engine is None else self.engine.kv_cache_usage

    @property
    def max_model_len(self) -> int | None:
        return self.max_model_len_for(None)

    def max_model_len_for(self, model: str | None) -> int | None:
        """The context window its /v1/models gives `model` (the card of that name, else,
        as for a configured backend that lists another name, its first card that says)."""
        found = None
        for card in self.models:
            value = card.get("max_model_len")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                if card.get("id") == model:
                    return value
                found = value if found is None else found
        return found

    def breaker(self, model: str) -> Breaker:
        breaker = self.breakers.get(model)
        if breaker is None:
            breaker = self.breakers[model] = Breaker()
        return breaker

    def breaker_state(self, now: float, model: str | None = None) -> str:
        """One model's breaker; without a model, the most open of them."""
        if model is not None:
            breaker = self.breakers.get(model)
            return "closed" if breaker is None else breaker.state(now)
        states = [b.state(now) for b in self.breakers.values()] or ["closed"]
        return max(states, key=BREAKER_SEVERITY.__getitem__)

    def takes_traffic(self, now: float, model: str | None = None) -> bool:
        """Healthy, verified, and its breaker for `model` not open; without a model, some
        breaker of it not open."""
        if not self.healthy or self.tokenizer_state not in TRAFFIC_TOKENIZER_STATES:
            return False
        if model is None:
            models = self.served or self.breakers.keys() or {ANY_MODEL}
            return any(self._breaker_allows(now, name) for name in models)
        return self._breaker_allows(now, model)

    def _breaker_allows(self, now: float, model: str) -> bool:
        breaker = self.breakers.get(model)
        return breaker is None or now >= breaker.open_until
