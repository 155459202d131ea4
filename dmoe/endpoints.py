"""``HOST:PORT`` for gRPC's servers and channels, with IPv6 hosts in brackets.

gRPC reads ``::1:5000`` as a malformed address: an IPv6 host must be written ``[::1]:5000``. Every server of the
project (experts, averaging, state) binds and announces through these two functions, so that ``--host ::1``,
``--host '[::1]'`` and ``--host 0.0.0.0`` all mean what they say; DHT nodes print their address with them. (Here,
not in :mod:`dmoe.wire`, which imports torch: the DHT imports this.)
"""
from __future__ import annotations

#: hosts that bind every interface: others on this machine reach such a server at 127.0.0.1
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def join_host_port(host: str, port: int | str) -> str:
    """``host:port``, an IPv6 host in brackets (one given in brackets stays as it is)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def reachable_endpoint(host: str, port: int | str) -> str:
    """Where a server bound to ``host`` is reached from this machine: a wildcard host at 127.0.0.1."""
    return join_host_port("127.0.0.1" if host in WILDCARD_HOSTS else host, port)
