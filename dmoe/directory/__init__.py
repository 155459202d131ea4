"""The expert directory: which experts are alive and where, kept in the DHT's signed records.

A server *declares* its experts (:mod:`~dmoe.directory.declarations`: one write of each uid's entries) and its
:class:`Announcer` *announces* them: declares them again every refresh period while the server lives. Clients
read the same records (:mod:`~dmoe.directory.lookups`): beam search walks the alive continuations of grid
prefixes; a new server picks free cells (:mod:`~dmoe.directory.placement`). :mod:`dmoe.dht` underneath knows
nothing of experts: only records, subkeys, owners and expiry.
"""
from dmoe.directory.announcer import Announcer, announce_forever
from dmoe.directory.declarations import declaration_records, declare, declare_experts
from dmoe.directory.lookups import (
    ContinuationSource,
    DirectoryReader,
    alive_experts,
    continuation_source,
    continuations,
    get_alive_continuations,
    get_experts,
)
from dmoe.directory.placement import choose_experts, free_experts

__all__ = ["Announcer", "ContinuationSource", "DirectoryReader", "alive_experts", "announce_forever",
           "choose_experts", "continuation_source", "continuations", "declaration_records", "declare",
           "declare_experts", "free_experts", "get_alive_continuations", "get_experts"]
