"""`--discover-k8s`: the pods of a namespace matching a label selector, listed and watched
through the Kubernetes API; the reflector (app/fleet/k8s_watch.py) decides, this module
only asks and reads.

Design rules:
1. Credentials and the server come from lightkube's `KubeConfig`: in a pod, the service
   account (its token file re-read when the API answers 401, as the kubelet rotates it; its
   CA); elsewhere `$KUBECONFIG` or ~/.kube/config. Its httpx2 client (Trio-capable through
   anyio) carries the requests. lightkube's own `watch` is not used: it backs off with
   `asyncio.sleep` (not under Trio), cannot ask for bookmarks, and after a 410 resumes
   from "now" instead of relisting; and it decodes every field of every pod into its
   models, where the reflector decodes the few it reads (k8s_watch.py, rule 6).
2. The reader applies events as they come; a publisher of its own sends the set on, at
   once after a quiet spell and then at most every `PUBLISH_EVERY_S`. Publishing walks
   the whole set, and 1,000 pods created together arrive as ~1,000 chunks: published
   per chunk, that was 1.4 s of the loop's time (joins come in slices too, k8s_watch.py
   rule 5).
3. The client (its kubeconfig or token and CA read, its TLS context and HTTP modules
   loaded: ~50 ms) is made once at start-up, before the proxy serves, and kept.
4. A watch asks the server to end it after `WATCH_S` (with jitter, as client-go does, so
   replicas do not reconnect together), and gives up on a connection silent for
   `WATCH_S` + `SILENT_GRACE_S`: bookmarks keep a healthy one talking.
"""

from __future__ import annotations

import random
from typing import Any

import httpx2
import msgspec
import trio
from lightkube import ConfigError as LightkubeConfigError
from lightkube import KubeConfig
from lightkube.config.client_adapter import AsyncClient, ConnectionParams

from app.discovery_targets import K8sTarget
from app.errors import ConfigError
from app.fleet.discoverer import SourceReport
from app.fleet.k8s_watch import (
    GONE,
    LIST_PAGE,
    Decision,
    ListPage,
    PodRules,
    Reflector,
    Wait,
    Watch,
    decode_event,
    decode_list,
)

WATCH_S = 300
SILENT_GRACE_S = 30.0
REQUEST_TIMEOUT_S = 10.0
PUBLISH_EVERY_S = 0.05


def kube_client(config: KubeConfig | None = None) -> httpx2.AsyncClient:
    """An HTTP client for the API server `config` names (default: in-cluster, else the
    kubeconfig), its credentials and CA applied to every request; a ConfigError when
    there are none."""
    try:
        single = (config or KubeConfig.from_env()).get()
        if single is None:
            raise ConfigError("the kubeconfig names no current context")
        return AsyncClient(single, ConnectionParams(timeout=httpx2.Timeout(REQUEST_TIMEOUT_S)))
    except (LightkubeConfigError, OSError, KeyError) as exc:
        raise ConfigError(f"--discover-k8s: no Kubernetes credentials: {exc}") from None


class K8sSource:
    """The discovery source of one `--discover-k8s NAMESPACE/SELECTOR`."""

    def __init__(self, target: K8sTarget, rules: PodRules, client: httpx2.AsyncClient) -> None:
        self.name = target.source
        self.target = target
        self.rules = rules
        self._client = client
        self._path = f"/api/v1/namespaces/{target.namespace}/pods"

    async def run(self, report: SourceReport) -> None:
        reflector, client, changed = Reflector(self.rules), self._client, _Wakeup()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_publish_changes, reflector, report, changed)
            decision: Decision = reflector.start()
            while True:
                if isinstance(decision, Wait):
                    await trio.sleep(decision.seconds)
                    decision = decision.then
                if isinstance(decision, ListPage):
                    decision = await self._list(client, reflector, decision, report)
                else:
                    decision = await self._watch(client, reflector, decision, report, changed)
                changed.set()

    async def _list(
        self,
        client: httpx2.AsyncClient,
        reflector: Reflector,
        ask: ListPage,
        report: SourceReport,
    ) -> Decision:
        params: dict[str, Any] = {"labelSelector": self.target.selector, "limit": LIST_PAGE}
        if ask.continue_token is not None:
            params["continue"] = ask.continue_token
        try:
            answer = await client.get(self._path, params=params)
        except httpx2.HTTPError as exc:
            report.failed(f"list: {type(exc).__name__}: {exc}")
            return reflector.failed(None)
        if answer.status_code != 200:
            report.failed(f"list: HTTP {answer.status_code}: {answer.text[:200]}")
            return reflector.failed(answer.status_code)
        try:
            page = decode_list(answer.content)
        except msgspec.DecodeError as exc:
            report.failed(f"list: not a PodList: {exc}")
            return reflector.failed(None)
        return reflector.listed(page)

    async def _watch(
        self,
        client: httpx2.AsyncClient,
        reflector: Reflector,
        watch: Watch,
        report: SourceReport,
        changed: _Wakeup,
    ) -> Decision:
        seconds = int(WATCH_S * (1 + random.random()))
        params: dict[str, str | int] = {
            "labelSelector": self.target.selector,
            "watch": "true",
            "resourceVersion": watch.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": seconds,
        }
        timeout = httpx2.Timeout(REQUEST_TIMEOUT_S, read=seconds + SILENT_GRACE_S)
        try:
            async with client.stream("GET", self._path, params=params, timeout=timeout) as answer:
                if answer.status_code != 200:
                    body = (await answer.aread()).decode(errors="replace")
                    if answer.status_code != GONE:  # routine: the version aged out
                        report.failed(f"watch: HTTP {answer.status_code}: {body[:200]}")
                    return reflector.failed(answer.status_code)
                decision = await _follow(answer, reflector, changed)
        except (httpx2.HTTPError, msgspec.DecodeError) as exc:
            report.failed(f"watch: {type(exc).__name__}: {exc}")
            return reflector.failed(None)
        if isinstance(decision, Wait):
            report.failed(f"watch: an ERROR event (retried after {decision.seconds:.1f}s)")
        if decision is not None:
            return decision
        return reflector.closed()


class _Wakeup:
    """Set by the reader at each change; the publisher takes all since its last wait as one."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


async def _follow(
    answer: httpx2.Response, reflector: Reflector, changed: _Wakeup
) -> Decision | None:
    """Apply the watch's events as they come; the decision that ended it, or None when
    the server ended it cleanly."""
    pending = b""
    async for chunk in answer.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            decision = reflector.event(*decode_event(line))
            if decision is not None:
                return decision
        changed.set()
    return None


async def _publish_changes(reflector: Reflector, report: SourceReport, changed: _Wakeup) -> None:
    """Publish at once after a quiet spell, then at most every `PUBLISH_EVERY_S`."""
    while True:
        await changed.wait()
        while (endpoints := reflector.change()) is not None:  # in slices of joins
            report.sighting(endpoints)
            await trio.lowlevel.checkpoint()
        await trio.sleep(PUBLISH_EVERY_S)
