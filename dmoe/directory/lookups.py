"""Reading the expert directory: alive continuations of grid prefixes (what beam search walks), the endpoint of
each uid, and every alive expert of a layer's grid.

All of them read the prefix records :mod:`dmoe.directory.declarations` writes, through the generic
:meth:`dmoe.dht.DHT.get_many` (one batched look-up for all the keys of a call). Only entries validly signed for
their record reach here: the DHT drops the rest as replies arrive. An entry whose endpoint is no ``HOST:PORT``
(:func:`~dmoe.endpoints.is_host_port`) is read as absent: clients dial endpoints as gRPC targets, and a declaration
at ``unix:/run/x.sock`` sent trainers to a unix socket of their own machine (review 99 D3).
"""
from __future__ import annotations

from typing import Collection, Mapping, Protocol, Sequence, Union

from dmoe.dht import DHT
from dmoe.dht.storage import Record
from dmoe.endpoints import is_host_port
from dmoe.uid import is_valid_prefix, strict_prefixes

Continuations = dict[int, str]


class ContinuationSource(Protocol):
    """What walking a grid needs: for each prefix (``'ffn0'``, ``'ffn0.3'``), its alive next coordinates ->
    endpoint; for those of ``experts_under`` (a grid's last dimension), its alive experts only. A
    :class:`DirectoryReader` over a DHT, or a test's stand-in."""

    def get_alive_continuations(self, prefixes: Sequence[str], experts_under: Collection[str] = ()
                                ) -> Mapping[str, Mapping[int, str]]: ...


def continuations(record: Record, experts_only: bool = False) -> Continuations:
    """Alive coordinates of a (verified) prefix record -> endpoint: a uid's owned entry, else a shared prefix claim
    (whose endpoint is merely that of one server hosting something under it).

    ``experts_only``: the record is that of a grid's last dimension, whose coordinates are experts: only their
    owned entries count, as in :func:`get_experts`. Shared claims are anyone's to write (a server of a deeper grid
    under the same layer name, or anyone at all): read as experts, they sent a beam search's rows to an expert that
    nobody declared, at whatever endpoint their writer chose."""
    found = {subkey: entry.value for subkey, entry in record.items()
             if isinstance(subkey, int) and is_host_port(entry.value)}
    if experts_only:
        return found
    for subkey, entry in record.items():
        if isinstance(subkey, str) and subkey.isdigit() and len(subkey) < 10 and is_host_port(entry.value):
            found.setdefault(int(subkey), entry.value)
    return found


def get_alive_continuations(dht: DHT, prefixes: Sequence[str], experts_under: Collection[str] = ()
                            ) -> dict[str, Continuations]:
    """For each grid prefix, its alive continuations: coordinate -> endpoint. ``experts_under``: the prefixes of
    ``prefixes`` at a grid's last dimension, whose continuations are experts: only the declared ones, each with its
    own endpoint (so beam search needs no second look-up). Raises ValueError for an invalid prefix."""
    for prefix in prefixes:
        if not is_valid_prefix(prefix):
            raise ValueError(f"invalid grid prefix {prefix!r}")
    experts_under = frozenset(experts_under)
    records = dht.get_many(prefixes)
    return {prefix: continuations(record, prefix in experts_under) for prefix, record in records.items()}


def get_experts(dht: DHT, uids: Sequence[str]) -> list[str | None]:
    """The endpoint of each uid (its owner's, signed), or None when it is not declared, has expired or is declared at
    no ``HOST:PORT``."""
    parents = [strict_prefixes(uid)[-1] for uid in uids]  # (record of the last strict prefix, last coordinate)
    records = dht.get_many([prefix for prefix, _ in parents])
    found = [records[prefix].get(coordinate) for prefix, coordinate in parents]
    return [entry.value if entry is not None and is_host_port(entry.value) else None for entry in found]


class DirectoryReader:
    """A DHT read as the expert directory (a :class:`ContinuationSource`)."""

    def __init__(self, dht: DHT):
        self.dht = dht

    def get_alive_continuations(self, prefixes: Sequence[str], experts_under: Collection[str] = ()
                                ) -> dict[str, Continuations]:
        return get_alive_continuations(self.dht, prefixes, experts_under)


def continuation_source(dht: Union[DHT, ContinuationSource]) -> ContinuationSource:
    """``dht`` read as the directory when it is a :class:`~dmoe.dht.DHT`; anything else already is a source."""
    return DirectoryReader(dht) if isinstance(dht, DHT) else dht


def alive_experts(dht: Union[DHT, ContinuationSource], layer: str, grid: Sequence[int]) -> dict[str, str]:
    """uid -> endpoint of every declared, unexpired expert of ``layer`` inside ``grid``.

    Walks the grid-prefix records one dimension at a time (as beam search does), so a sparse grid costs one
    look-up per alive prefix rather than one per cell. Coordinates outside ``grid`` are ignored.
    """
    source = continuation_source(dht)
    prefixes = [layer]
    found: dict[str, str] = {}
    for axis, size in enumerate(grid):
        last = axis == len(grid) - 1
        alive = source.get_alive_continuations(prefixes, prefixes if last else ()) if prefixes else {}
        next_prefixes = []
        for prefix in prefixes:
            for coord, endpoint in sorted((alive.get(prefix) or {}).items()):
                if not 0 <= coord < size:
                    continue
                if last:
                    found[f"{prefix}.{coord}"] = endpoint
                else:
                    next_prefixes.append(f"{prefix}.{coord}")
        prefixes = next_prefixes
    return found
