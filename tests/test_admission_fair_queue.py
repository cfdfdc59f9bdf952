"""The fair queue of held requests alone (app/routing/admission.py's `FairQueue`) and the fair
shares the dashboard reports (`fair_shares`, max-min by weight).

Covers: start-time fair queuing by weight (a light tenant never waits behind a heavy one's
backlog, weights share what leaves, an idle tenant comes back without credit), priority bands,
the two bounds (per tenant, and the whole queue, which pushes out the heaviest tenant's newest),
a tenant alone holding the whole queue, a key that sent lately binding the others, and the
affinity window bending fairness by a few places only.
"""

from __future__ import annotations

from app.observe.admission_stats import fair_shares
from app.routing.admission import CONTENDED_S, FairQueue, Held


def held(tenant: str, at: float = 0.0, weight: float = 1.0, priority: int = 0) -> Held:
    return Held(tenant, weight, priority, at)


def order(queue: FairQueue) -> list[str]:
    out = []
    while (next_one := queue.pop()) is not None:
        out.append(next_one.tenant)
    return out


def test_a_light_tenant_never_waits_behind_a_heavy_ones_backlog() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i in range(10):
        queue.push(held("heavy", at=i))
    queue.push(held("light", at=10))
    assert order(queue)[:2] == ["heavy", "light"]


def test_weights_share_what_leaves() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i in range(12):
        queue.push(held("two", at=i, weight=2.0))
        queue.push(held("one", at=i, weight=1.0))
    first = order(queue)[:12]
    assert first.count("two") == 8 and first.count("one") == 4


def test_an_idle_tenant_comes_back_without_credit() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i in range(6):
        queue.push(held("busy", at=i))
    for _ in range(4):
        queue.pop()
    queue.push(held("back", at=10))  # idle all along: it starts at the present
    queue.push(held("back", at=11))
    # It starts where fair time is now, level with busy's next, not four turns back.
    assert order(queue) == ["back", "busy", "back", "busy"]


def test_a_lower_band_leaves_first_whoever_sent_it() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    queue.push(held("a", at=0, priority=1))
    queue.push(held("b", at=1, priority=0))
    assert queue.holds_ahead_of(0) and not queue.holds_ahead_of(-1)
    assert order(queue) == ["b", "a"]


def test_a_tenant_over_its_bound_is_refused_and_a_full_queue_sheds_the_heaviest() -> None:
    queue = FairQueue(max_held=4, max_per_tenant=3)
    first = [held("heavy", at=i) for i in range(3)]
    for entry in first:
        assert queue.push(entry) is None
    assert queue.push(held("light", at=3)) is None
    over = held("heavy", at=4)
    assert queue.push(over) is over  # its own bound, others holding too
    pushed_out = queue.push(held("other", at=5))
    assert pushed_out is first[-1]  # the queue was full: the heaviest's newest made room
    late = held("light", at=6)
    assert queue.push(late) is late  # no tenant holds more than one more than light
    assert len(queue) == 4 and queue.held_by("heavy") == 2


def test_a_tenant_alone_may_hold_the_whole_queue_and_is_pushed_out_when_others_come() -> None:
    """Nobody to protect: the anonymous tenant of a proxy without keys, bursting, is held
    up to the queue's bound, not its own; a newcomer of another tenant then makes room."""
    queue = FairQueue(max_held=4, max_per_tenant=2)
    burst = [held("anonymous", at=i) for i in range(4)]
    for entry in burst:
        assert queue.push(entry) is None
    over = held("anonymous", at=4)
    assert queue.push(over) is over  # the queue's own bound
    assert queue.push(held("key-1", at=5)) is burst[-1]
    late = held("anonymous", at=6)
    assert queue.push(late) is late  # over its own bound, now that another key sends too
    assert order(queue) == ["anonymous", "key-1", "anonymous", "anonymous"]


def test_a_key_that_sent_lately_binds_the_others_though_none_of_its_requests_is_held() -> None:
    """A light key's requests leave first and are seldom held: its coming within the last
    CONTENDED_S is what binds a heavy key to its bound, not its held requests."""
    queue = FairQueue(max_held=8, max_per_tenant=2)
    queue.push(held("light", at=0.0))
    assert order(queue) == ["light"]  # it left at once
    for at in (1.0, 2.0):
        assert queue.push(held("heavy", at=at)) is None
    over = held("heavy", at=3.0)
    assert queue.push(over) is over  # light came 3 s ago
    quiet = held("heavy", at=CONTENDED_S + 0.5)
    assert queue.push(quiet) is None  # light quiet for longer: heavy is alone


def test_the_affinity_window_bends_fairness_by_a_few_places_only() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i, tenant in enumerate("abcdef"):
        entry = held(tenant, at=i)
        entry.prefers = "gpu-2" if tenant in "cf" else None
        queue.push(entry)
    wants_gpu_2 = lambda entry: entry.prefers == "gpu-2"  # noqa: E731
    first = queue.pop(prefer=wants_gpu_2, window=4)
    assert first is not None and first.tenant == "c"
    second = queue.pop(prefer=wants_gpu_2, window=2)  # f is 5th in order: out of reach
    assert second is not None and second.tenant == "a"


def test_fair_shares_are_max_min_by_weight() -> None:
    assert fair_shares({"a": 10, "b": 100}, {}, 60) == {"a": 10.0, "b": 50.0}
    assert fair_shares({"a": 100, "b": 100}, {"a": 3.0}, 80) == {"a": 60.0, "b": 20.0}
    assert fair_shares({"a": 0, "b": 5}, {}, 5) == {"a": 0.0, "b": 5.0}
