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

_EXPORTS = {  # public name -> the module that defines it, imported on first use
    "AveragerConfig": "dmoe.averaging",
    "DecentralizedAverager": "dmoe.averaging",
    "GroupInfo": "dmoe.averaging",
    "BanConfig": "dmoe.client.bans",
    "Bans": "dmoe.client.bans",
    "PrefixCache": "dmoe.client.beam_search",
    "beam_search": "dmoe.client.beam_search",
    "LocalMixtureOfExperts": "dmoe.client.gating",
    "MoEStats": "dmoe.client.gating",
    "NoAliveExpertsError": "dmoe.client.gating",
    "RemoteMixtureOfExperts": "dmoe.client.moe",
    "RemoteExpert": "dmoe.client.remote_expert",
    "RemoteExpertError": "dmoe.client.remote_expert",
    "backward_future": "dmoe.client.remote_expert",
    "backward_futures": "dmoe.client.remote_expert",
    "expert_info": "dmoe.client.remote_expert",
    "forward_future": "dmoe.client.remote_expert",
    "forward_futures": "dmoe.client.remote_expert",
    "CollaborationConfig": "dmoe.collab",
    "CollaborativeOptimizer": "dmoe.collab",
    "DHT": "dmoe.dht",
    "DHTConfig": "dmoe.dht",
    "Announcer": "dmoe.directory",
    "declare_experts": "dmoe.directory",
    "get_experts": "dmoe.directory",
    "create_expert": "dmoe.experts",
    "expert_class_names": "dmoe.experts",
    "expert_seed": "dmoe.experts",
    "register_expert_class": "dmoe.experts",
    "LocalSwarm": "dmoe.launch",
    "SwarmConfig": "dmoe.launch",
    "ReplicaConfig": "dmoe.replicas",
    "Replication": "dmoe.replicas",
    "ExpertBackend": "dmoe.server",
    "ExpertOptimizerConfig": "dmoe.server",
    "ExpertServer": "dmoe.server",
    "InProcessExpert": "dmoe.server",
    "Runtime": "dmoe.server",
    "ServerConfig": "dmoe.server",
    "in_process_experts": "dmoe.server",
    "expand_pattern": "dmoe.uid",
    "grid_uids": "dmoe.uid",
    "split_uid": "dmoe.uid",
}


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
