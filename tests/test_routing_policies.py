"""The routing policies alone, on hand-made backends and loads (no Trio, no HTTP): cache_aware's
prefix hits, spreading a hot prefix, new prefixes placed by rendezvous on their first blocks
(two replicas with different load views agree), the hash route without tokens, prediction
feedback correcting the index; consistent_hash's sessions and replica agreement; the
per-backend balance test; runtime pool changes."""

from __future__ import annotations

from array import array
from collections import Counter

import pytest

from app.fleet.backends import Backend, backend_id
from app.fleet.pool import BackendPool
from app.routing.balance import Balance
from app.routing.block_index import block_hashes
from app.routing.cache_aware import CacheAware
from app.routing.decision import Decision, Prediction, RouteRequest
from app.routing.hashing import ConsistentHash
from app.routing.policies import RoutingParams, make_policy

BALANCE = Balance(abs_threshold=4, rel_threshold=1.5)


def backends(n: int = 4) -> list[Backend]:
    return [Backend(f"http://gpu-{i}:8000", healthy=True) for i in range(n)]


def prompt(
    system: int, question: int, system_tokens: int = 256, question_tokens: int = 20
) -> RouteRequest:
    tokens = [system * 100_000 + i for i in range(system_tokens)]
    tokens += [900_000 + question * 100 + i for i in range(question_tokens)]
    return RouteRequest(token_ids=array("I", tokens))


def policy() -> CacheAware:
    return CacheAware(cache_threshold=0.3, balance=BALANCE, max_index_blocks=10_000)


# --- balance ----------------------------------------------------------------------------------


def test_a_backend_is_overloaded_only_past_both_thresholds() -> None:
    assert BALANCE.overloaded(5, 0)
    assert not BALANCE.overloaded(4, 0)  # not more than 4 above the least loaded
    assert not BALANCE.overloaded(14, 10)  # within 1.5x
    assert BALANCE.overloaded(16, 10)


# --- cache_aware ------------------------------------------------------------------------------


def test_requests_sharing_a_system_prompt_follow_it() -> None:
    pool, ca = backends(), policy()
    first = ca.choose(pool, prompt(1, 0))
    assert first.reason == "new-prefix" and first.prediction is not None
    assert first.prediction.blocks == 0
    for question in range(1, 6):
        decision = ca.choose(pool, prompt(1, question))
        assert (decision.backend, decision.reason) == (first.backend, "prefix-hit")
        assert decision.prediction is not None and decision.prediction.blocks == 16


def test_new_prefixes_spread_evenly_and_skip_only_backends_past_the_balance_bound() -> None:
    pool, ca = backends(), policy()
    chosen = Counter(ca.choose(pool, prompt(system, 0)).backend.url for system in range(400))
    assert len(chosen) == 4 and min(chosen.values()) >= 70  # 100 each on average
    # A new prefix whose first choice is overloaded goes to its next choice, and only then.
    first_choice = policy().choose(pool, prompt(500, 0)).backend
    first_choice.inflight = 4  # 4 above the others: within abs_threshold 4
    assert policy().choose(pool, prompt(500, 1)).backend is first_choice
    first_choice.inflight = 5  # past both thresholds
    assert policy().choose(pool, prompt(500, 1)).backend is not first_choice


def backends_like(pool: list[Backend]) -> list[Backend]:
    """The same backends as another replica sees them: its own objects, no load."""
    return [Backend(b.url, healthy=True) for b in pool]


def test_two_replicas_with_different_loads_place_new_prefixes_alike() -> None:
    """Two independent routers (replicas, no shared state, no events) whose load views
    differ, within the balance bound: every new prefix lands on the same backend in both,
    and the next request for it is a prefix hit on that backend from either replica."""
    mine, theirs = backends(), backends_like(backends())
    for backend, load in zip(mine, (0, 3, 1, 4), strict=True):
        backend.inflight = load
    for backend, load in zip(theirs, (4, 0, 2, 1), strict=True):
        backend.inflight = load
    first, second = policy(), policy()
    for system in range(60):
        here = first.choose(mine, prompt(system, 0))
        there = second.choose(theirs, prompt(system, 1))
        assert (here.reason, there.reason) == ("new-prefix", "new-prefix")
        assert here.backend.url == there.backend.url, system
    # Each replica now holds, from its own routing alone, what the other placed.
    again = second.choose(theirs, prompt(7, 2))
    assert again.reason == "prefix-hit"
    assert again.backend.url == first.choose(mine, prompt(7, 3)).backend.url


def test_the_longest_held_prefix_wins_while_its_load_allows() -> None:
    pool, ca = backends(2), policy()
    short = RouteRequest(token_ids=list(range(200)))
    long = RouteRequest(token_ids=list(range(600)))
    first = ca.choose(pool, short)
    other = pool[1] if first.backend is pool[0] else pool[0]
    ca.choose([other], long)  # `other` holds the whole long conversation
    while ca.record_pending():  # recorded behind the request, as the router's task does
        pass
    other.inflight = 2
    decision = ca.choose(pool, long)
    assert (decision.backend, decision.reason) == (other, "prefix-hit")
    other.inflight = 10  # now too busy: the shorter holder is the next best
    decision = ca.choose(pool, long)
    assert (decision.backend, decision.reason) == (first.backend, "prefix-hit")


def test_a_hot_prefix_spreads_to_more_holders_then_shares_them_by_load() -> None:
    pool, ca = backends(), policy()
    home = ca.choose(pool, prompt(7, 0)).backend
    home.inflight = 9  # far above everyone else
    spread = ca.choose(pool, prompt(7, 1))
    assert spread.reason == "spread" and spread.backend is not home
    # Replicas agree on the new holder: a fresh policy with the same view picks the same.
    twin = policy()
    twin.choose([home], prompt(7, 0))
    assert twin.choose(pool, prompt(7, 1)).backend is spread.backend
    # From now on both are holders; the less busy one gets the prefix's traffic.
    again = ca.choose(pool, prompt(7, 2))
    assert (again.backend, again.reason) == (spread.backend, "prefix-hit")
    spread.backend.inflight, home.inflight = 6, 3
    assert ca.choose(pool, prompt(7, 3)).backend is home


def test_a_small_shared_part_is_not_a_prefix_hit() -> None:
    pool, ca = backends(2), policy()
    ca.choose(pool, prompt(3, 0, system_tokens=32, question_tokens=20))
    # 32 shared tokens of a 232-token prompt: under the 0.3 threshold.
    decision = ca.choose(pool, prompt(3, 1, system_tokens=32, question_tokens=200))
    assert decision.reason == "new-prefix"


def test_without_tokens_the_prompt_start_is_hashed_and_busy_backends_skipped() -> None:
    pool, ca = backends(), policy()
    text = "system: you are a pirate. " * 40
    first = ca.choose(pool, RouteRequest(text=text + "question 1"))
    assert first.reason == "hash"
    assert ca.choose(pool, RouteRequest(text=text + "question 2")).backend is first.backend
    first.backend.inflight = 10
    assert ca.choose(pool, RouteRequest(text=text + "question 3")).backend is not first.backend
    assert ca.choose(pool, RouteRequest()).reason == "least-load"
    assert ca.choose(pool, RouteRequest(token_ids=[1, 2, 3])).reason == "least-load"


def test_feedback_corrects_the_index_after_an_eviction() -> None:
    pool, ca = backends(1), policy()
    backend = pool[0]
    older = ca.choose(pool, prompt(1, 0))
    ca.choose(pool, prompt(2, 0))
    decision = ca.choose(pool, prompt(2, 1))
    assert decision.prediction is not None and decision.prediction.blocks == 16
    assert ca.feedback(decision, 256, 276) == "hit"
    assert ca.predictions.corrections == 0
    # The backend says it served nothing from cache: it evicted system prompt 2, and with
    # it (LRU) everything it used before, i.e. system prompt 1 too.
    decision = ca.choose(pool, prompt(2, 2))
    assert ca.feedback(decision, 0, 276) == "false-hit"
    assert ca.predictions.corrections == 1
    assert ca.index.match(backend.id, ca_hashes(prompt(1, 5))) == 0
    # What it just recomputed, it holds again.
    again = ca.choose(pool, prompt(2, 3)).prediction
    assert again is not None and again.blocks == 16
    assert older.reason == "new-prefix"


def ca_hashes(request: RouteRequest) -> list[int]:
    assert request.token_ids is not None
    return block_hashes(request.token_ids)


def test_feedback_outcomes_and_unreported_answers() -> None:
    ca = policy()
    backend = backends(1)[0]
    fresh = Decision(backend, "least-load", Prediction(100, 0, ()))
    assert ca.feedback(fresh, None, None) == "unreported"
    assert ca.feedback(fresh, 0, 100) == "miss"
    assert ca.feedback(fresh, 64, 100) == "surprise-hit"
    assert ca.feedback(Decision(backend, "hash"), 10, 100) == "unreported"
    snapshot = ca.snapshot()
    assert snapshot["prediction"]["outcomes"]["surprise-hit"] == 1
    assert snapshot["index"]["max_blocks"] == 10_000


def test_prediction_never_claims_the_last_token() -> None:
    assert Prediction(32, 2, (2, 1)).cached_tokens == 16
    assert Prediction(33, 2, (2, 1)).cached_tokens == 32


# --- consistent_hash --------------------------------------------------------------------------


def test_sessions_stick_replicas_agree_and_removal_moves_only_its_keys() -> None:
    pool = backends()
    one, two = ConsistentHash(BALANCE), ConsistentHash(BALANCE)
    sessions = [f"user-{i}" for i in range(60)]
    placed = {s: one.choose(pool, RouteRequest(session=s)).backend for s in sessions}
    assert {one.choose(pool, RouteRequest(session=s)).reason for s in sessions} == {"session"}
    assert all(
        two.choose(pool[::-1], RouteRequest(session=s)).backend is placed[s] for s in sessions
    )
    assert len(set(placed.values())) == 4
    gone = pool[2]
    remaining = [b for b in pool if b is not gone]
    for s in sessions:
        now = one.choose(remaining, RouteRequest(session=s)).backend
        if placed[s] is not gone:
            assert now is placed[s]
    assert one.choose(pool, RouteRequest(text="hello")).reason == "hash"


def test_a_busy_sessions_backend_is_skipped() -> None:
    pool = backends()
    ch = ConsistentHash(BALANCE)
    home = ch.choose(pool, RouteRequest(session="s")).backend
    home.inflight = 20
    assert ch.choose(pool, RouteRequest(session="s")).backend is not home


def test_make_policy_knows_every_name() -> None:
    for name in ("cache_aware", "consistent_hash", "round_robin", "random", "power_of_two"):
        assert make_policy(name, params=RoutingParams()).name == name
    with pytest.raises(ValueError):
        make_policy("nope")


# --- the pool at run time ---------------------------------------------------------------------


def test_backends_join_and_leave_and_have_stable_ids() -> None:
    pool = BackendPool(("http://a:1/",), failures_to_open=1, cooldown=1, probe_path="/health")
    added = pool.add("http://b:2")
    assert added.id == backend_id("http://b:2") and not added.healthy
    assert pool.find(added.id) is added and pool.find("http://b:2/") is added
    with pytest.raises(ValueError):
        pool.add("http://b:2/")
    added.inflight = 1
    pool.drain(added, now=10.0, timeout=5.0)
    assert pool.find(added.id) is None and len(pool.backends) == 1
    assert pool.drained(now=12.0) == [] and [d.backend for d in pool.draining] == [added]
    back = pool.add("http://b:2")  # its URL joins again while the old one drains: a new one
    assert back is not added and back.id == added.id
    added.inflight = 0
    assert [d.backend for d in pool.drained(now=12.5)] == [added] and pool.draining == []
    b = pool.backends[0]
    b.inflight, b.reported_waiting, b.pending_tokens = 2, 1, 2048
    assert b.load == 5.0


# --- long prompts: recorded behind their requests ---------------------------------------------


def long_prompt(system: int, blocks: int) -> RouteRequest:
    tokens = array("I", [system * 100_000 + i for i in range(blocks * 16)])
    return RouteRequest(token_ids=tokens, block_hashes=block_hashes(tokens))


def test_a_long_prompt_is_recorded_a_slice_at_a_time_after_it_was_routed() -> None:
    pool, ca = backends(), policy()
    first = ca.choose(pool, long_prompt(1, 1000))
    assert len(ca.index) == 0 and len(ca.pending) == 1  # routing did not record it
    assert ca.choose(pool, long_prompt(1, 1000)).reason == "new-prefix"  # placed alike
    slices = 0
    while ca.record_pending(most=256):
        slices += 1
        assert len(ca.index) == min(256 * slices, 1000)  # a slice at a time
    assert len(ca.index) == 1000  # both requests' chains, one backend's 1,000 blocks
    again = ca.choose(pool, long_prompt(1, 1000))
    assert again.reason == "prefix-hit" and again.backend is first.backend
    assert again.prediction is not None and again.prediction.blocks == 1000


def test_chains_waiting_to_be_recorded_are_bounded_and_forgotten_with_their_backend() -> None:
    pool = backends(2)
    ca = CacheAware(cache_threshold=0.3, balance=BALANCE, max_index_blocks=2500)
    for system in range(5):
        ca.choose(pool, long_prompt(system, 1000))
    assert sum(chain.end for chain in ca.pending) <= 2500  # the oldest dropped
    gone = pool[0]
    ca.forget(gone)
    assert all(chain.holder != gone.id for chain in ca.pending)
    while ca.record_pending():
        pass
    assert ca.index.blocks(gone.id) == 0
