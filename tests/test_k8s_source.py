"""The Kubernetes discovery source (app/fleet/k8s_source.py) against the stand-in API server
(load/kube_api.py), with a kubeconfig the test writes: list then watch, Ready and deletion,
a watch cut mid-stream and resumed from its version, 410 Gone (as the watch's status and as
an ERROR event) answered by a relist that misses nothing, a bad token reported, and the
in-cluster service-account configuration lightkube reads."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import pytest
import trio
from lightkube import KubeConfig

from app.discovery_targets import K8sTarget
from app.errors import ConfigError
from app.fleet import k8s_watch
from app.fleet.discoverer import SourceReport
from app.fleet.discovery import Endpoint
from app.fleet.k8s_source import K8sSource, kube_client
from app.fleet.k8s_watch import PodRules
from load.kube_api import KubeApi, kubeconfig, serving

NS = "inference"
TARGET = K8sTarget.parse(f"{NS}/app=vllm")


class Recorder:
    """What a source reported, and a way to wait until it reports something."""

    def __init__(self) -> None:
        self.sightings: list[list[str]] = []
        self.failures: list[str] = []
        self._changed = trio.Event()

    def sighting(self, endpoints: Iterable[Endpoint]) -> None:
        self.sightings.append(sorted(e.url for e in endpoints))
        self._wake()

    def failed(self, error: str) -> None:
        self.failures.append(error)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, holds: Callable[[Recorder], bool]) -> None:
        with trio.fail_after(10):
            while not holds(self):
                await self._changed.wait()

    async def sees(self, *ips: str) -> None:
        wanted = sorted(f"http://{ip}:8000" for ip in ips)
        await self.until(lambda r: bool(r.sightings) and r.sightings[-1] == wanted)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s_watch, "BACKOFF_FIRST_S", 0.01)


async def run_source(
    api: KubeApi, tmp_path: Path, nursery: trio.Nursery, token: str | None = None
) -> Recorder:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig(api, NS))
    if token is not None:
        path.write_text(path.read_text().replace(api.token, token))
    client = kube_client(KubeConfig.from_file(path))
    source = K8sSource(TARGET, PodRules(8000), client)
    recorder = Recorder()
    nursery.start_soon(source.run, cast(SourceReport, recorder))
    return recorder


def pods(api: KubeApi, *names: str, ready: bool = True, **labels: Any) -> None:
    for name in names:
        api.add(NS, name, f"10.0.0.{name[-1]}", {"app": "vllm", **labels}, ready=ready)


async def test_list_then_watch_follows_ready_pods_and_deletions(tmp_path: Path) -> None:
    async with serving() as api, trio.open_nursery() as nursery:
        pods(api, "p1", "p2")
        pods(api, "p3", ready=False)
        api.add(NS, "other", "10.0.9.9", {"app": "else"}, ready=True)
        api.add("elsewhere", "p4", "10.0.0.4", {"app": "vllm"}, ready=True)
        recorder = await run_source(api, tmp_path, nursery)
        await recorder.sees("10.0.0.1", "10.0.0.2")
        api.set_ready(NS, "p3")
        await recorder.sees("10.0.0.1", "10.0.0.2", "10.0.0.3")
        api.delete(NS, "p1")  # marked first: it leaves on the mark, before it is gone
        await recorder.sees("10.0.0.2", "10.0.0.3")
        api.set_ready(NS, "p2", False)
        await recorder.sees("10.0.0.3")
        api.bookmark()
        pods(api, "p5")
        await recorder.sees("10.0.0.3", "10.0.0.5")
        assert api.requests["list"] == 1 and api.requests["watch"] == 1
        assert recorder.failures == []
        nursery.cancel_scope.cancel()


async def test_a_cut_watch_resumes_from_its_version(tmp_path: Path) -> None:
    async with serving() as api, trio.open_nursery() as nursery:
        pods(api, "p1", "p2")
        recorder = await run_source(api, tmp_path, nursery)
        await recorder.sees("10.0.0.1", "10.0.0.2")
        await api.watching(1)
        api.cut_watches()
        api.delete(NS, "p1", graceful=False)  # while no watch is open
        pods(api, "p3")
        await recorder.sees("10.0.0.2", "10.0.0.3")
        assert api.requests["list"] == 1 and api.requests["watch"] == 2
        assert len(recorder.failures) == 1
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("as_event", [True, False])
async def test_gone_relists_and_misses_nothing(tmp_path: Path, as_event: bool) -> None:
    async with serving() as api, trio.open_nursery() as nursery:
        api.gone_as_event = as_event
        pods(api, "p1", "p2", "p3")
        recorder = await run_source(api, tmp_path, nursery)
        await recorder.sees("10.0.0.1", "10.0.0.2", "10.0.0.3")
        await api.watching(1)
        api.cut_watches()
        api.delete(NS, "p1", graceful=False)
        api.set_ready(NS, "p2", False)
        pods(api, "p4")
        api.compact()  # the watch's version is gone by the time it reconnects
        await recorder.sees("10.0.0.3", "10.0.0.4")
        assert api.requests["gone"] == 1 and api.requests["list"] == 2
        assert len(recorder.sightings) == 2  # the relist's set, whole: nothing in between
        nursery.cancel_scope.cancel()


async def test_an_expired_live_watch_relists(tmp_path: Path) -> None:
    async with serving() as api, trio.open_nursery() as nursery:
        pods(api, "p1")
        recorder = await run_source(api, tmp_path, nursery)
        await recorder.sees("10.0.0.1")
        await api.watching(1)
        api.expire_watches()
        await api.watching(0)
        await api.watching(1)
        assert api.requests["list"] == 2
        pods(api, "p2")
        await recorder.sees("10.0.0.1", "10.0.0.2")
        assert recorder.failures == []  # a 410 is routine, not a failure
        nursery.cancel_scope.cancel()


async def test_a_refused_token_is_reported_and_nothing_published(tmp_path: Path) -> None:
    async with serving() as api, trio.open_nursery() as nursery:
        pods(api, "p1")
        recorder = await run_source(api, tmp_path, nursery, token="wrong")
        await recorder.until(lambda r: len(r.failures) >= 2)
        assert "HTTP 401" in recorder.failures[0] and recorder.sightings == []
        nursery.cancel_scope.cancel()


def test_no_credentials_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="no Kubernetes credentials"):
        kube_client()


def service_account(directory: Path, token: str) -> tuple[Path, ssl.SSLContext]:
    """A pod's service-account directory (token, namespace, the API server's CA) and the
    stand-in's TLS context, with a certificate for 127.0.0.1 made by openssl."""
    directory.mkdir()
    key, cert = directory / "server.key", directory / "ca.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    (directory / "token").write_text(token)
    (directory / "namespace").write_text(NS)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    return directory, tls


async def test_in_cluster_over_tls_and_a_rotated_token_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account, tls = service_account(tmp_path / "serviceaccount", "first")
    async with serving(KubeApi(token="first"), tls) as api, trio.open_nursery() as nursery:
        host, port = api.url.removeprefix("https://").split(":")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        client = kube_client(KubeConfig.from_service_account(account))
        recorder = Recorder()
        source = K8sSource(TARGET, PodRules(8000), client)
        nursery.start_soon(source.run, cast(SourceReport, recorder))
        pods(api, "p1")
        await recorder.sees("10.0.0.1")
        (account / "token").write_text("second")  # the kubelet rotates it
        api.token = "second"
        await api.watching(1)
        api.cut_watches()  # the next watch carries the old token: 401, read again, retried
        pods(api, "p2")
        await recorder.sees("10.0.0.1", "10.0.0.2")
        assert api.requests["unauthorized"] == 1 and recorder.failures == [recorder.failures[0]]
        nursery.cancel_scope.cancel()
