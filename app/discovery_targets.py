"""What `--discover-dns`, `--dns-server` and `--discover-k8s` name, parsed and checked at
start-up as every flag is (a bad one stops `sluice` with exit status 2). Pure.

- `--discover-dns NAME:PORT`: the A/AAAA records of NAME are engines listening on PORT (a
  headless Service's name). `--discover-dns _service._proto.NAME`: its SRV records name
  each engine's host and port (a Service's named port, `_http._tcp.vllm.ns.svc...`).
- `--dns-server HOST:PORT`: the resolver asked (default: the system's, /etc/resolv.conf).
- `--discover-k8s NAMESPACE/LABEL_SELECTOR`: the Ready pods of NAMESPACE whose labels match
  the selector (`app=vllm,tier in (gpu)`), as the Kubernetes API's `labelSelector` reads it.
  `--discover-k8s-prefill` / `--discover-k8s-decode` are selectors of the same syntax that
  Sluice matches itself on each pod's labels (`LabelSelector`): one watch, one resource
  version, so a pod whose role label changes is one event, never two watches' race.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Protocol

# RFC 1123 labels; an SRV name's first two labels start with an underscore.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
_SRV_NAME = re.compile(rf"^_[A-Za-z0-9-]+\._(?:tcp|udp)\.{_LABEL}(?:\.{_LABEL})*\.?$")
_NAMESPACE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{what}: the port must be a number from 1 to 65535, not {text!r}")
    return int(text)


@dataclass(frozen=True)
class DnsTarget:
    """A name whose records are engines; `port` None: SRV records give each one's."""

    name: str
    port: int | None

    @classmethod
    def parse(cls, text: str) -> DnsTarget:
        what = f"--discover-dns {text!r}"
        if _SRV_NAME.match(text):
            return cls(text.rstrip("."), None)
        name, sep, port = text.rpartition(":")
        if not sep or not _HOSTNAME.match(name):
            raise ValueError(
                f"{what}: expected NAME:PORT (A/AAAA records) or _service._proto.NAME (SRV)"
            )
        return cls(name.rstrip("."), _port(port, what))

    @property
    def source(self) -> str:
        """How the dashboard and the metrics name this source."""
        return f"dns:{self.name}" if self.port is None else f"dns:{self.name}:{self.port}"


@dataclass(frozen=True)
class DnsServer:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> DnsServer:
        what = f"--dns-server {text!r}"
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{what}: expected IP:PORT, e.g. 10.96.0.10:53") from None
        if not sep:
            raise ValueError(f"{what}: expected IP:PORT, e.g. 10.96.0.10:53")
        return cls(host, _port(port, what))


@dataclass(frozen=True)
class K8sTarget:
    """The pods of `namespace` matching `selector` (the API's own `labelSelector` syntax)."""

    namespace: str
    selector: str

    @classmethod
    def parse(cls, text: str) -> K8sTarget:
        namespace, sep, selector = text.partition("/")
        if not sep or not _NAMESPACE.match(namespace) or not selector.strip():
            raise ValueError(
                f"--discover-k8s {text!r}: expected NAMESPACE/LABEL_SELECTOR, "
                "e.g. inference/app=vllm"
            )
        return cls(namespace, selector.strip())

    @property
    def source(self) -> str:
        return f"k8s:{self.namespace}/{self.selector}"


_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9][A-Za-z0-9_./-]*)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)"
    r"|\s(?P<set>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


@dataclass(frozen=True)
class SelectorTerm:
    """One requirement: `op` is one of =, !=, in, notin, exists, !exists."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!exists":
            return value is None
        if self.op in ("=", "in"):
            return value in self.values
        return value not in self.values  # != and notin: an absent key matches, as the API's


@dataclass(frozen=True)
class LabelSelector:
    """A label selector in the Kubernetes API's string syntax, equality- and set-based:
    `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`, ANDed by commas."""

    terms: tuple[SelectorTerm, ...]

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        terms: list[SelectorTerm] = []
        for part in re.split(r",(?![^(]*\))", text):  # commas outside parentheses
            found = _SELECTOR_TERM.match(part)
            negated_value = found is not None and found["neg"] and (found["op"] or found["set"])
            if found is None or not part.strip() or negated_value:
                raise ValueError(f"label selector {text!r}: cannot read {part.strip()!r}")
            if found["set"]:
                values = frozenset(v.strip() for v in found["values"].split(",") if v.strip())
                terms.append(SelectorTerm(found["key"], found["set"], values))
            elif found["op"]:
                op = "!=" if found["op"] == "!=" else "="
                terms.append(SelectorTerm(found["key"], op, frozenset([found["value"]])))
            else:
                terms.append(SelectorTerm(found["key"], "!exists" if found["neg"] else "exists"))
        return cls(tuple(terms))

    def matches(self, labels: dict[str, str]) -> bool:
        return all(term.matches(labels) for term in self.terms)


class DiscoveryFlags(Protocol):
    """The settings that name discovery sources (the proxy's `Settings`)."""

    @property
    def discover_dns(self) -> tuple[str, ...]: ...
    @property
    def dns_server(self) -> str | None: ...
    @property
    def discover_k8s(self) -> str | None: ...
    @property
    def discover_k8s_port(self) -> int: ...
    @property
    def discover_k8s_prefill(self) -> str | None: ...
    @property
    def discover_k8s_decode(self) -> str | None: ...


def check_discovery(flags: DiscoveryFlags) -> None:
    """Every discovery flag parses, or a ValueError says which and why."""
    if not 1 <= flags.discover_k8s_port <= 65535:
        raise ValueError("--discover-k8s-port must be a port from 1 to 65535")
    for entry in flags.discover_dns:
        DnsTarget.parse(entry)
    if flags.dns_server is not None:
        DnsServer.parse(flags.dns_server)
    pods = None if flags.discover_k8s is None else K8sTarget.parse(flags.discover_k8s).selector
    selectors = {
        "--discover-k8s": pods,
        "--discover-k8s-prefill": flags.discover_k8s_prefill,
        "--discover-k8s-decode": flags.discover_k8s_decode,
    }
    for flag, selector in selectors.items():
        if selector is not None:
            try:
                LabelSelector.parse(selector)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
