"""A real DNS server for discovery's tests and benchmark: Debian's dnsmasq on 127.0.0.1 and a
free port, answering for `.test` names only (NXDOMAIN for a `.test` name it does not hold,
REFUSED for any other: it asks no one upstream).

A/AAAA records come from a hosts file rewritten while it runs: `set_hosts` writes it, sends
SIGHUP (dnsmasq re-reads it) and returns once dnsmasq answers the new records. SRV records
are flags (`--srv-host`), so `set_services` restarts it on the same port. It runs in the
foreground (`--no-daemon`: no fork, no pid file, no change of user), reads no system
configuration (`--conf-file=/dev/null`, `--no-resolv`, `--no-hosts`); what it says goes to
`dnsmasq.log` beside its hosts file.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
import trio

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
# (service name, target host, port): `_http._tcp.engines.test`, `engine-a.test`, 8000.
Service = tuple[str, str, int]


def free_udp_and_tcp_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (DNS answers on both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


class Dnsmasq:
    """dnsmasq serving `hosts` (name -> addresses) and `services`, with `local_ttl` on every
    record (dnsmasq's default, 0, tells clients not to cache)."""

    def __init__(self, directory: Path, *, local_ttl: int = 0) -> None:
        self.directory = directory
        self.local_ttl = local_ttl
        self.port = free_udp_and_tcp_port()
        self.hosts: dict[str, tuple[str, ...]] = {}
        self.services: tuple[Service, ...] = ()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def server(self) -> str:
        """What `--dns-server` takes."""
        return f"127.0.0.1:{self.port}"

    @property
    def hosts_file(self) -> Path:
        return self.directory / "hosts"

    async def start(self) -> None:
        """Start (or start again, on the same port) and wait until it answers."""
        self._write_hosts()
        args = [
            DNSMASQ,
            "--conf-file=/dev/null",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--no-daemon",
            "--pid-file=",
            "--local=/test/",
            f"--addn-hosts={self.hosts_file}",
            f"--local-ttl={self.local_ttl}",
            *(f"--srv-host={name},{target},{port}" for name, target, port in self.services),
        ]
        log = self.directory / "dnsmasq.log"
        with log.open("ab") as output:
            self.process = subprocess.Popen(args, stdout=output, stderr=output)
        with trio.fail_after(10):
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"dnsmasq exited: {log.read_text(errors='replace')}")
                try:
                    await self.addresses("ready.test")
                    return
                except (dns.exception.DNSException, OSError):
                    await trio.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.process = None

    async def set_hosts(self, hosts: Mapping[str, Sequence[str]]) -> None:
        """Serve `hosts` from now on (SIGHUP); back once dnsmasq answers them."""
        names = set(self.hosts) | set(hosts)
        self.hosts = {name: tuple(addresses) for name, addresses in hosts.items()}
        self._write_hosts()
        assert self.process is not None
        self.process.send_signal(signal.SIGHUP)
        with trio.fail_after(10):
            for name in names:
                while await self.addresses(name) != set(self.hosts.get(name, ())):
                    await trio.sleep(0.01)

    async def set_services(self, services: Sequence[Service]) -> None:
        """Serve these SRV records instead (a restart: dnsmasq reads them from its flags)."""
        self.services = tuple(services)
        self.stop()
        await self.start()

    async def addresses(self, name: str) -> set[str]:
        """What dnsmasq answers for `name` now, A and AAAA (empty: NXDOMAIN or NODATA)."""
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", self.port)]
        resolver.lifetime = 1.0
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            with contextlib.suppress(dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                found.update(record.to_text() for record in await resolver.resolve(name, rdtype))
        return found

    def _write_hosts(self) -> None:
        lines = [f"{address} {name}" for name, found in self.hosts.items() for address in found]
        self.hosts_file.write_text("".join(f"{line}\n" for line in lines))
