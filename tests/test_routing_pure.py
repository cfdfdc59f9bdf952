"""Backend state and routing policies, alone: circuit breaker transitions, health,
and what each policy picks and why. No Trio, no HTTP."""

from __future__ import annotations

import random

import pytest

from app.fleet.pool import BackendPool
from app.routing.decision import RouteRequest
from app.routing.policies import PowerOfTwo, RandomChoice, RoundRobin, make_policy


def pool(n: int = 3, failures: int = 3, cooldown: float = 10.0) -> BackendPool:
    p = BackendPool(
        tuple(f"http://b{i}/" for i in range(n)),
        failures_to_open=failures,
        cooldown=cooldown,
        probe_path="/health",
    )
    for backend in p.backends:
        p.health_checked(backend, True)
    return p


def test_urls_are_normalised_and_a_pool_may_start_empty() -> None:
    assert [b.url for b in pool(2).backends] == ["http://b0", "http://b1"]
    empty = BackendPool((), failures_to_open=1, cooldown=1, probe_path="/health")
    assert empty.available(0.0) == [] and not empty.any_available(0.0)  # discovery fills it


def test_unhealthy_backend_takes_no_traffic() -> None:
    p = pool()
    p.health_checked(p.backends[1], False, "health check answered 503")
    assert [b.url for b in p.available(0.0)] == ["http://b0", "http://b2"]
    assert p.backends[1].last_error == "health check answered 503"


def test_breaker_opens_after_consecutive_failures_and_half_opens_after_cooldown() -> None:
    p = pool(failures=3, cooldown=10.0)
    b = p.backends[0]
    p.request_failed(b, 0.0, "boom")
    p.request_failed(b, 0.0, "boom")
    assert b.takes_traffic(0.0)
    p.request_succeeded(b)  # a success resets the count
    for _ in range(3):
        p.request_failed(b, 1.0, "boom")
    assert not b.takes_traffic(1.0)
    assert not b.takes_traffic(10.9)
    assert b.takes_traffic(11.0)  # half-open
    assert p.snapshot(11.0)[0]["breaker"] == "half-open"
    p.request_failed(b, 11.0, "still broken")  # one failure re-opens at once
    assert not b.takes_traffic(11.5)
    assert b.takes_traffic(21.0)
    p.request_succeeded(b)
    assert p.snapshot(21.0)[0]["breaker"] == "closed"
    p.request_failed(b, 21.0, "one-off")
    assert b.takes_traffic(21.0)  # closed again: one failure is not enough


def test_exclude_keeps_retries_off_the_backend_that_failed() -> None:
    p = pool()
    assert p.available(0.0, exclude=(p.backends[0],)) == p.backends[1:]


def test_round_robin_rotates() -> None:
    p = pool()
    policy = RoundRobin()
    picks = [policy.choose(p.backends, RouteRequest()).backend.url for _ in range(6)]
    assert picks == ["http://b0", "http://b1", "http://b2"] * 2


def test_power_of_two_prefers_fewer_in_flight() -> None:
    p = pool(2)
    p.backends[0].inflight = 5
    policy = PowerOfTwo(random.Random(1))
    for _ in range(20):
        decision = policy.choose(p.backends, RouteRequest())
        assert decision.backend is p.backends[1]
        assert decision.reason == "less_loaded"
    assert PowerOfTwo().choose(p.backends[:1], RouteRequest()).reason == "only_candidate"


def test_power_of_two_spreads_equal_load() -> None:
    p = pool(3)
    policy = PowerOfTwo(random.Random(7))
    seen = {policy.choose(p.backends, RouteRequest()).backend.url for _ in range(50)}
    assert len(seen) == 3


def test_random_covers_all_and_make_policy_knows_names() -> None:
    p = pool(3)
    policy = RandomChoice(random.Random(3))
    assert {policy.choose(p.backends, RouteRequest()).backend.url for _ in range(50)} == {
        b.url for b in p.backends
    }
    for name in ("round_robin", "random", "power_of_two"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError):
        make_policy("nope")


def test_max_model_len_comes_from_model_list() -> None:
    b = pool(1).backends[0]
    assert b.max_model_len is None
    b.models = [{"id": "m", "max_model_len": 4096}]
    assert b.max_model_len == 4096
