"""Disaggregated serving's decision (app/routing/disaggregation.py) on a real pool and
router, no sockets: one hop or two and why, which engines, what each reserves, and what a
decode engine holds after a transfer. Time is Trio's autojump clock."""

from __future__ import annotations

import dataclasses
from array import array

import pytest
import trio

from app.cli.rooms import RoomMetrics, router_settings
from app.config import BackendRole, PdProtocol, Role, Settings
from app.fleet.pool import BackendPool
from app.routing.cache_aware import CacheAware
from app.routing.decider import Decider, RequestFacts
from app.routing.decision import RouteRequest
from app.routing.disaggregation import Disaggregation, DisaggregationSettings
from app.routing.router import Router

MODEL = "m"
THRESHOLD = 256


def fleet(roles: dict[str, Role], flow: PdProtocol = "vllm") -> Disaggregation:
    urls = tuple(roles)
    pool = BackendPool(
        urls,
        failures_to_open=3,
        cooldown=10.0,
        probe_path="/health",
        configured={url: (MODEL,) for url in urls},
        roles={url: BackendRole(url, role) for url, role in roles.items() if role != "both"},
    )
    for backend in pool.backends:
        backend.healthy = True
    router = Router(router_settings(Settings()), pool, RoomMetrics.create().routing)
    settings = DisaggregationSettings(flow, THRESHOLD, 60.0)
    return Disaggregation(settings, Decider(router, pool), pool)


def facts(tokens: int, start: int = 0) -> RequestFacts:
    ids = array("I", range(start, start + tokens))
    return RequestFacts(route=RouteRequest(token_ids=ids, model=MODEL), prompt_tokens=tokens)


PD = {"http://p1:1": "prefill", "http://p2:1": "prefill", "http://d1:1": "decode"}


async def test_a_long_prompt_takes_two_hops_and_each_engine_reserves_its_part(
    autojump_clock: trio.abc.Clock,
) -> None:
    pd = fleet({**PD, "http://d2:1": "decode"})
    way = await pd.decide(facts(2000), 1)
    assert way.reason == "disaggregated" and way.prefill is not None
    assert way.decision.backend.role == "decode" and way.prefill.backend.role == "prefill"
    assert way.prefill.backend.pending_tokens == 2000  # it computes the prompt
    assert way.decision.backend.pending_tokens == 0  # the decode computes none of it
    assert way.decision.backend.inflight == way.prefill.backend.inflight == 1


@pytest.mark.parametrize(
    ("tokens", "copies", "reason"), [(100, 1, "short"), (THRESHOLD, 1, "short"), (2000, 2, "n>1")]
)
async def test_one_hop_and_why(
    autojump_clock: trio.abc.Clock, tokens: int, copies: int, reason: str
) -> None:
    pd = fleet({**PD, "http://both:1": "both"})
    way = await pd.decide(facts(tokens), copies)
    assert (way.reason, way.prefill) == (reason, None)
    assert way.decision.backend.role in ("both", "decode")


async def test_sglangs_decode_engines_never_serve_a_request_alone(
    autojump_clock: trio.abc.Clock,
) -> None:
    pd = fleet(PD, "sglang")
    way = await pd.decide(facts(10), 1)  # short, but nothing else could serve it
    assert way.reason == "disaggregated" and way.prefill is not None
    with_both = fleet({**PD, "http://both:1": "both"}, "sglang")
    short = await with_both.decide(facts(10), 1)
    assert short.reason == "short" and short.decision.backend.role == "both"


async def test_the_next_turn_of_a_conversation_stays_on_the_decode_engine_that_holds_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    pd = fleet({**PD, "http://d2:1": "decode"})
    first = await pd.decide(facts(2000), 1)
    policy = pd.router.policy  # long chains are recorded behind the request: here, by hand
    assert isinstance(policy, CacheAware)
    policy.record_pending()
    turn = await pd.decide(facts(2100), 1)  # the same conversation, 100 tokens longer
    assert turn.reason == "short" and turn.decision.backend is first.decision.backend


async def test_a_saturated_prefill_pool_sends_the_request_to_a_whole_engine(
    autojump_clock: trio.abc.Clock,
) -> None:
    pd = fleet({**PD, "http://d2:1": "decode", "http://both:1": "both"})
    pd.router.gate.limits = dataclasses.replace(pd.router.gate.limits, ceiling=1)
    for turn in range(2):  # each prefill engine (and each decode engine) takes one
        await pd.decide(facts(2000, start=turn * 5000), 1)
    way = await pd.decide(facts(2000, start=20000), 1)
    assert way.reason == "prefill saturated" and way.decision.backend.role == "both"


async def test_no_prefill_engine_left_means_the_vllm_decode_prefills_itself(
    autojump_clock: trio.abc.Clock,
) -> None:
    pd = fleet(PD)
    for backend in pd.pool.backends:
        if backend.role == "prefill":
            backend.healthy = False
    way = await pd.decide(facts(2000), 1)
    assert way.reason == "no prefill engine" and way.decision.backend.role == "decode"
