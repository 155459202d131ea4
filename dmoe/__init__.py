"""dmoe: Decentralized Mixture-of-Experts for PyTorch.

Experts live on volunteers' expert servers (:class:`ExpertServer`), are announced in the expert directory
(:class:`Announcer`, :mod:`dmoe.directory`) kept in a Kademlia DHT of signed records (:class:`DHT`), and are mixed
by a client-side layer (:class:`RemoteMixtureOfExperts`) that finds the best alive experts with :func:`beam_search`
and calls them over gRPC. Servers keep replicas of each other's experts and adopt those of servers that left
(:class:`Replication`). Trainers average their dense parameters with :class:`DecentralizedAverager` (Moshpit
all-reduce in groups found through the DHT); volunteers' trainers train one model together through
:class:`CollaborativeOptimizer` (DeDLOC: a global batch accumulated across trainers, one averaged step).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and IDEs
    from dmoe.averaging import AveragerConfig, DecentralizedAverager, GroupInfo
    from dmoe.client.bans import BanConfig, Bans
    from dmoe.client.beam_search import PrefixCache, beam_search
    from dmoe.client.gating import LocalMixtureOfExperts, MoEStats, NoAliveExpertsError
    from dmoe.client.moe import RemoteMixtureOfExperts
    from dmoe.client.remote_expert import (
        RemoteExpert,
        RemoteExpertError,
        backward_future,
        backward_futures,
        expert_info,
        forward_future,
        forward_futures,
    )
    from dmoe.collab import CollaborationConfig, CollaborativeOptimizer
    from dmoe.dht import DHT, DHTConfig
    from dmoe.directory import Announcer, declare_experts, get_experts
    from dmoe.experts import create_expert, expert_class_names, expert_seed, register_expert_class
    from dmoe.launch import LocalSwarm, SwarmConfig
    from dmoe.replicas import ReplicaConfig, Replication
    from dmoe.server import (
        ExpertBackend,
        ExpertOptimizerConfig,
        ExpertServer,
        InProcessExpert,
        Runtime,
        ServerConfig,
        in_process_experts,
    )
    from dmoe.uid import expand_pattern, grid_uids, split_uid

_MODULES = {  # the module that defines each public name, imported on first use
    "dmoe.averaging": ("AveragerConfig", "DecentralizedAverager", "GroupInfo"),
    "dmoe.client.bans": ("BanConfig", "Bans"),
    "dmoe.client.beam_search": ("PrefixCache", "beam_search"),
    "dmoe.client.gating": ("LocalMixtureOfExperts", "MoEStats", "NoAliveExpertsError"),
    "dmoe.client.moe": ("RemoteMixtureOfExperts",),
    "dmoe.client.remote_expert": ("RemoteExpert", "RemoteExpertError", "backward_future", "backward_futures",
                                  "expert_info", "forward_future", "forward_futures"),
    "dmoe.collab": ("CollaborationConfig", "CollaborativeOptimizer"),
    "dmoe.dht": ("DHT", "DHTConfig"),
    "dmoe.directory": ("Announcer", "declare_experts", "get_experts"),
    "dmoe.experts": ("create_expert", "expert_class_names", "expert_seed", "register_expert_class"),
    "dmoe.launch": ("LocalSwarm", "SwarmConfig"),
    "dmoe.replicas": ("ReplicaConfig", "Replication"),
    "dmoe.server": ("ExpertBackend", "ExpertOptimizerConfig", "ExpertServer", "InProcessExpert", "Runtime",
                    "ServerConfig", "in_process_experts"),
    "dmoe.uid": ("expand_pattern", "grid_uids", "split_uid"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first use (PEP 562): ``python -m dmoe.dht`` and other programs that need
    no torch start without importing it (about two seconds of CPU per process on a small VM)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "Announcer", "AveragerConfig", "BanConfig", "Bans", "CollaborationConfig", "CollaborativeOptimizer", "DHT",
    "DHTConfig", "DecentralizedAverager",
    "ExpertBackend", "ExpertOptimizerConfig", "ExpertServer", "GroupInfo", "InProcessExpert",
    "LocalMixtureOfExperts", "LocalSwarm", "MoEStats", "NoAliveExpertsError", "PrefixCache", "RemoteExpert",
    "RemoteExpertError", "RemoteMixtureOfExperts", "ReplicaConfig", "Replication", "Runtime", "ServerConfig",
    "SwarmConfig", "backward_future", "backward_futures", "beam_search", "create_expert", "declare_experts",
    "expand_pattern", "expert_class_names", "expert_info", "expert_seed", "forward_future", "forward_futures",
    "get_experts", "grid_uids", "in_process_experts", "register_expert_class", "split_uid",
]
