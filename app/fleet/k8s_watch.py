"""A Kubernetes list + watch of pods, as client-go's reflector does it: pods and resource
versions in, what to ask the API server next out. Pure: the I/O is app/fleet/k8s_source.py.

Design rules:
1. A list (in pages of `LIST_PAGE`, one consistent snapshot: the first page's resource
   version) replaces everything known; then a watch from that version, with bookmarks, so a
   quiet watch still moves the version forward and a reconnect resumes where it stopped.
2. A watch that ends cleanly (the server's timeout) is watched again at once from the last
   version seen; one that breaks (connection cut, a non-410 error) is watched again from
   that version after a back-off with jitter, doubling to `BACKOFF_MAX_S`.
3. `410 Gone` (as the watch's HTTP status, or as an ERROR event whose Status says 410): the
   version is too old to resume from, so the whole list is read again; only a completed
   list replaces what was known (a pod deleted meanwhile leaves then, never before).
4. An engine is a pod that is Ready (its Ready condition True), not being deleted (a
   deletion timestamp means leave now, before the kubelet stops it) and has an IP. Its port
   is the annotation `sluice.io/port`, else `--discover-k8s-port`; its models the annotation
   `sluice.io/models` (comma-separated: a label value cannot hold the `/` of
   `org/model`), else its /v1/models; its role prefill if the prefill selector matches its
   labels (checked first), decode if the decode selector does, else both; a prefill pod's
   SGLang bootstrap port is the annotation `sluice.io/bootstrap-port`.
5. At most `MAX_DISCOVERED` engines (the first by pod name): a selector that matches a
   whole cluster by mistake must not make thousands of backends health-checked at once.
   And at most `JOIN_SLICE` new ones a sighting: each join adds a backend and starts its
   health check, so 1,000 pods listed at once were one 130 ms step of the loop; in slices
   (the source yields between them) each is a few ms.
6. Pods are decoded (msgspec) into the few fields read here, not into dicts of everything:
   a 1,000-pod list is ~10x less CPU and its objects are untracked by the garbage collector,
   whose full collections otherwise grew with each page parsed (seen: 17-24 ms).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from app.config import Role
from app.discovery_targets import LabelSelector
from app.fleet.discovery import Endpoint

PORT_ANNOTATION = "sluice.io/port"
MODELS_ANNOTATION = "sluice.io/models"
BOOTSTRAP_ANNOTATION = "sluice.io/bootstrap-port"
LIST_PAGE = 100  # pods a list page carries: each page is parsed in well under a millisecond
MAX_DISCOVERED = 1024
JOIN_SLICE = 50
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class Condition(msgspec.Struct, frozen=True, gc=False):
    type: str = ""
    status: str = ""


class PodStatus(msgspec.Struct, frozen=True, gc=False):
    podIP: str | None = None
    conditions: tuple[Condition, ...] = ()


class PodMeta(msgspec.Struct, frozen=True, gc=False):
    name: str = ""
    resourceVersion: str = ""
    deletionTimestamp: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class Pod(msgspec.Struct, frozen=True, gc=False):
    metadata: PodMeta = PodMeta()
    status: PodStatus = PodStatus()


class ListMeta(msgspec.Struct, frozen=True, gc=False):
    resourceVersion: str = ""
    continue_token: str | None = msgspec.field(default=None, name="continue")


class PodList(msgspec.Struct, frozen=True, gc=False):
    metadata: ListMeta = ListMeta()
    items: tuple[Pod, ...] = ()


class Status(msgspec.Struct, frozen=True, gc=False):
    """What an ERROR event carries."""

    code: int | None = None


class WatchEvent(msgspec.Struct, frozen=True, gc=False):
    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"{}")


_LIST = msgspec.json.Decoder(PodList)
_EVENT = msgspec.json.Decoder(WatchEvent)
_POD = msgspec.json.Decoder(Pod)
_STATUS = msgspec.json.Decoder(Status)


def decode_list(body: bytes) -> PodList:
    """A PodList page; a msgspec.DecodeError (a ValueError) if it is not one."""
    return _LIST.decode(body)


def decode_event(line: bytes) -> tuple[str, Pod | Status]:
    """One watch event: its type and object (a Status for an ERROR)."""
    event = _EVENT.decode(line)
    if event.type == "ERROR":
        return event.type, _STATUS.decode(event.object)
    return event.type, _POD.decode(event.object)


@dataclass(frozen=True)
class PodRules:
    """How a pod becomes an engine: the default port and the role selectors."""

    port: int
    prefill: LabelSelector | None = None
    decode: LabelSelector | None = None

    def role_of(self, labels: dict[str, str]) -> Role:
        if self.prefill is not None and self.prefill.matches(labels):
            return "prefill"
        if self.decode is not None and self.decode.matches(labels):
            return "decode"
        return "both"


def _ready(pod: Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)


def _port(text: str | None, default: int | None) -> int | None:
    if text is not None and text.isdigit() and 1 <= int(text) <= 65535:
        return int(text)
    return default


def endpoint_of(pod: Pod, rules: PodRules) -> Endpoint | None:
    """The engine `pod` is now, or None while it must take no request."""
    meta, ip = pod.metadata, pod.status.podIP
    if not ip or meta.deletionTimestamp or not _ready(pod):
        return None
    annotations = meta.annotations
    role = rules.role_of(meta.labels)
    port = _port(annotations.get(PORT_ANNOTATION), rules.port)
    host = f"[{ip}]" if ":" in ip else ip
    listed = annotations.get(MODELS_ANNOTATION)
    models = tuple(m.strip() for m in listed.split(",") if m.strip()) if listed else None
    bootstrap = _port(annotations.get(BOOTSTRAP_ANNOTATION), None) if role == "prefill" else None
    return Endpoint(f"http://{host}:{port}", role, bootstrap, models or None)


@dataclass(frozen=True)
class ListPage:
    """GET the pod list, `limit=LIST_PAGE`, from `continue_token` if any."""

    continue_token: str | None = None


@dataclass(frozen=True)
class Watch:
    """GET a watch from `resource_version`, with `allowWatchBookmarks=true`."""

    resource_version: str


@dataclass(frozen=True)
class Wait:
    """Back off `seconds`, then do `then`."""

    seconds: float
    then: ListPage | Watch


Decision = ListPage | Watch | Wait
GONE = 410


@dataclass
class Reflector:
    """What the watch knows of the pods, and what to ask next."""

    rules: PodRules
    jitter: Callable[[], float] = random.random  # in [0, 1)
    pods: dict[str, Endpoint | None] = field(default_factory=dict)  # by pod name
    resource_version: str | None = None
    synced: bool = False  # a whole list has been read
    failures: int = 0  # in a row
    _listing: dict[str, Endpoint | None] | None = None
    _list_version: str = ""
    _published: frozenset[Endpoint] | None = None

    def start(self) -> Decision:
        return ListPage()

    def listed(self, page: PodList) -> Decision:
        """A page of the list arrived."""
        if self._listing is None:
            self._listing, self._list_version = {}, page.metadata.resourceVersion
        for pod in page.items:
            self._listing[pod.metadata.name] = endpoint_of(pod, self.rules)
        token = page.metadata.continue_token
        if token:
            return ListPage(token)
        self.pods, self._listing = self._listing, None
        self.resource_version, self.synced, self.failures = self._list_version, True, 0
        return Watch(self._list_version)

    def event(self, kind: str, obj: Pod | Status) -> Decision | None:
        """A watch event arrived: None to keep reading, else the watch is over."""
        if isinstance(obj, Status):
            return self.failed(obj.code)
        if kind in ("ADDED", "MODIFIED"):
            self.pods[obj.metadata.name] = endpoint_of(obj, self.rules)
        elif kind == "DELETED":
            self.pods.pop(obj.metadata.name, None)
        elif kind != "BOOKMARK":
            return None  # a type this reflector does not know: skipped, as client-go does
        if obj.metadata.resourceVersion:
            self.resource_version = obj.metadata.resourceVersion
        self.failures = 0
        return None

    def closed(self) -> Decision:
        """The watch ended cleanly (the server's timeout): watch again at once."""
        assert self.resource_version is not None
        return Watch(self.resource_version)

    def failed(self, status: int | None) -> Decision:
        """A request failed: `status` is its HTTP status (None: no answer, a cut stream)."""
        self.failures += 1
        self._listing = None
        if status == GONE and self.failures == 1:
            return ListPage()  # the version is gone: relist at once, waiting brings nothing
        then: ListPage | Watch = ListPage()
        if status != GONE and self.resource_version is not None:
            then = Watch(self.resource_version)
        ceiling = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.failures - 1))
        return Wait(ceiling * (0.5 + 0.5 * self.jitter()), then)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """The engines now: Ready pods, the first `MAX_DISCOVERED` by name."""
        ready = [(name, e) for name, e in self.pods.items() if e is not None]
        ready.sort(key=lambda item: item[0])
        return tuple(e for _, e in ready[:MAX_DISCOVERED])

    def change(self) -> tuple[Endpoint, ...] | None:
        """The set to publish if it changed since the last call (and a list was read), else
        None: every engine published before that is still seen, and at most `JOIN_SLICE`
        new ones; call again until None."""
        if not self.synced:
            return None
        now = self.endpoints()
        published = self._published or frozenset()
        if self._published is not None and frozenset(now) == published:
            return None
        new = [e for e in now if e not in published]
        if len(new) > JOIN_SLICE:
            joining = set(new[:JOIN_SLICE])
            now = tuple(e for e in now if e in published or e in joining)
        self._published = frozenset(now)
        return now
