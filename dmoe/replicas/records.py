"""What replication keeps in the DHT: who receives replicas of a layer, who holds a replica of an expert, which
cells were adopted lately, and who owns a uid now.

Keys hold a ``/``, which no grid prefix can (:mod:`dmoe.uid`), so they never collide with the expert directory's
records:

* ``{layer}/replica-hosts``: one owned (int) entry per server that receives replicas of the layer's experts,
  valued with its gRPC endpoint, then ``/`` and its machine's token for the processes of one ``dmoe-server
  --processes`` (:func:`host_value`); the entry's owner (the server's public key) places it for :func:`distance`;
* ``{uid}/replicas``: one owned entry per server holding a replica of ``uid``, valued ``ENDPOINT/UPDATES/SIGNER``
  (the replica's update count and the first 16 hex digits of the key that signed it) — announced as a replica,
  never as a served expert, so beam search never sees it;
* ``{layer}/adopted``: a shared (str) entry per cell adopted in the last hour, subkey the cell's coordinates
  (``"1.2"``), valued ``TIME/UPDATES/BACKWARD_CALLS`` of the replica it was adopted from.

Each server's owned subkey is the same in every record (:func:`server_subkey`), so it can only ever refresh its
own entries.
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
from typing import NamedTuple

from dmoe.dht import DHT
from dmoe.dht.messages import MAX_STR_SUBKEY
from dmoe.dht.storage import Entry, Record
from dmoe.endpoints import bare_host, is_host_port, machine_of
from dmoe.uid import split_uid, strict_prefixes

logger = logging.getLogger(__name__)

#: how long an adoption stays on the record (an hour, less the margin that keeps it under DHTConfig.max_expiration)
ADOPTION_MEMORY = 3600.0 - 30.0
SIGNER_HEX = 16


def hosts_key(layer: str) -> str:
    return f"{layer}/replica-hosts"


class Host(NamedTuple):
    """A server that receives replicas of a layer, as its ``replica-hosts`` entry says."""
    key: bytes              # its public key (the entry's owner)
    endpoint: str
    machine: str | None     # the token of its dmoe-server --processes, shared with its sibling processes


def host_value(endpoint: str, machine: str | None) -> str:
    """A ``replica-hosts`` entry's value: ``ENDPOINT`` or ``ENDPOINT/MACHINE``."""
    return endpoint if machine is None else f"{endpoint}/{machine}"


def parse_host(value: str) -> tuple[str, str | None]:
    """(endpoint, machine token or None) of a ``replica-hosts`` entry's value (see :func:`host_value`)."""
    endpoint, slash, machine = value.rpartition("/")
    return (endpoint, machine or None) if slash else (value, None)


def replicas_key(uid: str) -> str:
    return f"{uid}/replicas"


def adopted_key(layer: str) -> str:
    return f"{layer}/adopted"


def server_subkey(public_key: bytes) -> int:
    """The owned subkey a server writes under in every replication record (31 bits, as int subkeys must be)."""
    return int.from_bytes(hashlib.sha1(public_key).digest()[:4], "big") & 0x7FFFFFFF


def distance(uid: str, public_key: bytes) -> int:
    """Kademlia's XOR distance between an expert's key and a server's id: the closest hosts receive its replicas,
    so every server agrees where an expert's replicas belong without asking anyone."""
    uid_id = int.from_bytes(hashlib.sha1(uid.encode()).digest(), "big")
    return uid_id ^ int.from_bytes(hashlib.sha1(public_key).digest(), "big")


class Holder(NamedTuple):
    """A server that announced a replica of an expert."""
    endpoint: str
    updates: int
    signer: str      # hex prefix of the key that signed the replica (the expert's owner when it was taken)
    holder: bytes    # the holding server's public key (the entry's owner)

    def value(self) -> str:
        return f"{self.endpoint}/{self.updates}/{self.signer}"


def endpoint_host(endpoint: str) -> str:
    """The host of a ``HOST:PORT`` endpoint, without brackets or an IPv6 zone."""
    return bare_host(endpoint.rpartition(":")[0]).split("%", 1)[0]


def resolve_host(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` is (an address itself) or points to (a name: IPv4 first, as gRPC and
    :func:`dmoe.endpoints.outbound_host` prefer); None when it points nowhere."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return ipaddress.ip_address(min(infos, key=lambda info: info[0] != socket.AF_INET)[4][0].split("%", 1)[0])
    except (OSError, ValueError, UnicodeError):
        return None


def counted_machine(address: ipaddress.IPv4Address | ipaddress.IPv6Address, place: str, local: bool) -> str:
    """The machine an endpoint at ``address`` (``place``: the endpoint) counts as where one replica goes to each:
    :func:`~dmoe.endpoints.machine_of`, but a loopback endpoint is a machine of its own in a local swarm (``local``:
    every server announces 127.0.0.1 there, as the DHT counts its contacts) and one machine, this one, otherwise
    (it reaches only this machine's processes)."""
    if address.is_loopback:
        return place if local else "loopback"
    return machine_of(address)


def holder_machine(endpoint: str) -> str | None:
    """The machine a holder's ``endpoint`` is on, as votes count it: its IPv4 address, or its IPv6 address's /64
    (one machine is commonly given a whole /64), a host name resolved first; None when it resolves to nothing.
    Keys cost nothing to make, machines do (as for the DHT's ``sender_group``, but loopback addresses count as
    themselves: this host's servers all announce 127.0.0.1, and tests play machines on 127.0.0.2, 127.0.0.3, ...)."""
    address = resolve_host(endpoint_host(endpoint))
    return None if address is None else machine_of(address)


def own_subkey(subkey: object, owner: bytes) -> bool:
    """Whether an entry of a replication record sits at its owner's :func:`server_subkey`: anyone may store first
    under any free int subkey, so a key that took another server's subkey was read as that server (pushes went to
    it; review 53). Readers skip the rest."""
    return isinstance(subkey, int) and not isinstance(subkey, bool) and subkey == server_subkey(owner)


def holders(record: Record) -> list[Holder]:
    """The holders a ``{uid}/replicas`` record names, most updates first; entries that do not parse (an endpoint
    that is no ``HOST:PORT`` included: review 99 D3), or that sit at another key's subkey (:func:`own_subkey`), are
    skipped."""
    found = []
    for subkey, entry in record.items():
        parts = entry.value.rsplit("/", 2)
        if not own_subkey(subkey, entry.owner) or len(parts) != 3 or not parts[1].isdigit() \
                or not is_host_port(parts[0]):
            continue
        found.append(Holder(parts[0], int(parts[1]), parts[2], entry.owner))
    return sorted(found, key=lambda h: -h.updates)


class Adoption(NamedTuple):
    """One cell adopted lately, as its ``{layer}/adopted`` entry says."""
    uid: str
    at: float          # time.time() of the adoption
    updates: int       # of the replica adopted
    backward_calls: int

    def value(self) -> str:
        return f"{self.at:.0f}/{self.updates}/{self.backward_calls}"


def cell_subkey(uid: str) -> str | None:
    """The str subkey of a cell in its layer's ``adopted`` record; None when its coordinates are too long for one."""
    _, coords = split_uid(uid)
    subkey = ".".join(map(str, coords))
    return subkey if len(subkey) <= MAX_STR_SUBKEY else None


def adoptions(layer: str, record: Record) -> list[Adoption]:
    """The adoptions a ``{layer}/adopted`` record names."""
    found = []
    for subkey, entry in record.items():
        parts = entry.value.split("/")
        if not isinstance(subkey, str) or len(parts) != 3 or not all(part.isdigit() for part in parts):
            continue
        found.append(Adoption(f"{layer}.{subkey}", float(parts[0]), int(parts[1]), int(parts[2])))
    return found


def directory_entries(dht: DHT, uids: list[str],
                      ties: dict[str, list[Entry]] | None = None) -> dict[str, Entry | None]:
    """Each uid's entry in the expert directory (its endpoint, signed by its owner), None when nobody declares it.

    The entry is the uid's owned subkey in the record of its last strict prefix (:mod:`dmoe.directory.declarations`).
    ``ties``: filled with uid -> the tied owners' entries, for the uids read as None because the replicas of their
    entry went to different keys in equal numbers (:func:`~dmoe.dht.storage.merge_records`).
    """
    places = {uid: strict_prefixes(uid)[-1] for uid in uids}
    prefixes = list({prefix for prefix, _ in places.values()})
    if ties is None:
        records = dht.get_many(prefixes)
    else:
        tied: dict[str, dict] = {}
        records = dht.get_many(prefixes, ties=tied)
        ties.update({uid: tied[prefix][coordinate] for uid, (prefix, coordinate) in places.items()
                     if coordinate in tied.get(prefix, {})})
    return {uid: records[prefix].get(coordinate) for uid, (prefix, coordinate) in places.items()}


def owner_of(dht: DHT, uid: str) -> bytes | None:
    """The public key that owns ``uid`` in the directory now, None when its declaration has expired."""
    entry = directory_entries(dht, [uid])[uid]
    return entry.owner if entry is not None else None
