"""A stand-in Kubernetes API server for pods, for the tests and `bench discovery --part k8s`:
no API server can be had on these machines, so this one speaks the documented list/watch
protocol (https://kubernetes.io/docs/reference/using-api/api-concepts/) on Sluice's own
HTTP server:

- `GET /api/v1/namespaces/NS/pods?labelSelector=S&limit=N&continue=T`: a PodList whose
  `metadata.resourceVersion` is the snapshot's, in pages (`metadata.continue`);
- `...&watch=true&resourceVersion=X&allowWatchBookmarks=true&timeoutSeconds=T`: chunked JSON
  lines of ADDED / MODIFIED / DELETED events after X, BOOKMARK events when `bookmark()` is
  called, a clean end after T;
- a resource version older than the history kept (`compact()`) is `410 Gone`: as the
  watch's HTTP status, or (`gone_as_event`, as a real server mostly does) as an ERROR event
  carrying a Status with code 410;
- `cut_watches()` breaks every watch mid-stream (no last chunk); a bearer token is checked.

`token` may be changed while it serves, as a service account's is rotated.
Pods are changed from the test or bench (`add`, `set_ready`, `delete`); a pod's labels do
not change after it is added.
"""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trio

from app.discovery_targets import LabelSelector
from app.http.exchange import Exchange
from app.http.server import HttpServer
from app.http.streams import byte_stream

JSON = [(b"content-type", b"application/json")]
WATCHER_BUFFER = 100_000


@dataclass
class _Watcher:
    namespace: str
    selector: LabelSelector
    send: trio.MemorySendChannel[dict[str, Any] | str]

    def wants(self, pod: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        return bool(meta["namespace"] == self.namespace and self.selector.matches(meta["labels"]))


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def pod_manifest(namespace: str, name: str, ip: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod as the API server gives it, the size of a real one's (about 2 KB)."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": dict(labels),
            "annotations": {},
            "creationTimestamp": "2026-11-28T00:00:00Z",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm"}],
        },
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "args": ["--model", "deepseek-ai/DeepSeek-V4", "--port", "8000"],
                    "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}},
                }
            ],
            "nodeName": "gpu-node-1",
            "serviceAccountName": "default",
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "False"},
                {"type": "Ready", "status": "False"},
            ],
            "containerStatuses": [
                {"name": "vllm", "ready": False, "restartCount": 0, "image": "vllm"}
            ],
        },
    }


class KubeApi:
    """The pods the stand-in serves, their history, and its counters."""

    def __init__(self, token: str = "stand-in-token") -> None:
        self.url = ""
        self.token = token
        self.gone_as_event = True
        self.version = 1
        self.oldest = 1  # watches from a version below this are 410 Gone
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, pod)
        self.watchers: list[_Watcher] = []
        self.requests = {"list": 0, "watch": 0, "gone": 0, "unauthorized": 0}
        self._watchers_changed = trio.Event()
        self._pages: dict[str, list[dict[str, Any]]] = {}
        self._page_versions: dict[str, int] = {}

    # Changes, from the test or bench.
    def add(
        self,
        namespace: str,
        name: str,
        ip: str,
        labels: dict[str, str],
        *,
        annotations: dict[str, str] | None = None,
        ready: bool = False,
    ) -> None:
        pod = pod_manifest(namespace, name, ip, labels)
        pod["metadata"]["annotations"] = dict(annotations or {})
        self._set_ready(pod, ready)
        self._change(namespace, "ADDED", pod)

    def set_ready(self, namespace: str, name: str, ready: bool = True) -> None:
        pod = json.loads(json.dumps(self.pods[namespace, name]))
        self._set_ready(pod, ready)
        self._change(namespace, "MODIFIED", pod)

    def delete(self, namespace: str, name: str, *, graceful: bool = True) -> None:
        """Graceful: first marked for deletion (a MODIFIED event with a deletion
        timestamp, still Ready, as while its containers stop), then gone."""
        pod = json.loads(json.dumps(self.pods[namespace, name]))
        if graceful:
            pod["metadata"]["deletionTimestamp"] = "2026-11-28T00:00:30Z"
            self._change(namespace, "MODIFIED", pod)
        self._change(namespace, "DELETED", pod)

    def compact(self) -> None:
        """Forget the history: a watch from any version seen so far is 410 Gone."""
        self.history.clear()
        self.oldest = self.version + 1

    async def watching(self, count: int) -> None:
        """Return once exactly `count` watches are open."""
        while len(self.watchers) != count:
            await self._watchers_changed.wait()

    def _watchers_moved(self) -> None:
        self._watchers_changed.set()
        self._watchers_changed = trio.Event()

    def cut_watches(self) -> None:
        for watcher in self.watchers:
            watcher.send.send_nowait("cut")

    def expire_watches(self) -> None:
        """Every watch gets an ERROR event with a 410 Status, as when its version aged out."""
        self.compact()
        for watcher in self.watchers:
            watcher.send.send_nowait("gone")

    def bookmark(self) -> None:
        for watcher in self.watchers:
            watcher.send.send_nowait("bookmark")

    def _set_ready(self, pod: dict[str, Any], ready: bool) -> None:
        state = "True" if ready else "False"
        for condition in pod["status"]["conditions"]:
            if condition["type"] in ("Ready", "ContainersReady"):
                condition["status"] = state
        pod["status"]["containerStatuses"][0]["ready"] = ready

    def _change(self, namespace: str, kind: str, pod: dict[str, Any]) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        key = (namespace, pod["metadata"]["name"])
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
        self.history.append((self.version, kind, pod))
        event = {"type": kind, "object": pod}
        for watcher in self.watchers:
            if watcher.wants(pod):
                watcher.send.send_nowait(event)

    # The HTTP side.
    async def __call__(self, exchange: Exchange) -> None:
        parts = exchange.path.strip("/").split("/")
        if exchange.header(b"authorization") != b"Bearer " + self.token.encode():
            self.requests["unauthorized"] += 1
            await exchange.respond_json(401, _status(401, "Unauthorized", "Unauthorized"))
            return
        if len(parts) != 5 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
            await exchange.respond_json(404, _status(404, "NotFound", exchange.path))
            return
        query = {k: v[-1] for k, v in parse_qs(urlsplit(exchange.target.decode()).query).items()}
        selector = (
            LabelSelector.parse(query.get("labelSelector", ""))
            if query.get("labelSelector")
            else LabelSelector(())
        )
        if query.get("watch") in ("true", "1"):
            await self._watch(exchange, parts[3], selector, query)
        else:
            await self._list(exchange, parts[3], selector, query)

    async def _list(
        self, exchange: Exchange, namespace: str, selector: LabelSelector, query: dict[str, str]
    ) -> None:
        self.requests["list"] += 1
        token = query.get("continue")
        if token is None:
            token = f"t{self.version}-{len(self._pages)}"
            self._pages[token] = [
                pod
                for (ns, _), pod in sorted(self.pods.items())
                if ns == namespace and selector.matches(pod["metadata"]["labels"])
            ]
            self._page_versions[token] = self.version
        elif token not in self._pages:
            await exchange.respond_json(410, _status(410, "Expired", "continue token expired"))
            return
        limit = int(query.get("limit", "0")) or math.inf
        pods = self._pages.pop(token)
        version = self._page_versions.pop(token)
        page, rest = pods[: int(min(limit, len(pods)))], pods[int(min(limit, len(pods))) :]
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        if rest:
            following = f"{token}+"
            self._pages[following], self._page_versions[following] = rest, version
            meta["continue"] = following
        await exchange.respond_json(
            200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page}
        )

    async def _watch(
        self, exchange: Exchange, namespace: str, selector: LabelSelector, query: dict[str, str]
    ) -> None:
        self.requests["watch"] += 1
        since = int(query.get("resourceVersion") or self.version)
        if since < self.oldest - 1 and not self.gone_as_event:
            self.requests["gone"] += 1
            await exchange.respond_json(410, _status(410, "Expired", "too old resource version"))
            return
        send, receive = trio.open_memory_channel[dict[str, Any] | str](WATCHER_BUFFER)
        watcher = _Watcher(namespace, selector, send)
        if since < self.oldest - 1:
            send.send_nowait("gone")
        for version, kind, pod in self.history:
            if version > since and watcher.wants(pod):
                send.send_nowait({"type": kind, "object": pod})
        self.watchers.append(watcher)
        self._watchers_moved()
        try:
            await exchange.start(200, JSON, complete=False)
            with trio.move_on_after(float(query.get("timeoutSeconds", "1800"))):
                async for item in receive:
                    if item == "cut":
                        return  # no last chunk: the client sees the stream break
                    await exchange.write(self._line(item))
                    if item == "gone":
                        break
            await exchange.end()
        finally:
            self.watchers.remove(watcher)
            self._watchers_moved()

    def _line(self, item: dict[str, Any] | str) -> bytes:
        if item == "gone":
            self.requests["gone"] += 1
            item = {"type": "ERROR", "object": _status(410, "Expired", "too old resource version")}
        elif item == "bookmark":
            meta = {"resourceVersion": str(self.version)}
            item = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": meta}}
        return json.dumps(item, separators=(",", ":")).encode() + b"\n"


@asynccontextmanager
async def serving(
    api: KubeApi | None = None, tls: ssl.SSLContext | None = None
) -> AsyncIterator[KubeApi]:
    """A stand-in listening on 127.0.0.1 (a free port) for as long as the block runs; over
    HTTPS with `tls`, as an API server in a cluster is reached."""
    api = api or KubeApi()
    server = HttpServer(api)
    async with trio.open_nursery() as nursery:
        if tls is None:
            api.url = await nursery.start(server.serve, "127.0.0.1", 0, 256)
        else:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            secure = [trio.SSLListener(listener, tls) for listener in listeners]

            async def serve_one(stream: trio.SSLStream[trio.SocketStream]) -> None:
                await server.serve_connection(byte_stream(stream))

            nursery.start_soon(trio.serve_listeners, serve_one, secure)
            api.url = f"https://127.0.0.1:{port}"
        yield api
        nursery.cancel_scope.cancel()


def kubeconfig(api: KubeApi, namespace: str = "default") -> str:
    """A kubeconfig (YAML is a superset of JSON) naming the stand-in and its token."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": api.url}}],
            "users": [{"name": "sluice", "user": {"token": api.token}}],
            "contexts": [
                {
                    "name": "stand-in",
                    "context": {"cluster": "stand-in", "user": "sluice", "namespace": namespace},
                }
            ],
            "current-context": "stand-in",
        }
    )
