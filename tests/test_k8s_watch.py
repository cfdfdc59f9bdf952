"""The Kubernetes reflector alone (app/fleet/k8s_watch.py) and the label selectors it matches
roles by (app/discovery_targets.py): every transition of list + watch (pages, events,
bookmarks, a clean end, a cut, 410 Gone both ways, back-off), and which pods are engines
(Ready, not being deleted, with an IP; port, models, role and bootstrap port)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest

from app.discovery_targets import LabelSelector
from app.fleet.discovery import Endpoint
from app.fleet.k8s_watch import (
    BACKOFF_MAX_S,
    JOIN_SLICE,
    MAX_DISCOVERED,
    ListMeta,
    ListPage,
    Pod,
    PodList,
    PodRules,
    Reflector,
    Status,
    Wait,
    Watch,
    decode_event,
    endpoint_of,
)
from load.kube_api import pod_manifest

RULES = PodRules(8000, LabelSelector.parse("role=prefill"), LabelSelector.parse("role in (decode)"))


def manifest(name: str, ip: str, *, ready: bool = True, version: int = 1, **labels: str) -> Any:
    """A pod as the API server sends it (JSON's dicts)."""
    found = pod_manifest("ns", name, ip, labels)
    for condition in found["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = "True" if ready else "False"
    found["metadata"]["resourceVersion"] = str(version)
    return found


def pod(name: str, ip: str, **options: Any) -> Pod:
    return msgspec.convert(manifest(name, ip, **options), Pod)


def page(items: list[Pod], version: str, token: str | None = None) -> PodList:
    return PodList(ListMeta(version, token), tuple(items))


def event(kind: str, obj: Any) -> tuple[str, Pod | Status]:
    """A watch event as the source decodes it from its line."""
    if isinstance(obj, Pod):
        obj = msgspec.to_builtins(obj)
    return decode_event(json.dumps({"type": kind, "object": obj}).encode())


def urls(reflector: Reflector) -> list[str]:
    return [e.url for e in reflector.endpoints()]


def test_selectors_read_the_apis_syntax() -> None:
    selector = LabelSelector.parse("app=vllm, tier in (gpu, big),!canary,zone,env!=dev")
    assert selector.matches({"app": "vllm", "tier": "big", "zone": "a"})
    assert not selector.matches({"app": "vllm", "tier": "cpu", "zone": "a"})
    assert not selector.matches({"app": "vllm", "tier": "gpu", "zone": "a", "canary": "1"})
    assert not selector.matches({"app": "vllm", "tier": "gpu"})
    assert not selector.matches({"app": "vllm", "tier": "gpu", "zone": "a", "env": "dev"})
    assert LabelSelector.parse("a==b").matches({"a": "b"})
    assert LabelSelector.parse("a notin (x)").matches({})
    for bad in ("", "a=b,", "!a=b", "a in b", "=x"):
        with pytest.raises(ValueError, match="label selector"):
            LabelSelector.parse(bad)


def test_a_pod_is_an_engine_once_ready_with_an_ip_and_until_deleted() -> None:
    assert endpoint_of(pod("a", "10.0.0.1"), RULES) == Endpoint("http://10.0.0.1:8000")
    assert endpoint_of(pod("a", "10.0.0.1", ready=False), RULES) is None
    assert endpoint_of(pod("a", ""), RULES) is None
    leaving = manifest("a", "10.0.0.1")
    leaving["metadata"]["deletionTimestamp"] = "2026-11-28T00:00:00Z"
    assert endpoint_of(msgspec.convert(leaving, Pod), RULES) is None
    assert endpoint_of(pod("a", "fd00::1"), RULES) == Endpoint("http://[fd00::1]:8000")


def test_port_models_role_and_bootstrap_port_come_from_labels_and_annotations() -> None:
    prefill = manifest("p", "10.0.0.2", role="prefill")
    prefill["metadata"]["annotations"] = {
        "sluice.io/port": "9000",
        "sluice.io/bootstrap-port": "8998",
        "sluice.io/models": "org/m, org/m-lora",
    }
    assert endpoint_of(msgspec.convert(prefill, Pod), RULES) == Endpoint(
        "http://10.0.0.2:9000", "prefill", 8998, ("org/m", "org/m-lora")
    )
    decode = manifest("d", "10.0.0.3", role="decode")
    decode["metadata"]["annotations"] = {"sluice.io/port": "x", "sluice.io/bootstrap-port": "1"}
    assert endpoint_of(msgspec.convert(decode, Pod), RULES) == Endpoint(
        "http://10.0.0.3:8000", "decode"
    )


def test_a_list_in_pages_then_a_watch_from_its_version() -> None:
    reflector = Reflector(RULES)
    assert reflector.start() == ListPage()
    assert reflector.listed(page([pod("a", "10.0.0.1")], "5", "next")) == ListPage("next")
    assert reflector.change() is None  # nothing published before the whole list
    assert reflector.listed(page([pod("b", "10.0.0.2", ready=False)], "9")) == Watch("5")
    assert [e.url for e in reflector.change() or ()] == ["http://10.0.0.1:8000"]
    assert reflector.change() is None  # unchanged


def events_applied_whole_or_one_by_one(one_by_one: bool) -> list[list[str]]:
    reflector = Reflector(RULES)
    reflector.listed(page([pod("a", "10.0.0.1")], "5"))
    events = [
        event("ADDED", pod("b", "10.0.0.2", ready=False, version=6)),
        event("MODIFIED", pod("b", "10.0.0.2", version=7)),
        event("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "8"}}),
        event("DELETED", pod("a", "10.0.0.1", version=9)),
        event("SOMETHING", {}),
    ]
    seen: list[list[str]] = [[e.url for e in reflector.change() or ()]]
    for one in events:
        assert reflector.event(*one) is None
        if one_by_one:
            seen.append([e.url for e in reflector.change() or ()])
    seen.append([e.url for e in reflector.change() or ()])
    assert reflector.resource_version == "9"
    assert reflector.closed() == Watch("9")
    return [s for s in seen if s]


def test_events_move_the_set_whether_applied_one_by_one_or_together() -> None:
    one_by_one = events_applied_whole_or_one_by_one(True)
    assert one_by_one == [
        ["http://10.0.0.1:8000"],
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        ["http://10.0.0.2:8000"],
    ]
    assert events_applied_whole_or_one_by_one(False) == [one_by_one[0], one_by_one[-1]]


def test_gone_relists_at_once_and_only_a_whole_list_replaces_what_was_known() -> None:
    for gone in (
        lambda r: r.failed(410),
        lambda r: r.event(*event("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})),
    ):
        reflector = Reflector(RULES)
        reflector.listed(page([pod("a", "10.0.0.1"), pod("b", "10.0.0.2")], "5"))
        reflector.change()
        assert gone(reflector) == ListPage()
        assert reflector.listed(page([pod("a", "10.0.0.1")], "20", "more")) == ListPage("more")
        assert urls(reflector) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        assert reflector.listed(page([], "20")) == Watch("20")
        assert reflector.change() == (Endpoint("http://10.0.0.1:8000"),)


def test_a_cut_or_an_error_backs_off_with_jitter_doubling_to_a_ceiling() -> None:
    reflector = Reflector(RULES, jitter=lambda: 0.999)
    assert reflector.failed(None) == Wait(pytest.approx(0.5, rel=0.01), ListPage())
    reflector.listed(page([], "5"))
    assert reflector.failures == 0
    waits = [reflector.failed(None) for _ in range(10)]
    assert all(isinstance(w, Wait) and w.then == Watch("5") for w in waits)
    seconds = [w.seconds for w in waits if isinstance(w, Wait)]
    assert seconds == sorted(seconds) and seconds[-1] == pytest.approx(BACKOFF_MAX_S, rel=0.01)
    assert reflector.event(*event("ERROR", {"code": 500})) == Wait(
        pytest.approx(BACKOFF_MAX_S, rel=0.01), Watch("5")
    )
    low = Reflector(RULES, jitter=lambda: 0.0)
    assert low.failed(None) == Wait(0.25, ListPage())  # half the ceiling at the least
    reflector.event(*event("BOOKMARK", {"metadata": {"resourceVersion": "6"}}))
    assert reflector.failures == 0 and reflector.failed(403) == Wait(
        pytest.approx(0.5, rel=0.01), Watch("6")
    )


def test_gone_again_right_after_a_relist_backs_off() -> None:
    reflector = Reflector(RULES, jitter=lambda: 0.0)
    assert reflector.failed(410) == ListPage()
    assert isinstance(reflector.failed(410), Wait)


def test_the_set_is_bounded_ordered_by_pod_name_and_joins_come_in_slices() -> None:
    reflector = Reflector(RULES)
    pods = [pod(f"p{i:05d}", f"10.1.{i // 250}.{i % 250}") for i in range(MAX_DISCOVERED + 10)]
    reflector.listed(page(pods[:-1], "1"))
    sets = []
    while (found := reflector.change()) is not None:
        sets.append(found)
    sizes = [*range(JOIN_SLICE, MAX_DISCOVERED, JOIN_SLICE), MAX_DISCOVERED]
    assert [len(s) for s in sets] == sizes
    assert all(set(a) <= set(b) for a, b in itertools.pairwise(sets))
    assert sets[-1][0].url == "http://10.1.0.0:8000"
    reflector.event(*event("DELETED", pods[0]))  # leaves at once, however many join
    assert len(reflector.change() or ()) == MAX_DISCOVERED and reflector.change() is None
