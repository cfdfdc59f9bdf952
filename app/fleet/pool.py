"""The pool of backends: who is in it, which of them take a model's traffic, and what
happens to them on a request's success or failure, a health check and a tokenizer check.
Pure: the caller passes `now`.

Backends join and leave at run time (`add`, `drain`). One that leaves is out of the pool at
once, so no new request goes to it, and waits among the `draining` until its requests in
flight have ended or its drain timeout has passed (`drained`); its URL may join again
meanwhile, as a new backend that starts clean. Each pool of a model is
`available(now, model=...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.config import BackendRole, Role
from app.fleet.backend_row import BackendRow, PoolMember
from app.fleet.backends import (
    ANY_MODEL,
    TRAFFIC_TOKENIZER_STATES,
    Backend,
    TokenizerOutcome,
    TokenizerProbe,
)
from app.fleet.discovery import STATIC_SOURCE
from app.fleet.engine_metrics import engine_block


@dataclass(frozen=True)
class Draining:
    """A backend that left the pool; its requests in flight have until `deadline`."""

    backend: Backend
    since: float
    deadline: float


# Others' requests assumed to move with each of ours, at most: 8 replicas' worth.
MAX_OTHERS_PER_OWN = 7.0


class BackendPool:
    def __init__(
        self,
        urls: tuple[str, ...],
        *,
        failures_to_open: int,
        cooldown: float,
        probe_path: str,
        configured: dict[str, tuple[str, ...]] | None = None,
        roles: dict[str, BackendRole] | None = None,
    ) -> None:
        """`configured`: URL -> the models a configuration names for that backend; `roles`:
        URL -> its role, for those not `both`."""
        self.backends: list[Backend] = []
        # Each backend in the pool by its id and by its URL: `find` is asked once per join,
        # and a thousand joins each scanning the pool were quadratic.
        self._by_key: dict[str, Backend] = {}
        self.draining: list[Draining] = []
        # Whether any backend has a prefill or decode role: only then is a request's way
        # decided between one hop and two (app/routing/disaggregation.py).
        self.disaggregated = False
        self.failures_to_open = failures_to_open
        self.cooldown = cooldown
        self.probe_path = probe_path
        self.tokenizer_probe: TokenizerProbe | None = None
        for url in urls:
            role = (roles or {}).get(url.rstrip("/"))
            self.add(url, (configured or {}).get(url.rstrip("/")), role)

    def engines_reported(self) -> None:
        """After a round of engine reports: how many requests of other senders ran beside
        each of ours, over the whole fleet, which each backend's load then assumes until the
        next round. Replicas behind one load balancer send alike, so between two reports
        others' requests on a GPU come and go as ours do, N-1 of theirs for each of ours;
        counted as still, N replicas piled onto whichever GPU looked free at the last report
        (4 replicas, hot workload: p50 TTFT 131 ms against one replica's 77). Alone, it is 0,
        and so it is for a backend whose engine reports nothing: no others to move."""
        reported = [b for b in self.backends if b.engine is not None]
        own = sum(b.inflight_at_report for b in reported)
        others = sum(b.others_inflight for b in reported)
        ratio = min(others / own, MAX_OTHERS_PER_OWN) if own else 0.0
        for backend in self.backends:
            backend.others_per_own = ratio if backend.engine is not None else 0.0

    def add(
        self,
        url: str,
        models: tuple[str, ...] | None = None,
        role: BackendRole | None = None,
        *,
        source: str = STATIC_SOURCE,
        now: float | None = None,
    ) -> Backend:
        """A new backend, unhealthy until its first health check passes; it serves `models`,
        or, without, what its /v1/models lists. `source`: who found it, at `now` (None: at
        start)."""
        url = url.rstrip("/")
        if self.find(url) is not None:
            raise ValueError(f"backend {url} is already in the pool")
        backend = Backend(url, probe_path=self.probe_path, configured=models or None)
        backend.source, backend.joined_at = source, now
        if role is not None:
            backend.role, backend.bootstrap_port = role.role, role.bootstrap_port
            self.disaggregated = True
        if self.tokenizer_probe is not None:
            backend.tokenizer_state = "unchecked"
            backend.tokenizer_detail = "not checked yet"
        self.backends.append(backend)
        self._by_key[backend.id] = self._by_key[backend.url] = backend
        return backend

    def drain(self, backend: Backend, now: float, timeout: float) -> None:
        """Out of the pool at once; its requests in flight have `timeout` seconds to end."""
        self.backends.remove(backend)
        self._by_key.pop(backend.id, None)
        self._by_key.pop(backend.url, None)
        self.draining.append(Draining(backend, now, now + timeout))

    def drained(self, now: float) -> list[Draining]:
        """Those of the draining whose requests have all ended or whose time is up, no
        longer draining from now on."""
        done = [d for d in self.draining if d.backend.inflight <= 0 or now >= d.deadline]
        self.draining = [d for d in self.draining if d not in done]
        return done

    def find(self, id_or_url: str) -> Backend | None:
        return self._by_key.get(id_or_url.rstrip("/"))

    def available(
        self, now: float, exclude: tuple[Backend, ...] = (), model: str | None = None
    ) -> list[Backend]:
        """The backends that take traffic; with `model`, that model's pool only."""
        return [
            b
            for b in self.backends
            if (model is None or model in b.served)
            and b.takes_traffic(now, model)
            and b not in exclude
        ]

    def with_role(self, now: float, model: str | None, role: Role) -> list[Backend]:
        """The backends of `model`'s pool that take traffic and have `role`."""
        return [b for b in self.available(now, (), model) if b.role == role]

    def any_available(self, now: float) -> bool:
        return any(b.takes_traffic(now) for b in self.backends)

    def request_succeeded(self, backend: Backend, model: str = ANY_MODEL) -> None:
        breaker = backend.breakers.get(model)
        if breaker is not None:
            breaker.consecutive_failures = 0
            breaker.half_open = False
        backend.last_error = None

    def request_failed(
        self, backend: Backend, now: float, error: str, model: str = ANY_MODEL
    ) -> None:
        breaker = backend.breaker(model)
        breaker.consecutive_failures += 1
        backend.last_error = error
        if breaker.half_open or breaker.consecutive_failures >= self.failures_to_open:
            breaker.open_until = now + self.cooldown
            breaker.half_open = True

    def health_checked(self, backend: Backend, ok: bool, error: str | None = None) -> None:
        if ok and not backend.healthy:
            # It may be another process now, with other flags: learn its room again.
            backend.room.restarted("it turned healthy")
            if self.tokenizer_probe is not None:
                backend.tokenizer_state = "unchecked"  # re-admission: check the tokenizer again
        backend.healthy = ok
        if not ok:
            backend.last_error = error

    def require_tokenizer_match(self, probe: TokenizerProbe) -> None:
        """Tokens mode: from now on a backend takes traffic only once it passed `probe`."""
        self.tokenizer_probe = probe
        for backend in self.backends:
            backend.tokenizer_state = "unchecked"
            backend.tokenizer_detail = "not checked yet"

    def claim_tokenizer_check(self, backend: Backend) -> TokenizerProbe | None:
        """The probe to run when `backend` is due a check (marked "checking" so that no
        other task checks it at the same time), else None."""
        probe = self.tokenizer_probe
        if probe is None or not backend.healthy or backend.tokenizer_state != "unchecked":
            return None
        backend.tokenizer_state = "checking"
        return probe

    def tokenizer_checked(self, backend: Backend, outcome: TokenizerOutcome) -> None:
        backend.tokenizer_state = outcome.state
        backend.tokenizer_detail = outcome.detail
        if outcome.state == "refused":
            backend.last_error = outcome.detail

    def tokenizer_refusals(self) -> dict[str, str]:
        """Healthy backends kept from traffic by the tokenizer check, with the reason."""
        return {
            b.url: b.tokenizer_detail or b.tokenizer_state
            for b in self.backends
            if b.healthy and b.tokenizer_state not in TRAFFIC_TOKENIZER_STATES
        }

    def members_summary(self, now: float) -> list[PoolMember]:
        """What each model's pool row sums, of every backend in the pool or draining."""
        draining = {d.backend: d.since for d in self.draining}
        return [
            {
                "id": b.id,
                "role": b.role,
                "healthy": b.healthy,
                "breakers": {model: b.breaker_state(now, model) for model in b.served},
                "inflight": b.inflight,
                "engine": engine_block(b.engine),
                "serves": list(b.served),
                "draining_for": None if b not in draining else now - draining[b],
            }
            for b in self.members
        ]

    def snapshot(self, now: float, backends: Sequence[Backend] | None = None) -> list[BackendRow]:
        """The rows of `backends` (default: those in the pool, then those draining)."""
        draining = {d.backend: d for d in self.draining}
        return [
            {
                "id": b.id,
                "url": b.url,
                "role": b.role,
                "bootstrap_port": b.bootstrap_port,
                "healthy": b.healthy,
                "takes_traffic": b not in draining and b.takes_traffic(now),
                "breaker": b.breaker_state(now),
                "breakers": {model: b.breaker_state(now, model) for model in sorted(b.served)},
                "inflight": b.inflight,
                "unstarted": b.unstarted,
                "pending_tokens": b.pending_tokens,
                "load": round(b.load, 3),
                "reported_waiting": b.reported_waiting,
                "others_inflight": b.others_inflight,
                "others_per_own": round(b.others_per_own, 3),
                "reported_kv_usage": b.reported_kv_usage,
                "room": b.room.snapshot(),
                "engine": engine_block(b.engine),
                "consecutive_failures": max(
                    (breaker.consecutive_failures for breaker in b.breakers.values()), default=0
                ),
                "probe_path": b.probe_path,
                "models": [m.get("id") for m in b.models],
                "serves": sorted(b.served),
                "configured": b.configured is not None,
                "max_model_len": b.max_model_len,
                "last_error": b.last_error,
                "tokenizer": b.tokenizer_state,
                "tokenizer_detail": b.tokenizer_detail,
                "source": b.source,
                "joined_ago": None if b.joined_at is None else now - b.joined_at,
                "draining_for": None if b not in draining else now - draining[b].since,
            }
            for b in (self.members if backends is None else backends)
        ]

    @property
    def members(self) -> list[Backend]:
        """The backends in the pool, then those draining: the rows of `snapshot`."""
        return [*self.backends, *(d.backend for d in self.draining)]
