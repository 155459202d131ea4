"""Declaring experts: a uid and its endpoint written into the DHT's records of the uid's grid prefixes.

A uid ``ffn0.3.17`` declared at ``host:port`` writes the shared entry ``"3"`` (a str subkey) of record ``ffn0``
and the owned entry ``17`` (an int subkey) of record ``ffn0.3``, each valued with the endpoint, expiring at the
same absolute time and signed by the declarer's :class:`~dmoe.dht.Identity`. The record of the last strict
prefix therefore maps every alive expert under it to its endpoint, so :func:`~dmoe.directory.get_experts` and
beam search's last dimension need no separate per-uid record (half the stores, and the two can never disagree).

The owned entry belongs to the first key that declared the uid until it expires (nobody else can redirect the
uid); the shared claims of every server hosting ``ffn0.3.*`` merge into one entry that lives as long as the
longest of them (nobody can cut it short). See :mod:`dmoe.dht.storage` for the rules nodes enforce.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import NamedTuple, Sequence

from kademlia.utils import digest

from dmoe.dht import DHT, DHTNode, Identity
from dmoe.dht.messages import VALUE_PATTERN
from dmoe.dht.storage import Entry, Record, Subkey, check_expiration, to_milliseconds
from dmoe.uid import check_uid, strict_prefixes

logger = logging.getLogger(__name__)


class Place(NamedTuple):
    """One entry a declaration writes: a record (a grid prefix) and the subkey in it."""
    key: str
    subkey: Subkey


def declaration_records(uids: Sequence[str], endpoint: str, expiration_time: float, max_subkeys: int,
                        identity: Identity | None = None) -> tuple[dict[str, Record], list[list[Place]]]:
    """The prefix records declaring ``uids``, signed by ``identity`` (unsigned without one), and for each uid the
    places it occupies: shared str subkeys in the records of its inner prefixes, its owned int subkey in the record
    of its last strict prefix."""
    records: dict[str, Record] = defaultdict(dict)
    places = []
    for uid in uids:
        prefixes = strict_prefixes(check_uid(uid))
        places.append([Place(prefix, coordinate if last else str(coordinate))
                       for last, (prefix, coordinate) in zip([False] * (len(prefixes) - 1) + [True], prefixes)])
        for prefix, subkey in places[-1]:
            if subkey not in records[prefix]:
                records[prefix][subkey] = _entry(prefix, subkey, endpoint, expiration_time, identity)
    for prefix, record in records.items():
        if len(record) > max_subkeys:
            raise ValueError(
                f"declaring {len(record)} continuations of {prefix!r} exceeds max_record_subkeys={max_subkeys}: "
                f"a grid dimension may have at most {max_subkeys} coordinates so records fit in one datagram")
    return dict(records), places


def _entry(prefix: str, subkey: Subkey, endpoint: str, expiration_time: float, identity: Identity | None) -> Entry:
    if identity is None:
        return Entry(endpoint, expiration_time)
    return identity.entry(digest(prefix), subkey, endpoint, expiration_time)


async def declare(node: DHTNode, uids: Sequence[str], endpoint: str, expiration: float | None = None) -> list[bool]:
    """Declares ``uids`` as served at ``endpoint`` for ``expiration`` seconds (default: the node's
    ``default_expiration``), on the node's loop; True per uid whose every entry reached at least one replica."""
    config = node.config
    if not endpoint or len(endpoint.encode()) > config.max_value_bytes or VALUE_PATTERN.fullmatch(endpoint) is None:
        raise ValueError(f"endpoint {endpoint!r} must be non-empty printable ASCII (no spaces, quotes or "
                         f"backslashes) of at most {config.max_value_bytes} bytes")
    expiration = config.default_expiration if expiration is None else float(expiration)
    if expiration <= 0:
        raise ValueError(f"expiration must be positive, got {expiration}")
    check_expiration(time.time() + expiration, config.max_expiration)  # before the replica search, not after
    declaration_records(uids, endpoint, 0.0, config.max_record_subkeys)  # refuse bad uids before any traffic
    keys = list(dict.fromkeys(prefix for uid in uids for prefix, _ in strict_prefixes(uid)))
    replicas = await asyncio.gather(*(node.find_replicas(digest(key)) for key in keys))
    # the clock starts once the replicas are found: finding them can take timeouts when nodes have died
    # to milliseconds, down (up, an expiration of exactly max_expiration was refused a third of the time, review 89):
    # shorter in every reply, and signed exactly as sent
    records, places = declaration_records(uids, endpoint, to_milliseconds(time.time() + expiration),
                                          config.max_record_subkeys, node.identity)
    replies = await node.store_records({key: records[key] for key in keys}, replicas)  # in the replicas' order
    stored: dict[Place, bool | str] = {}
    for key, reply in replies.items():
        for subkey, result in zip(records[key], reply):
            stored[Place(key, subkey)] = result
            if isinstance(result, str):
                logger.error("declaring %s.%s failed: %s", key, subkey, result)
    return [all(stored[place] is True for place in uid_places) for uid_places in places]


async def taken_by_others(node: DHTNode, uids: Sequence[str]) -> dict[str, Entry]:
    """The uids of ``uids`` that readers find declared by another key than ``node``'s: uid -> that key's entry
    (whose value is where clients are sent). A declaration counts as stored when any replica takes it, so one that
    most replicas refused (another key held the uid there first, or got there by a hand-over) went unnoticed."""
    parents = {uid: strict_prefixes(uid)[-1] for uid in uids}
    records = await node.get_records(list(dict.fromkeys(prefix for prefix, _ in parents.values())))
    taken = {}
    for uid, (prefix, coordinate) in parents.items():
        entry = records[prefix].get(coordinate)
        if entry is not None and entry.owner != node.identity.public_key:
            taken[uid] = entry
    return taken


def declare_experts(dht: DHT, uids: Sequence[str], endpoint: str, expiration: float | None = None) -> list[bool]:
    """Declares ``uids`` served at ``endpoint`` for ``expiration`` seconds through ``dht`` (see :func:`declare`):
    every record concurrently, signed by the node's identity. Raises ValueError for a uid or endpoint no node would
    accept, or a grid dimension larger than a record holds."""
    return dht.run_coroutine(declare(dht.node, list(uids), endpoint, expiration))
