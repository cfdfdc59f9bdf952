"""The whole configuration cut into the rooms' slices.

Only start-up (app/cli) reads `Settings`; every other room declares the few values it reads
as a small frozen dataclass of its own, and gets it from here (tests/test_house.py holds the
rule). A new flag is added to `Settings` and to the slice of the room that reads it.
"""

from __future__ import annotations

from app.config import ServerSettings, Settings
from app.preprocess.settings import PreprocessSettings
from app.proxy.settings import ProxySettings
from app.routing.gate import GateLimits
from app.routing.policies import RoutingParams
from app.routing.router import RouterSettings


def preprocess_settings(settings: Settings) -> PreprocessSettings:
    return PreprocessSettings(
        tokenizer=settings.tokenizer,
        chat_template=settings.chat_template,
        models=settings.models,
        max_model_len=settings.max_model_len,
        tokenize_mode=settings.tokenize_mode,
        tokenize_threads=settings.tokenize_threads,
        tokenize_queue=settings.tokenize_queue,
        render_workers=settings.render_workers,
        saturation=settings.saturation,
        l0_max_entries=settings.l0_max_entries,
        l0_max_text_bytes=settings.l0_max_text_bytes,
        l1_max_memory=settings.l1_max_memory,
        api_keys=settings.api_keys,
        admission_timeout=settings.admission_timeout,
    )


def router_settings(settings: Settings) -> RouterSettings:
    return RouterSettings(
        policy=settings.policy,
        params=RoutingParams(
            cache_threshold=settings.cache_threshold,
            balance_abs_threshold=settings.balance_abs_threshold,
            balance_rel_threshold=settings.balance_rel_threshold,
            max_index_blocks=settings.max_index_blocks,
        ),
        limits=GateLimits(
            ceiling=settings.max_inflight_per_backend,
            max_kv_usage=settings.max_kv_usage,
            max_queued=settings.max_queued_per_backend,
            max_held=settings.admission_queue,
            max_per_tenant=settings.admission_queue_per_key,
            timeout=settings.admission_timeout,
        ),
        tokens_per_minute=settings.tokens_per_minute,
        budget_replicas=settings.workers,
        shared_budgets=settings.redis_url is not None,
        budget_sync_interval=settings.budget_sync_interval,
    )


def proxy_settings(settings: Settings) -> ProxySettings:
    return ProxySettings(
        max_connections=settings.max_connections,
        max_body_bytes=settings.max_body_bytes,
        forward=settings.forward,
        idle_timeout=settings.idle_timeout,
    )


def dashboard_server(settings: Settings) -> ServerSettings:
    """The dashboard's own socket; the proxy's is `settings` itself."""
    return ServerSettings(settings.dashboard_host, settings.dashboard_port, settings.backlog)
