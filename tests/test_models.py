"""Models as first-class, alone (no HTTP): which served model a request names (aliases, the one
model served, unknown or not the key's: 404 worded alike, nothing known: 503), what the
catalog serves (configured tables, backends' own lists, windows, the bound on names), the
render plan that rewrites an alias to its served name, each model's pool (a backend in two
pools, a breaker per pool), the prefix index and token caches kept apart per model and
tokenizer under one bound, and tokens per minute per (key, model)."""

from __future__ import annotations

import json
from array import array
from typing import Any

import pytest

from app.budgets.buckets import TokenBuckets
from app.config import ModelConfig
from app.errors import ClientError, Refused, answer_for
from app.fleet.backends import Backend
from app.fleet.catalog import ModelCatalog, configured_backends
from app.fleet.pool import BackendPool
from app.models import MAX_MODELS, ModelDirectory
from app.preprocess.l0_cache import L0Cache
from app.preprocess.rendering import RenderPlan, RenderSpec
from app.preprocess.request_bodies import parse_request
from app.preprocess.to_prompt import render_request
from app.routing.balance import Balance
from app.routing.cache_aware import CacheAware
from app.routing.decision import RouteRequest

DIRECTORY = ModelDirectory(
    frozenset({"big", "small"}), {"chat-default": "big"}, {"big": 1000, "small": 64}
)


def refused(requested: str | None, allowed: frozenset[str] | None = None) -> ClientError:
    with pytest.raises(ClientError) as info:
        DIRECTORY.resolve(requested, allowed)
    return info.value


# --- resolving a request's model ----------------------------------------------------------------


def test_a_served_name_is_itself_and_an_alias_its_target() -> None:
    assert DIRECTORY.resolve("big") == "big"
    assert DIRECTORY.resolve("small") == "small"
    assert DIRECTORY.resolve("chat-default") == "big"


def test_an_unknown_model_and_one_the_key_may_not_use_are_the_same_404() -> None:
    unknown = refused("gpt-4")
    hidden = refused("small", allowed=frozenset({"big"}))
    for error in (unknown, hidden):
        assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
        assert error.type_ == "invalid_request_error"
        # Never a list of what exists.
        assert "big" not in error.message and "chat-default" not in error.message
    assert unknown.message.replace("gpt-4", "small") == hidden.message
    assert refused("chat-default", allowed=frozenset({"small"})).status == 404
    assert len(refused("x" * 10_000).message) < 200  # a made-up name is clipped


def test_no_model_is_the_one_model_served_else_400() -> None:
    one = ModelDirectory(frozenset({"only"}))
    assert one.resolve(None) == "only"
    assert not one.needs_body()
    assert ModelDirectory(frozenset({"only"}), {"alias": "only"}).needs_body()
    assert refused(None).code == "missing_required_parameter"
    with pytest.raises(ClientError) as info:
        one.resolve(None, allowed=frozenset())
    assert info.value.code == "missing_required_parameter"
    with pytest.raises(ClientError) as info:  # checked with the body's shape, before resolving
        parse_request("chat", b'{"model": 3, "messages": [{"role": "user", "content": "hi"}]}')
    assert (info.value.code, info.value.param) == ("invalid_type", "model")


def test_nothing_known_yet_is_a_503_not_a_404() -> None:
    with pytest.raises(Refused) as info:
        ModelDirectory().resolve("anything")
    answer = answer_for(info.value)
    assert (answer.status, answer.body["error"]["code"]) == (503, "no_healthy_backend")
    assert (b"retry-after", b"2") in answer.headers


def test_names_a_client_may_send_are_listed_once() -> None:
    assert DIRECTORY.names_for() == [
        ("big", "big"),
        ("small", "small"),
        ("chat-default", "big"),
    ]
    assert DIRECTORY.names_for(frozenset({"small"})) == [("small", "small")]


# --- the catalog ------------------------------------------------------------------------------


def backend(url: str, *names: str, length: int | None = None, healthy: bool = True) -> Backend:
    b = Backend(url, healthy=healthy)
    b.set_models([{"id": n, "owned_by": "vllm", "max_model_len": length} for n in names])
    return b


TABLES = (
    ModelConfig("big", ("http://a1",), aliases=("chat-default",)),
    ModelConfig("small", ("http://b1",), max_model_len=64),
)


def test_the_catalog_serves_its_tables_and_what_other_backends_list() -> None:
    configured = Backend("http://a1", healthy=True, configured=("big",))
    configured.set_models([{"id": "something-else", "max_model_len": 4096}])
    found = backend("http://c1", "coder", "big", length=8192)
    down = backend("http://c2", "coder", length=2048, healthy=False)
    catalog = ModelCatalog(TABLES, default_window=None)
    directory = catalog.directory([configured, found, down])
    assert directory.served == {"big", "small", "coder"}
    assert configured.served == {"big"}  # its own list does not count
    assert directory.aliases == {"chat-default": "big"}
    # The table's window; else the smallest a healthy backend reports for that name (a
    # configured backend's first card stands for it).
    assert directory.windows == {"small": 64, "big": 4096, "coder": 8192}
    assert ModelCatalog(TABLES, default_window=999).directory([found]).windows["coder"] == 999


def test_the_directory_is_rebuilt_only_when_a_backend_changed() -> None:
    found = backend("http://c1", "coder")
    catalog = ModelCatalog((), default_window=None)
    first = catalog.directory([found])
    assert catalog.directory([found]) is first
    found.set_models([{"id": "coder"}, {"id": "writer"}])
    assert catalog.directory([found]).served == {"coder", "writer"}
    found.healthy = False
    assert catalog.directory([found]) is not first


def test_a_backend_listing_thousands_of_names_is_bounded() -> None:
    many = backend("http://lora", *(f"adapter-{i}" for i in range(5 * MAX_MODELS)))
    assert len(many.served) == MAX_MODELS
    other = backend("http://more", *(f"other-{i}" for i in range(MAX_MODELS)))
    directory = ModelCatalog(TABLES, default_window=None).directory([many, other])
    assert len(directory.served) == MAX_MODELS
    assert {"big", "small"} <= directory.served  # configured models come first


def test_model_cards_for_the_caller_with_window_owner_and_root() -> None:
    catalog = ModelCatalog(TABLES, default_window=None)
    a1 = Backend("http://a1", healthy=True, configured=("big",))
    a1.set_models([{"id": "big", "owned_by": "acme", "created": 7, "max_model_len": 512}])
    b1 = Backend("http://b1", healthy=False, configured=("small",))
    directory = catalog.directory([a1, b1])
    cards = catalog.cards(directory, [a1, b1], now=0.0, allowed=None)
    # `small` has no backend taking traffic: not listed.
    assert [(c["id"], c["root"], c["owned_by"], c["max_model_len"]) for c in cards] == [
        ("big", "big", "acme", 512),
        ("chat-default", "big", "acme", 512),
    ]
    assert cards[0]["created"] == 7 and cards[0]["object"] == "model"
    assert catalog.cards(directory, [a1, b1], 0.0, allowed=frozenset({"small"})) == []


def test_a_backend_named_by_two_tables_serves_both() -> None:
    tables = (ModelConfig("a", ("http://x", "http://y/")), ModelConfig("b", ("http://x",)))
    assert configured_backends(tables) == {"http://x": ("a", "b"), "http://y": ("a",)}


# --- rendering a body for its model -------------------------------------------------------------


def plan(models: ModelDirectory | None = DIRECTORY, **kwargs: Any) -> RenderPlan:
    return RenderPlan(RenderSpec(None, "t", 1000), {}, models, kwargs.get("allowed"), 77)


def completion(**fields: Any) -> bytes:
    return json.dumps({"prompt": "Once upon", "max_tokens": 2, **fields}).encode()


def test_an_alias_or_no_model_is_forwarded_as_the_served_name() -> None:
    by_alias = render_request("completion", completion(model="chat-default"), plan())
    assert by_alias.model == "big" and by_alias.fields["model"] == "big"
    assert by_alias.body is not None
    assert json.loads(by_alias.body) == {"prompt": "Once upon", "max_tokens": 2, "model": "big"}
    only = ModelDirectory(frozenset({"only"}))
    unnamed = render_request("completion", completion(), plan(only))
    assert unnamed.body is not None and json.loads(unnamed.body)["model"] == "only"
    exact = render_request("completion", completion(model="small"), plan())
    assert (exact.model, exact.body) == ("small", None)  # the client's bytes go on


def test_the_render_plan_refuses_what_resolution_refuses() -> None:
    with pytest.raises(ClientError) as info:
        render_request("completion", completion(model="small"), plan(allowed=frozenset({"big"})))
    assert info.value.status == 404
    # Without a directory the model is only required, and the window is the plan's own.
    assert render_request("completion", completion(model="x"), plan(None)).model is None
    with pytest.raises(ClientError):
        render_request("completion", completion(), plan(None))


# --- pools -----------------------------------------------------------------------------------


def fleet() -> BackendPool:
    pool = BackendPool(
        ("http://a1", "http://ab", "http://b1"),
        failures_to_open=2,
        cooldown=10.0,
        probe_path="/health",
        configured={"http://a1": ("a",), "http://b1": ("b",)},
    )
    for b in pool.backends:
        pool.health_checked(b, True)
    pool.backends[1].set_models([{"id": "a"}, {"id": "b"}])
    return pool


def urls(backends: list[Backend]) -> list[str]:
    return [b.url for b in backends]


def test_each_model_has_its_pool_and_a_backend_serving_two_is_in_both() -> None:
    pool = fleet()
    assert urls(pool.available(0.0, model="a")) == ["http://a1", "http://ab"]
    assert urls(pool.available(0.0, model="b")) == ["http://ab", "http://b1"]
    assert pool.available(0.0, model="c") == []


def test_a_breaker_opens_for_one_pool_only() -> None:
    pool = fleet()
    both = pool.backends[1]
    for _ in range(2):
        pool.request_failed(both, 0.0, "answered 500", "a")
    assert urls(pool.available(1.0, model="a")) == ["http://a1"]
    assert urls(pool.available(1.0, model="b")) == ["http://ab", "http://b1"]
    assert both.takes_traffic(1.0)  # still b's
    snapshot = {s["url"]: s for s in pool.snapshot(1.0)}["http://ab"]
    assert snapshot["breaker"] == "open"
    assert snapshot["breakers"] == {"a": "open", "b": "closed"}
    pool.request_failed(both, 0.0, "answered 500", "b")
    pool.request_failed(both, 0.0, "answered 500", "b")
    assert not both.takes_traffic(1.0)
    assert urls(pool.available(10.0, model="a")) == ["http://a1", "http://ab"]  # half-open
    pool.request_succeeded(both, "a")
    assert both.breaker_state(10.0, "a") == "closed"


def test_the_prefix_index_is_kept_per_model_under_one_bound() -> None:
    pool = fleet()
    both = pool.backends[1]
    policy = CacheAware(0.3, Balance(4, 1.5), max_index_blocks=40)
    tokens = array("I", range(320))  # 20 blocks
    first = policy.choose([both], RouteRequest(token_ids=tokens, model="a"))
    again = policy.choose([both], RouteRequest(token_ids=tokens, model="a"))
    other = policy.choose([both], RouteRequest(token_ids=tokens, model="b"))
    assert first.prediction is not None and first.prediction.blocks == 0
    assert again.prediction is not None and again.prediction.blocks == 20
    # The same ids in another model's cache are not there.
    assert other.prediction is not None and other.prediction.blocks == 0
    index = policy.snapshot()["index"]
    assert index["by_backend"] == {both.id: 40}  # its first model's under its bare id
    assert policy.index.blocks(both.id) == 20 and policy.index.blocks(("b", both.id)) == 20
    policy.choose([both], RouteRequest(token_ids=array("I", range(1000, 1320)), model="a"))
    assert len(policy.index) == 40  # one bound for every model
    policy.forget(both)
    assert len(policy.index) == 0


def test_tokens_per_minute_are_counted_per_key_and_model() -> None:
    buckets = TokenBuckets()
    assert buckets.take(("key-1", "a"), 60, 0.0, per_minute=60) == 0.0
    assert buckets.take(("key-1", "a"), 1, 0.0, per_minute=60) > 0
    assert buckets.take(("key-1", "b"), 60, 0.0, per_minute=60) == 0.0


# --- token caches shared by tokenizers ---------------------------------------------------------


def test_l0_keeps_tokenizers_apart_under_one_bound() -> None:
    l0 = L0Cache(max_entries=3, max_bytes=10**6, max_text_bytes=1000)
    l0.put("hello", array("I", [1, 2]), namespace=0)
    l0.put("hello", array("I", [7]), namespace=1)
    assert l0.get("hello", 0) == array("I", [1, 2])
    assert l0.get("hello", 1) == array("I", [7])
    assert l0.get("hello", 2) is None
    for i in range(3):
        l0.put(f"text {i}", array("I", [i]), namespace=1)
    assert len(l0) == 3 and l0.get("hello", 0) is None  # one LRU for all
