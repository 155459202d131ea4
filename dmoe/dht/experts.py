"""Experts in the DHT: declarations (uid -> endpoint, one subkey per grid prefix) and batched look-ups.

A uid ``ffn0.3.17`` declared at ``host:port`` writes the shared claim ``"3"`` (a str subkey) of record ``ffn0``
and the owned entry ``17`` (an int subkey) of record ``ffn0.3``, each valued with the endpoint, expiring at the
same absolute time and signed by the declarer's :class:`~dmoe.dht.signing.Identity`. The record of the last
strict prefix therefore maps every alive expert under it to its endpoint, so ``get_experts`` and beam search's
final dimension need no separate per-uid record (half the stores, and the two can never disagree).

The owned entry belongs to the first key that declared the uid until it expires (nobody else can redirect the
uid); the shared claims of every server hosting ``ffn0.3.*`` merge into one entry that lives as long as the
longest of them (nobody can cut it short). See :mod:`dmoe.dht.storage` for the rules nodes enforce.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Sequence

from kademlia.utils import digest

from dmoe.dht.node import DHTNode
from dmoe.dht.protocol import VALUE_PATTERN
from dmoe.dht.signing import Identity
from dmoe.dht.storage import Entry, Record
from dmoe.uid import check_uid, is_valid_prefix, strict_prefixes

log = logging.getLogger(__name__)


def declaration_records(uids: Sequence[str], endpoint: str, expiration_time: float, max_subkeys: int,
                        identity: Identity | None = None
                        ) -> tuple[dict[str, Record], list[list[tuple[str, int | str]]]]:
    """The prefix records declaring ``uids``, signed by ``identity`` (unsigned without one), and for each uid the
    (record, subkey) places it occupies: shared str subkeys in the records of its inner prefixes, its owned int
    subkey in the record of its last strict prefix."""
    records: dict[str, Record] = defaultdict(dict)
    places = []
    for uid in uids:
        prefixes = strict_prefixes(check_uid(uid))
        places.append([(prefix, coordinate if last else str(coordinate))
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


def _entry(prefix: str, subkey: int | str, endpoint: str, expiration_time: float, identity: Identity | None) -> Entry:
    if identity is None:
        return Entry(endpoint, expiration_time)
    return identity.entry(digest(prefix), subkey, endpoint, expiration_time)


async def declare_experts(node: DHTNode, uids: Sequence[str], endpoint: str,
                          expiration: float | None = None) -> list[bool]:
    """Declares ``uids`` as served at ``endpoint`` for ``expiration`` seconds; True per uid fully stored."""
    config = node.config
    if not endpoint or len(endpoint.encode()) > config.max_value_bytes or VALUE_PATTERN.fullmatch(endpoint) is None:
        raise ValueError(f"endpoint {endpoint!r} must be non-empty printable ASCII (no spaces, quotes or "
                         f"backslashes) of at most {config.max_value_bytes} bytes")
    expiration = config.default_expiration if expiration is None else float(expiration)
    if expiration <= 0:
        raise ValueError(f"expiration must be positive, got {expiration}")
    declaration_records(uids, endpoint, 0.0, config.max_record_subkeys)  # refuse bad uids before any traffic
    keys = list(dict.fromkeys(prefix for uid in uids for prefix, _ in strict_prefixes(uid)))
    replicas = await asyncio.gather(*(node.find_replicas(digest(key)) for key in keys))
    # the clock starts once the replicas are found: finding them can take timeouts when nodes have died
    # rounded to milliseconds: shorter in every reply, and signed exactly as sent
    records, places = declaration_records(uids, endpoint, round(time.time() + expiration, 3),
                                          config.max_record_subkeys, node.identity)
    replies = await node.store_records({key: records[key] for key in keys}, replicas)  # in the replicas' order
    stored: dict[tuple[str, int | str], bool | str] = {}
    for key, reply in replies.items():
        for subkey, result in zip(records[key], reply):
            stored[key, subkey] = result
            if isinstance(result, str):
                log.error("declaring %s.%s failed: %s", key, subkey, result)
    return [all(stored[place] is True for place in uid_places) for uid_places in places]


def continuations(record: Record) -> dict[int, str]:
    """Alive coordinates of a (verified) record -> endpoint: a uid's owned entry, else a shared prefix claim
    (whose endpoint is merely that of one server hosting something under it)."""
    found = {subkey: entry.value for subkey, entry in record.items() if isinstance(subkey, int)}
    for subkey, entry in record.items():
        if isinstance(subkey, str) and subkey.isdigit() and len(subkey) < 10:
            found.setdefault(int(subkey), entry.value)
    return found


async def get_alive_continuations(node: DHTNode, prefixes: Sequence[str]) -> dict[str, dict[int, str]]:
    """For each prefix, its alive continuations: coordinate -> endpoint (the expert's own at the last dimension).

    Only entries validly signed for their record reach here (the node drops the rest as replies arrive).
    """
    for prefix in prefixes:
        if not is_valid_prefix(prefix):
            raise ValueError(f"invalid grid prefix {prefix!r}")
    records = await node.get_records(prefixes)
    return {prefix: continuations(record) for prefix, record in records.items()}


async def get_experts(node: DHTNode, uids: Sequence[str]) -> list[str | None]:
    """The endpoint of each uid (its owner's, signed), or None when it is not declared (or expired)."""
    parents = [strict_prefixes(uid)[-1] for uid in uids]  # (record of the last strict prefix, last coordinate)
    records = await node.get_records([prefix for prefix, _ in parents])
    found = [records[prefix].get(coordinate) for prefix, coordinate in parents]
    return [entry.value if entry is not None else None for entry in found]


async def announce_forever(node: DHTNode, uids: Sequence[str], endpoint: str, refresh_period: float,
                           expiration: float) -> None:
    """Re-declares ``uids`` every ``refresh_period`` seconds until cancelled; failures are retried sooner."""
    while True:
        started = time.monotonic()
        try:
            results = await declare_experts(node, uids, endpoint, expiration)
            failed = len(results) - sum(results)
            if failed:
                log.warning("%d of %d experts could not be declared; retrying soon", failed, len(results))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("declaring experts failed; retrying soon")
            failed = 1
        period = refresh_period / 4 if failed else refresh_period
        await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
