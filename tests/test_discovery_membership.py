"""Discovery's pure parts: what a source's whole set changes in the pool (joins, leaves,
an engine whose role or models changed, two sources naming one engine, the operator's
removal), and the flags that name sources, parsed as a user writes them (flags, SLUICE_*
variables, the TOML file), a bad one stopping `sluice` with a line naming it; and which
backends of a fleet of hundreds the dashboard shows a row of."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from app.cli.command import ConfigExit, parse
from app.config import Settings
from app.dashboard.snapshot import SHOWN_BACKENDS, shown_backends
from app.discovery_targets import DnsServer, DnsTarget, K8sTarget, check_discovery
from app.fleet.discovery import STATIC_SOURCE, Endpoint, Membership
from app.fleet.pool import BackendPool

A, B, C = (Endpoint(f"http://10.0.0.{n}:8000") for n in (1, 2, 3))


def test_a_whole_set_joins_what_is_new_and_drains_what_is_gone() -> None:
    membership = Membership()
    first = membership.sighted("dns:x:8000", [A, B])
    assert first.joins == ((A, "dns:x:8000"), (B, "dns:x:8000")) and first.leaves == ()
    again = membership.sighted("dns:x:8000", [B, A])
    assert again.joins == () and again.leaves == ()
    moved = membership.sighted("dns:x:8000", [B, C])
    assert moved.joins == ((C, "dns:x:8000"),) and moved.leaves == (A.url,)
    empty = membership.sighted("dns:x:8000", [])
    assert empty.joins == () and set(empty.leaves) == {B.url, C.url}
    assert membership.counts() == {"dns:x:8000": 0}


def test_an_engine_whose_word_changed_leaves_and_joins_again() -> None:
    membership = Membership()
    membership.sighted("k8s:ns/app=vllm", [A])
    as_prefill = Endpoint(A.url, role="prefill", bootstrap_port=8998)
    changes = membership.sighted("k8s:ns/app=vllm", [as_prefill])
    assert changes.leaves == (A.url,) and changes.joins == ((as_prefill, "k8s:ns/app=vllm"),)
    named = Endpoint(A.url, role="prefill", bootstrap_port=8998, models=("m",))
    assert membership.sighted("k8s:ns/app=vllm", [named]).leaves == (A.url,)


def test_an_engine_stays_while_any_source_sees_it() -> None:
    membership = Membership()
    membership.sighted(STATIC_SOURCE, [A])
    assert membership.sighted("dns:x:8000", [A, B]).joins == ((B, "dns:x:8000"),)
    gone = membership.sighted("dns:x:8000", [])
    assert gone.leaves == (B.url,)  # A is a static backend too: it stays
    membership.sighted("dns:y:8000", [C])
    assert membership.sighted("dns:x:8000", [C]).joins == ()  # seen by y already


def test_a_url_is_one_engine_with_or_without_its_slash() -> None:
    membership = Membership()
    membership.sighted("dns:x:8000", [Endpoint("http://10.0.0.1:8000/")])
    assert membership.sighted("dns:x:8000", [A]).leaves == ()


def test_the_operators_removal_holds_until_a_source_lists_it_again() -> None:
    membership = Membership()
    membership.sighted("dns:x:8000", [A, B])
    membership.forget(A.url)
    assert membership.counts() == {"dns:x:8000": 1}
    assert membership.sighted("dns:x:8000", [A, B]).joins == ((A, "dns:x:8000"),)


@pytest.mark.parametrize(
    ("text", "target"),
    [
        (
            "vllm.inference.svc.cluster.local:8000",
            DnsTarget("vllm.inference.svc.cluster.local", 8000),
        ),
        ("engines.test.:80", DnsTarget("engines.test", 80)),
        ("_http._tcp.vllm.ns.svc", DnsTarget("_http._tcp.vllm.ns.svc", None)),
    ],
)
def test_dns_targets_parse(text: str, target: DnsTarget) -> None:
    assert DnsTarget.parse(text) == target


@pytest.mark.parametrize(
    "text", ["vllm", "vllm:", "vllm:0", "vllm:70000", "-bad-:80", "_http.vllm", "a b:80"]
)
def test_bad_dns_targets_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="--discover-dns"):
        DnsTarget.parse(text)


def test_the_other_discovery_flags_parse_and_refuse() -> None:
    assert DnsServer.parse("127.0.0.1:5353") == DnsServer("127.0.0.1", 5353)
    assert DnsServer.parse("[::1]:53") == DnsServer("::1", 53)
    assert K8sTarget.parse("inference/app=vllm,tier in (gpu)") == K8sTarget(
        "inference", "app=vllm,tier in (gpu)"
    )
    assert K8sTarget.parse("ns/app=vllm").source == "k8s:ns/app=vllm"
    assert DnsTarget.parse("x.y:8000").source == "dns:x.y:8000"
    good = Settings(discover_dns=("a.test:80",))
    for bad in (
        {"discover_dns": ("x",)},
        {"dns_server": "dns.google:53"},
        {"discover_k8s": "Bad_NS/app=x"},
        {"discover_k8s_port": 0},
        {"discover_k8s": "ns/app=x", "discover_k8s_prefill": "role in ("},
    ):
        with pytest.raises(ValueError):
            check_discovery(replace(good, **bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--discover-k8s"):
        K8sTarget.parse("ns/")


def test_discovery_flags_come_from_flags_env_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SLUICE_BACKEND", "SLUICE_BACKENDS", "SLUICE_DISCOVER_DNS"):
        monkeypatch.delenv(name, raising=False)
    _, flags = parse(
        ["serve", "--discover-dns", "a.test:8000", "--discover-dns", "_http._tcp.b.test"]
    )
    assert isinstance(flags, Settings) and flags.backends == ()  # discovery alone will do
    assert flags.discover_dns == ("a.test:8000", "_http._tcp.b.test")
    config = tmp_path / "fleet.toml"
    config.write_text(
        'discover-k8s = "inference/app=vllm"\ndiscover_k8s_port = 8080\ndrain-timeout = 45\n'
    )
    monkeypatch.setenv("SLUICE_DISCOVER_DNS", "c.test:80,d.test:81")
    monkeypatch.setenv("SLUICE_DNS_SERVER", "127.0.0.1:5353")
    _, settings = parse(["serve", "--config", str(config), "--discover-interval", "2"])
    assert isinstance(settings, Settings)
    assert settings.discover_dns == ("c.test:80", "d.test:81")
    assert (settings.discover_k8s, settings.discover_k8s_port) == ("inference/app=vllm", 8080)
    assert (settings.dns_server, settings.discover_interval, settings.drain_timeout) == (
        "127.0.0.1:5353",
        2.0,
        45.0,
    )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--discover-dns", "engines"], "--discover-dns 'engines': expected NAME:PORT"),
        (["--backend", "http://x:1", "--dns-server", "localhost"], "--dns-server"),
        (["--discover-k8s", "just-a-namespace"], "NAMESPACE/LABEL_SELECTOR"),
        (["--discover-dns", "a.test:1", "--discover-interval", "0"], "must be positive"),
        (["--discover-dns", "a.test:1", "--drain-timeout", "-1"], "must not be negative"),
        ([], "--discover-dns/--discover-k8s"),
    ],
)
def test_bad_discovery_flags_stop_sluice_naming_the_flag(
    flags: list[str], words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SLUICE_BACKEND", "SLUICE_BACKENDS", "SLUICE_DISCOVER_DNS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigExit, match=re.escape(words)):
        parse(["serve", *flags])


def test_a_fleet_of_hundreds_shows_the_backends_that_matter_and_counts_them_all() -> None:
    pool = BackendPool((), failures_to_open=1, cooldown=1, probe_path="/health")
    members = [pool.add(f"http://10.0.0.{n}:8000") for n in range(1, 201)]
    for backend in members:
        backend.healthy = True
    members[7].healthy = False
    members[150].inflight = 9
    pool.drain(members[3], now=0.0, timeout=30.0)
    shown = shown_backends(pool.members, [d.backend for d in pool.draining])
    assert len(shown) == SHOWN_BACKENDS
    assert {members[3], members[7], members[150]} <= set(shown)
    assert shown == [b for b in pool.members if b in set(shown)]  # in the pool's order
    assert len(pool.members_summary(0.0)) == 200
    few = pool.members[:10]
    assert shown_backends(few, []) == few


def test_kubernetes_discovery_without_credentials_stops_sluice_with_one_line(
    tmp_path: Path,
) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    command = [sys.executable, "-m", "app", "serve", "--discover-k8s", "inference/app=vllm"]
    ran = subprocess.run(
        [*command, "--port", "0", "--dashboard-port", "0"],
        env={**env, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines()[-1].startswith("sluice: --discover-k8s: no Kubernetes")
