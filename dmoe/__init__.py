"""dmoe: Decentralized Mixture-of-Experts for PyTorch.

Experts live on volunteers' expert servers (:class:`ExpertServer`), announce themselves in a Kademlia DHT
(:class:`DHT`), and are mixed by a client-side layer (:class:`RemoteMixtureOfExperts`) that finds the best
alive experts with :func:`beam_search` and calls them over gRPC.
"""
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
from dmoe.dht import DHT, DHTConfig, ExpertAnnouncer
from dmoe.experts import create_expert, expert_class_names, expert_seed, register_expert_class
from dmoe.launch import LocalSwarm, SwarmConfig
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

__version__ = "0.1.0"

__all__ = [
    "BanConfig", "Bans", "DHT", "DHTConfig", "ExpertAnnouncer", "ExpertBackend", "ExpertOptimizerConfig", "ExpertServer", "InProcessExpert",
    "LocalMixtureOfExperts", "LocalSwarm", "MoEStats", "NoAliveExpertsError", "PrefixCache", "RemoteExpert",
    "RemoteExpertError", "RemoteMixtureOfExperts", "Runtime", "ServerConfig", "SwarmConfig", "backward_future",
    "backward_futures", "beam_search", "create_expert", "expand_pattern", "expert_class_names", "expert_info", "expert_seed",
    "forward_future", "forward_futures", "grid_uids", "in_process_experts", "register_expert_class", "split_uid",
]
