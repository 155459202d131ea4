"""Experts in the DHT: declarations (uid -> endpoint, one subkey per grid prefix) and batched look-ups.

A uid ``ffn0.3.17`` declared at ``host:port`` writes subkey 3 of record ``ffn0`` and subkey 17 of record
``ffn0.3``, each valued with the endpoint and expiring at the same absolute time. The record of the last strict
prefix therefore maps every alive expert under it to its endpoint, so ``get_experts`` and beam search's final
dimension need no separate per-uid record (half the stores, and the two can never disagree).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Sequence

from kademlia.utils import digest

from dmoe.dht.node import DHTNode
from dmoe.dht.storage import Record
from dmoe.uid import check_uid, is_valid_prefix, strict_prefixes

log = logging.getLogger(__name__)


def declaration_records(uids: Sequence[str], endpoint: str, expiration_time: float,
                        max_subkeys: int) -> tuple[dict[str, Record], list[list[tuple[str, int]]]]:
    """The prefix records declaring ``uids``, and for each uid the (record, subkey) places it occupies."""
    records: dict[str, Record] = defaultdict(dict)
    places = []
    for uid in uids:
        places.append(strict_prefixes(check_uid(uid)))
        for prefix, coordinate in places[-1]:
            records[prefix][coordinate] = (endpoint, expiration_time)
    for prefix, record in records.items():
        if len(record) > max_subkeys:
            raise ValueError(
                f"declaring {len(record)} continuations of {prefix!r} exceeds max_record_subkeys={max_subkeys}: "
                f"a grid dimension may have at most {max_subkeys} coordinates so records fit in one datagram")
    return dict(records), places


async def declare_experts(node: DHTNode, uids: Sequence[str], endpoint: str,
                          expiration: float | None = None) -> list[bool]:
    """Declares ``uids`` as served at ``endpoint`` for ``expiration`` seconds; True per uid fully stored."""
    config = node.config
    if not endpoint or len(endpoint.encode()) > config.max_value_bytes:
        raise ValueError(f"endpoint {endpoint!r} must be non-empty and at most {config.max_value_bytes} bytes")
    expiration = config.default_expiration if expiration is None else float(expiration)
    if expiration <= 0:
        raise ValueError(f"expiration must be positive, got {expiration}")
    declaration_records(uids, endpoint, 0.0, config.max_record_subkeys)  # refuse bad uids before any traffic
    keys = list(dict.fromkeys(prefix for uid in uids for prefix, _ in strict_prefixes(uid)))
    replicas = await asyncio.gather(*(node.find_replicas(digest(key)) for key in keys))
    # the clock starts once the replicas are found: finding them can take timeouts when nodes have died
    records, places = declaration_records(uids, endpoint, time.time() + expiration, config.max_record_subkeys)
    replies = await asyncio.gather(*(node.store_record(key, records[key], nodes)
                                     for key, nodes in zip(keys, replicas)))
    stored: dict[tuple[str, int], bool | str] = {}
    for key, reply in zip(keys, replies):
        for subkey, result in zip(records[key], reply):
            stored[key, subkey] = result
            if isinstance(result, str):
                log.error("declaring %s.%s failed: %s", key, subkey, result)
    return [all(stored[place] is True for place in uid_places) for uid_places in places]


async def get_alive_continuations(node: DHTNode, prefixes: Sequence[str]) -> dict[str, dict[int, str]]:
    """For each prefix, its alive continuations: coordinate -> endpoint (the expert's own at the last dimension)."""
    for prefix in prefixes:
        if not is_valid_prefix(prefix):
            raise ValueError(f"invalid grid prefix {prefix!r}")
    records = await node.get_records(prefixes)
    return {prefix: {subkey: value for subkey, (value, _) in record.items() if isinstance(subkey, int)}
            for prefix, record in records.items()}


async def get_experts(node: DHTNode, uids: Sequence[str]) -> list[str | None]:
    """The endpoint of each uid, or None when it is not declared (or expired)."""
    parents = [strict_prefixes(uid)[-1] for uid in uids]  # (record of the last strict prefix, last coordinate)
    continuations = await get_alive_continuations(node, [prefix for prefix, _ in parents])
    return [continuations[prefix].get(coordinate) for prefix, coordinate in parents]


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
