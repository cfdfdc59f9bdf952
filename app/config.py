"""Settings: one frozen object built from flags, SLUICE_* environment variables and a TOML file.

Precedence, highest first: command-line flag, environment variable, `--config` file, default
(app/cli/command.py reads them). `Settings` is the proxy's, read whole by start-up only
(tests/test_house.py): each room gets a frozen slice of what it reads (app/cli/rooms.py). The
simulated backend's (`app/sim/settings.py`) shares `ServerSettings`, what every server Sluice
runs is told: where to listen and how many connections the kernel may queue, checked the same
way, and the range checks of numeric flags (`check_ranges`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from app.discovery_targets import check_discovery
from app.models import MAX_MODELS, AdapterConfig

Policy = Literal["cache_aware", "consistent_hash", "power_of_two", "round_robin", "random"]
TokenizeMode = Literal["offload", "inline"]
Saturation = Literal["wait", "bail-out"]
ForwardMode = Literal["passthrough", "tokens"]
AccessLogFormat = Literal["json"]
# What an engine does for its model: everything, or one phase of disaggregated serving.
Role = Literal["both", "prefill", "decode"]
# The KV-transfer protocol prefill and decode engines speak: vLLM's KV connector (the
# decode pulls what the prefill's answer names) or SGLang's bootstrap server (both legs at
# once, meeting in a room).
PdProtocol = Literal["vllm", "sglang"]
# SGLang's `--disaggregation-bootstrap-port` default.
SGLANG_BOOTSTRAP_PORT = 8998

MAX_WORKERS = 64
DEFAULT_MAX_RENDER_WORKERS = 4
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


PORTS = range(0, 65536)  # 0: any free port


# Numeric flags' ranges: (names, the test a value passes, what the error says of it).
Ranges = tuple[tuple[tuple[str, ...], Callable[[float], bool], str], ...]
NUMERIC_RANGES: Ranges = (
    (
        (
            "tokenize_threads",
            "render_workers",
            "breaker_failures",
            "max_connections",
            "max_body_bytes",
            "demo_backends",
            "max_index_blocks",
            "max_queued_per_backend",
        ),
        lambda value: value >= 1,
        "must be at least 1",
    ),
    (
        (
            "tokenize_queue",
            "l0_max_entries",
            "l0_max_text_bytes",
            "l1_max_memory",
            "shutdown_grace",
            "demo_rps",
            "admission_queue",
            "admission_queue_per_key",
            "tokens_per_minute",
            "balance_abs_threshold",
            "disaggregate_above",
            "drain_timeout",
        ),
        lambda value: value >= 0,
        "must not be negative",
    ),
    (
        (
            "health_check_interval",
            "health_check_timeout",
            "connect_timeout",
            "first_byte_timeout",
            "idle_timeout",
            "stall_threshold_ms",
            "admission_timeout",
            "budget_sync_interval",
            "prefill_timeout",
            "discover_interval",
        ),
        lambda value: value > 0,
        "must be positive",
    ),
)


def check_ranges(settings: object, ranges: Ranges) -> None:
    """Every named field passes its range's test, or a ValueError names the flag and why
    (the proxy's and the simulated backend's settings alike)."""
    for names, holds, rule in ranges:
        for name in names:
            if not holds(getattr(settings, name)):
                raise ValueError(f"--{name.replace('_', '-')} {rule}")


@dataclass(frozen=True)
class BackendRole:
    """A backend's part in disaggregated serving (`--prefill`, `--decode`, a fleet table's
    `role`); `bootstrap_port`: where a prefill engine's SGLang bootstrap server listens."""

    url: str
    role: Role
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        check_backend_url(self.url)
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"backend {self.url}: role must be both, prefill or decode")
        if self.bootstrap_port is not None and (
            self.role != "prefill" or not 1 <= self.bootstrap_port <= 65535
        ):
            raise ValueError(
                f"backend {self.url}: bootstrap_port is a prefill engine's, from 1 to 65535"
            )


def parse_role_flag(role: Role, entry: str) -> BackendRole:
    """`--prefill URL[=BOOTSTRAP_PORT]` or `--decode URL`."""
    url, equals, port = entry.partition("=")
    url = url.strip().rstrip("/")
    if not equals:
        return BackendRole(url, role)
    if role != "prefill" or not port.strip().isdigit():
        expected = "URL=BOOTSTRAP_PORT" if role == "prefill" else "URL"
        raise ValueError(f"--{role} {entry!r}: expected {expected}")
    return BackendRole(url, role, int(port))


@dataclass(frozen=True)
class ModelConfig:
    """One model of the fleet (a `[[models]]` table of `--config`): the name its backends
    serve it under, those backends, and how Sluice prepares its prompts. What a table leaves
    out comes from the single-model flags (`--tokenizer`, `--chat-template`, `--max-model-len`)
    or, for the window, from the backends' own `max_model_len`."""

    name: str
    backends: tuple[str, ...] = ()
    tokenizer: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None
    aliases: tuple[str, ...] = ()
    # Those of `backends` with a role other than `both` (a table's `role`, `bootstrap_port`).
    roles: tuple[BackendRole, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name must not be empty")
        for alias in self.aliases:
            if not alias.strip():
                raise ValueError("an alias must not be empty")
        if self.name in self.aliases or len(set(self.aliases)) != len(self.aliases):
            raise ValueError("aliases must differ from each other and from the name")
        for url in self.backends:
            check_backend_url(url)
        if len(set(self.backends)) != len(self.backends):
            raise ValueError("backends lists a URL twice")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        for name in ("tokenizer", "chat_template"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} must not be empty")


def check_backend_url(url: str) -> None:
    if not url.startswith("http://"):
        raise ValueError(f"backend {url!r}: only http:// backend URLs are supported")
    if not _has_host_and_port(url):
        raise ValueError(f"backend {url!r}: expected http://HOST[:PORT], a port from 1 to 65535")


def _has_host_and_port(url: str) -> bool:
    """Whether a URL names a host, and a port from 1 to 65535 if any."""
    parts = urlsplit(url)
    try:
        port = parts.port  # ValueError outside 0-65535, or not a number
    except ValueError:
        return False
    return bool(parts.hostname) and port != 0


def check_fleet(models: tuple[ModelConfig, ...]) -> None:
    """Names and aliases are one namespace: each may mean one model only."""
    if len(models) > MAX_MODELS:
        raise ValueError(f"at most {MAX_MODELS} models may be configured")
    owner: dict[str, str] = {}
    for model in models:
        for name in (model.name, *model.aliases):
            if name in owner:
                first = owner[name]
                where = "twice" if first == model.name else f"by model {first!r} already"
                raise ValueError(f"model {model.name!r}: the name {name!r} is used {where}")
            owner[name] = model.name


@dataclass(frozen=True)
class ServerSettings:
    """Where a server listens (port 0: any free port) and how many connections the kernel
    may queue before they are accepted (hypercorn's default, 100, reset 20-30% of 1,000
    connections opened at once here)."""

    host: str = "127.0.0.1"
    port: int = 8000
    backlog: int = 2048

    def __post_init__(self) -> None:
        for each in dataclasses.fields(self):
            value = getattr(self, each.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{each.name.replace('_', '-')} must be a finite number")
        if self.port not in PORTS:
            raise ValueError(f"--port {self.port}: expected a port from 0 to 65535")
        if self.backlog < 1:
            raise ValueError("--backlog must be at least 1")


def endpoint_problem(endpoint: str, *, any_port: bool = False) -> str | None:
    """What is wrong with a ZMQ endpoint given on the command line, or None: tcp://HOST:PORT
    (PORT 0 for any free one where `any_port`) or ipc://PATH."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return None
    if not endpoint.startswith("tcp://"):
        return "must be tcp://HOST:PORT or ipc://PATH"
    host, colon, port = endpoint[len("tcp://") :].rpartition(":")
    lowest = 0 if any_port else 1
    if not colon or not host or not port.isdigit() or not lowest <= int(port) <= 65535:
        return f"must be tcp://HOST:PORT with a port from {lowest} to 65535"
    return None


@dataclass(frozen=True)
class Settings(ServerSettings):
    # The dashboard's socket (the proxy's: ServerSettings).
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8001
    # The endpoint picker's gRPC port (Envoy ext_proc, h2c) on --host; None: no such door.
    epp_port: int | None = None

    # Backends and routing. `backends` serve the models their /v1/models lists; `models`
    # (the fleet's tables) name their own backends.
    backends: tuple[str, ...] = ()
    models: tuple[ModelConfig, ...] = ()
    # LoRA adapters (the fleet file's `[adapters]`): with lora_load_on_demand, a request for
    # one no engine has loaded loads it on an engine of its base (app/fleet/adapter_loader.py).
    adapters: tuple[AdapterConfig, ...] = ()
    lora_load_on_demand: bool = False
    # Disaggregated serving: prefill engines ("URL" or "URL=BOOTSTRAP_PORT"), decode engines,
    # the protocol they speak, and the uncached prompt tokens above which a request takes
    # two hops rather than one (fewer cost more in the hop than they save: see app/README.md).
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    pd_protocol: PdProtocol = "vllm"
    disaggregate_above: int = 512
    prefill_timeout: float = 60.0  # seconds a prefill leg may take, its whole answer
    policy: Policy = "cache_aware"
    health_check_path: str = "/health"
    health_check_interval: float = 3.0
    health_check_timeout: float = 2.0
    breaker_failures: int = 3
    breaker_cooldown: float = 10.0
    # cache_aware / consistent_hash (SMG's names). A prompt share held by a backend above
    # cache_threshold is a prefix hit; a backend keeps its affinity unless its load is both
    # balance_abs_threshold above and balance_rel_threshold times the least-loaded backend's.
    cache_threshold: float = 0.3
    balance_abs_threshold: float = 16.0
    balance_rel_threshold: float = 1.5
    max_index_blocks: int = 262144
    # Admission: a request passes while an engine of its model's pool has room, as the
    # engines' own metrics say (app/fleet/saturation.py); else it is held, fairly across API
    # keys, up to admission_queue requests (admission_queue_per_key of one key, while other
    # keys send too) for at most admission_timeout seconds, then 429.
    # max_inflight_per_backend: an optional ceiling on our requests on one backend;
    # max_kv_usage: an engine whose KV cache is this full takes no more;
    # max_queued_per_backend: our requests that may wait in a full engine's own queue (the
    # rest wait at the proxy, in fair order).
    max_inflight_per_backend: int | None = None
    max_kv_usage: float = 0.95
    max_queued_per_backend: int = 1
    admission_queue: int = 1024
    admission_queue_per_key: int = 256
    admission_timeout: float = 30.0
    tokens_per_minute: int = 0  # per API key and model; 0: no limit
    # A TOML file of API keys, the models each may call and its tokens per minute; without
    # one the proxy is open to anyone who reaches it.
    api_keys: str | None = None
    # Per-key budgets shared by every worker and replica through this Redis, synced in the
    # background every budget_sync_interval seconds (over-admission is bounded by what one
    # interval admits); without it, each process holds its share of the budget alone.
    redis_url: str | None = None
    budget_sync_interval: float = 0.2
    # The engines' own KV-cache events (vLLM, SGLang): "BACKEND_URL=tcp://HOST:PORT" each, and
    # the replay sockets that fill sequence gaps, in the same form.
    kv_events: tuple[str, ...] = ()
    kv_events_replay: tuple[str, ...] = ()
    # Discovery (app/discovery_targets.py): engines found by DNS names (looked up every
    # discover_interval s, sooner as their TTL says) and a Kubernetes watch; one that leaves
    # takes no new request and has drain_timeout s to finish those it has.
    discover_dns: tuple[str, ...] = ()
    dns_server: str | None = None
    discover_k8s: str | None = None
    discover_k8s_port: int = 8000
    discover_k8s_prefill: str | None = None  # label selectors; a pod matching neither: both
    discover_k8s_decode: str | None = None
    discover_interval: float = 5.0
    drain_timeout: float = 30.0

    # Forwarding.
    connect_timeout: float = 3.0
    first_byte_timeout: float = 300.0
    idle_timeout: float = 60.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_connections: int = 1024  # requests in flight; past it a fast 503
    shutdown_grace: float = 10.0
    # Proxy processes sharing the port (SO_REUSEPORT), one dashboard for all; 1: no supervisor.
    workers: int = 1

    # Preprocessing.
    tokenizer: str | None = None
    chat_template: str | None = None
    tokenize_mode: TokenizeMode = "offload"
    # Tokenizer threads release the GIL but still need a core: leave one to the event loop
    # (measured: 2 threads on 2 cores let /health wait 12-20 ms during a burst, 1 thread 6-11).
    tokenize_threads: int = field(default_factory=lambda: max(1, (os.cpu_count() or 2) - 1))
    tokenize_queue: int = 8
    # Renders (parse, checks, Jinja2) hold the GIL: they run in worker processes, started as
    # needed, at most this many (by default one fewer than the cores, and no more than
    # DEFAULT_MAX_RENDER_WORKERS).
    render_workers: int = field(
        default_factory=lambda: max(1, min(DEFAULT_MAX_RENDER_WORKERS, (os.cpu_count() or 2) - 1))
    )
    saturation: Saturation = "wait"
    l0_max_entries: int = 10000
    l0_max_text_bytes: int = 65536
    l1_max_memory: int = 52428800
    max_model_len: int | None = None
    forward: ForwardMode = "passthrough"
    admin_token: str | None = None

    # Observation.
    stall_threshold_ms: float = 10.0
    stall_instrument: bool = True
    # An OpenTelemetry collector's OTLP/HTTP URL: each request's spans go there.
    otlp_endpoint: str | None = None
    access_log: AccessLogFormat | None = None  # json: one line per request on stderr

    log_level: str = "info"

    # Demo only.
    demo_backends: int = 3
    demo_rps: float = 2.0
    # Seconds between two bursts of large unique prompts (0: none; the page can still ask).
    demo_burst_interval: float = 30.0

    @property
    def all_backends(self) -> tuple[str, ...]:
        """Every backend URL, those of the model tables included, each once."""
        urls = [
            *self.backends,
            *(url for model in self.models for url in model.backends),
            *(role.url for role in self.backend_roles),
        ]
        return tuple(dict.fromkeys(url.rstrip("/") for url in urls))

    @property
    def backend_roles(self) -> tuple[BackendRole, ...]:
        """Every backend with a role other than `both`: the flags', then the tables'."""
        return (
            *(parse_role_flag("prefill", entry) for entry in self.prefill),
            *(parse_role_flag("decode", entry) for entry in self.decode),
            *(role for model in self.models for role in model.roles),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dashboard_port not in PORTS:
            raise ValueError(
                f"--dashboard-port {self.dashboard_port}: expected a port from 0 to 65535"
            )
        if self.epp_port is not None and self.epp_port not in PORTS:
            raise ValueError(f"--epp-port {self.epp_port}: expected a port from 0 to 65535")
        if self.epp_port is not None and self.workers > 1:
            raise ValueError("--epp-port is served by one process: it does not take --workers")
        check_ranges(self, NUMERIC_RANGES)
        for url in self.backends:
            check_backend_url(url)
        check_fleet(self.models)
        if self.lora_load_on_demand and not self.adapters:
            raise ValueError("--lora-load-on-demand needs an [adapters] table in --config")
        if self.max_inflight_per_backend is not None and self.max_inflight_per_backend < 1:
            raise ValueError("--max-inflight-per-backend must be at least 1 (leave it out: none)")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError("--max-kv-usage must be above 0 and at most 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be between 0 and 1")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-rel-threshold must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("--admin-token must not be empty")
        if self.admin_token is None and not is_loopback_host(self.dashboard_host):
            raise ValueError(
                f"--dashboard-host {self.dashboard_host!r} is reachable from other machines: "
                "set --admin-token too, or the saturation switch would be anyone's"
            )
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be between 1 and {MAX_WORKERS}")
        if self.redis_url is not None and (
            not self.redis_url.startswith(REDIS_SCHEMES)
            or (not self.redis_url.startswith("unix://") and not _has_host_and_port(self.redis_url))
        ):
            raise ValueError(
                f"--redis-url {self.redis_url!r}: expected redis://HOST[:PORT], rediss://... "
                "or unix://PATH, a port from 1 to 65535"
            )
        if self.otlp_endpoint is not None and (
            not self.otlp_endpoint.startswith(("http://", "https://"))
            or not _has_host_and_port(self.otlp_endpoint)
        ):
            raise ValueError(
                f"--otlp-endpoint {self.otlp_endpoint!r}: expected an OTLP/HTTP URL, "
                "http://HOST:4318 or https://..., a port from 1 to 65535"
            )
        if self.demo_burst_interval < 0:
            raise ValueError("--demo-burst-interval must not be negative")
        if self.kv_events and self.policy != "cache_aware":
            raise ValueError("--kv-events feeds the prefix index: it needs --policy cache_aware")
        self.kv_event_endpoints()  # every entry checked
        check_roles(self.backend_roles, self.backends)
        check_discovery(self)

    @property
    def discovers(self) -> bool:
        """Whether backends may come from discovery, so none need be named at start."""
        return bool(self.discover_dns or self.discover_k8s)

    def kv_event_endpoints(self) -> dict[str, tuple[str, str | None]]:
        """Backend URL -> (publisher endpoint, replay endpoint or None)."""
        publishers = _endpoints_by_backend("--kv-events", self.kv_events, self.all_backends)
        replays = _endpoints_by_backend(
            "--kv-events-replay", self.kv_events_replay, self.all_backends
        )
        for url in replays.keys() - publishers.keys():
            raise ValueError(f"--kv-events-replay {url}: give its --kv-events too")
        return {url: (endpoint, replays.get(url)) for url, endpoint in publishers.items()}


def check_roles(roles: tuple[BackendRole, ...], plain: tuple[str, ...]) -> None:
    """A backend has one role: not given twice, nor both `--backend` and a role."""
    seen: dict[str, BackendRole] = {}
    plain_urls = {url.rstrip("/") for url in plain}
    for role in roles:
        earlier = seen.setdefault(role.url, role)
        if earlier != role or role.url in plain_urls:
            raise ValueError(f"backend {role.url} is given two roles")


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1); other names are not trusted."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _endpoints_by_backend(
    flag: str, entries: tuple[str, ...], backends: tuple[str, ...]
) -> dict[str, str]:
    known = {url.rstrip("/") for url in backends}
    endpoints: dict[str, str] = {}
    for entry in entries:
        url, equals, endpoint = entry.partition("=")
        url, endpoint = url.strip().rstrip("/"), endpoint.strip()
        if not equals or not url or not endpoint:
            raise ValueError(f"{flag} {entry!r}: expected BACKEND_URL=tcp://HOST:PORT")
        problem = endpoint_problem(endpoint)
        if problem:
            raise ValueError(f"{flag} {entry!r}: the endpoint {problem}")
        if url not in known:
            raise ValueError(f"{flag} {entry!r}: {url} is not one of the --backend URLs")
        if url in endpoints:
            raise ValueError(f"{flag}: {url} is given twice (one publisher per backend)")
        endpoints[url] = endpoint
    return endpoints
