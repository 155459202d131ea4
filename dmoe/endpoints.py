"""``HOST:PORT`` for gRPC's servers and channels, with IPv6 hosts in brackets.

gRPC reads ``::1:5000`` as a malformed address: an IPv6 host must be written ``[::1]:5000``. Every server of the
project (experts, averaging, state) binds and announces through these two functions, so that ``--host ::1``,
``--host '[::1]'`` and ``--host 0.0.0.0`` all mean what they say; DHT nodes print their address with them. (Here,
not in :mod:`dmoe.wire`, which imports torch: the DHT imports this.)
"""
from __future__ import annotations

import errno
import functools
import ipaddress
import re
import socket
from typing import Sequence

#: hosts that bind every interface: others on this machine reach such a server at 127.0.0.1
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class PortUnavailable(OSError):
    """A gRPC server of the project cannot listen on its address: another process listens there, or the host is not
    an address of this machine (gRPC tells no more). ``service`` says which server it was (e.g. "averager", "state
    server"), so that a program can name its flag; a traceback was all a trainer said of its --averaging-port."""

    service = ""

    @classmethod
    def at(cls, service: str, address: str) -> "PortUnavailable":
        error = cls(f"the {service} could not listen on {address}: another process listens there, or the host is "
                    "not an address of this machine")
        error.service = service
        return error


def join_host_port(host: str, port: int | str) -> str:
    """``host:port``, an IPv6 host in brackets (one given in brackets stays as it is)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


#: names gRPC reads as the scheme of a target (any case), not as a host: ``unix:1234`` dials the unix socket ``./1234``
GRPC_SCHEMES = frozenset({"dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p", "c2p",
                          "fake"})
#: a DNS host name: dot-separated labels of letters, digits, ``-`` (not at either end) and ``_`` (container names)
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]+(?<!-)(?:\.(?!-)[A-Za-z0-9_-]+(?<!-))*")


@functools.lru_cache(maxsize=4096)  # (asked of every entry the directory reads; servers' endpoints repeat)
def is_host_port(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``HOST:PORT`` that gRPC dials over TCP: an IPv4 address, an IPv6 one in brackets or a
    DNS host name, and a port from 1 to 65535. What peers write into the DHT is dialed as a gRPC *target*, and
    ``unix:/run/x.sock``, ``unix-abstract:name`` or ``dns://RESOLVER/h:1`` are targets too: a hostile declaration
    sent trainers to a unix socket of their own machine (review 99 D3)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5 or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        return _is_ip(host[1:-1], ipaddress.IPv6Address)
    return _is_ip(host, ipaddress.IPv4Address) or (_HOST_NAME.fullmatch(host) is not None
                                                    and host.lower() not in GRPC_SCHEMES)


def _is_ip(text: str, kind: type) -> bool:
    if not text.isascii() or "%" in text:  # (a scope id names an interface of the writer's machine: no one else's)
        return False
    try:
        kind(text)
    except ValueError:
        return False
    return True


def check_host(host: str) -> None:
    """Raises ValueError unless ``host`` is what a server can be announced at (``--announce-host``): an IP address
    (IPv6 with or without brackets) or a DNS host name, with no port. ``HOST:PORT`` (natural to type behind NAT)
    was announced as ``[HOST:PORT]:PORT``, which nobody can reach, and the server never learned why (review 99 D5)."""
    if is_host_port(join_host_port(host, 1)):
        return
    if is_host_port(host):
        raise ValueError(f"{host!r} is HOST:PORT: give the host alone (the port announced is the one the server "
                         "listens on)")
    raise ValueError(f"{host!r} is no host: an IP address (IPv6 with or without brackets) or a DNS name")


def bare_host(host: str) -> str:
    """``host`` without IPv6 brackets: what a socket (not gRPC) binds."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def machine_of(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The machine an address stands for, where peers are counted per machine (signing keys cost nothing to make,
    machines do): an IPv4 address (an IPv4-mapped IPv6 one too), or an IPv6 address's /64, as one machine is
    commonly given a whole /64."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.1:5000`` gives ``10.0.0.1``, ``ipv6:[::1]:5000`` gives
    ``::1``, ``ipv6:%5B::1%5D:5000`` too); a unix socket's peer gives ``"unix"``."""
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return "unix"
    return address.rpartition(":")[0].replace("%5B", "[").replace("%5D", "]").strip("[]").lower()


@functools.lru_cache(maxsize=4096)  # (asked on every call a server answers; parsing costs ~2 us)
def peer_machine(peer: str) -> str:
    """The machine a gRPC peer string is on, as :func:`machine_of` counts machines (an IPv4 address, an IPv6 /64):
    what per-client limits key on, since one machine may use any address of its /64; a peer that is no IP address
    (a unix socket) as its host."""
    host = peer_host(peer)
    try:
        return machine_of(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        return host


def reachable_endpoint(host: str, port: int | str) -> str:
    """Where a server bound to ``host`` is reached from this machine: a wildcard host at 127.0.0.1."""
    return join_host_port("127.0.0.1" if host in WILDCARD_HOSTS else host, port)


@functools.lru_cache(maxsize=4096)  # (asked of every DHT reply's contacts)
def is_loopback_ip(ip: str) -> bool:
    """Whether an IP literal (IPv4-mapped ones included, in any spelling), or "localhost", names this host over
    loopback. Parsed, not matched by prefix: a host *name* such as ``127.evil.example`` is no loopback address, and
    was offered the shared-memory path (review 99 D4)."""
    if ip == "localhost":
        return True
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:  # a host name, or nothing
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def outbound_host(peers: Sequence[tuple[str, int]]) -> str | None:
    """This machine's address on its route to the first of ``peers`` not on this host, or None when all are here
    (or none resolves): the address a server bound to every interface is reached at by those peers' machines, as
    far as this machine can tell (behind NAT, only ``--announce-host`` knows better). Nothing is sent. IPv4 where
    a name has both, as :func:`dmoe.dht.node.listen_host` listens."""
    for host, port in peers:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
        except (OSError, ValueError):  # unresolvable, or no address at all
            continue
        if is_loopback_ip(address[0]):
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(address)  # a UDP connect only picks the route and the source address
                return probe.getsockname()[0]
            except OSError:
                continue
    return None


def announced_endpoint(endpoint: str, outbound: str | None) -> str:
    """What others are told of a server of this machine at ``endpoint``: a loopback host (the reachable form of a
    wildcard bind) becomes ``outbound`` when the peers are on other machines."""
    host, _, port = endpoint.rpartition(":")
    if outbound is None or not is_loopback_ip(host.strip("[]")):
        return endpoint
    return join_host_port(outbound, port)


def machine_address(ipv6: bool = False) -> str | None:
    """This machine's address on its default route (IPv4), or None without one: what a bootstrap node bound to
    every interface prints for others to pass as ``--initial-peers``. Nothing is sent.

    ``ipv6``: its IPv6 route's address first (a node bound to ``::``), else the IPv4 one (such a socket takes both):
    ``dmoe-dht --host ::`` printed an IPv4 address, which an IPv6-only peer cannot reach (review 112 D6). A
    link-local address (all a machine without a global IPv6 address may have) names no interface others know: no
    use to them."""
    if ipv6:
        address = outbound_host([("2001:db8::1", 9)])  # the documentation prefix: only the route to it is looked up
        if address is not None and not ipaddress.ip_address(address.partition("%")[0]).is_link_local:
            return address
    return outbound_host([("192.0.2.1", 9)])  # TEST-NET-1: only the route to it is looked up


def host_at_fault(error: OSError) -> bool:
    """Whether a socket that could not be bound failed for its host (not this machine's address, an address family
    it lacks, or a name that does not resolve) rather than for its port (taken, or not ours): which flag a usage
    error names."""
    return isinstance(error, socket.gaierror) or error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
