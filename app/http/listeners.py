"""One proxy port shared by the processes of `sluice serve --workers N` (SO_REUSEPORT).

Each worker binds its own listening socket to the same address with SO_REUSEPORT, and the
kernel spreads new connections over them by a hash of each connection's addresses: no
process hands sockets to another, a worker that dies takes only its own connections with it
and the others go on accepting. `trio.open_tcp_listeners` does not set the option, hence
`reuse_port_listeners`, which `HttpServer(reuse_port=True)` listens with.

The supervisor holds the port with `reserve_port` for as long as it runs: a socket bound with
SO_REUSEPORT but never listening takes no connection, yet no other program can take the port
while every worker is being restarted, and port 0 becomes one concrete port for all of them.
Linux lets only processes of the same user join a SO_REUSEPORT group, and `reserve_port`
refuses a port that anything (another Sluice included) already holds.
"""

from __future__ import annotations

import socket
from typing import Any

import trio


def _addresses(host: str, port: int) -> list[tuple[int, tuple[Any, ...]]]:
    """(family, address) of each address `host` names, as trio.open_tcp_listeners binds."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return list(dict.fromkeys((int(family), tuple(address)) for family, *_, address in infos))


def _socket(family: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        # As trio does: an IPv6 socket is for IPv6 only, its IPv4 twin binds separately.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    return sock


def reserve_port(host: str, port: int) -> tuple[int, list[socket.socket]]:
    """Hold `port` (a free one for 0) on every address of `host` for the workers to share.

    Raises OSError when something already listens there: bound without SO_REUSEPORT first,
    the socket fails then rather than silently joining another program's group."""
    held: list[socket.socket] = []
    try:
        for family, address in _addresses(host, port):
            sock = _socket(family)
            held.append(sock)
            sock.bind((address[0], port, *address[2:]))
            port = sock.getsockname()[1]
            # Set after the bind: the workers' sockets may now join this port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        for sock in held:
            sock.close()
        raise
    return port, held


def reuse_port_listeners(host: str, port: int, backlog: int) -> list[trio.SocketListener]:
    """Listening sockets on every address of `host`, joined to `port`'s SO_REUSEPORT group."""
    sockets: list[socket.socket] = []
    try:
        for family, address in _addresses(host, port):
            sock = _socket(family)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            sock.listen(backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in sockets]
