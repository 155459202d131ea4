"""The client side: calling remote experts, finding alive ones (beam search), and mixing them (the DMoE layer)."""
from dmoe.client.bans import BanConfig, Bans
from dmoe.client.beam_search import PrefixCache, beam_search
from dmoe.client.failures import CallPolicy
from dmoe.client.gating import LocalMixtureOfExperts, MoEStats, NoAliveExpertsError
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.client.remote_expert import (
    MalformedAnswer,
    RemoteExpert,
    RemoteExpertError,
    backward_future,
    backward_futures,
    expert_info,
    forward_future,
    forward_futures,
    new_activation_id,
)

__all__ = [
    "BanConfig", "Bans", "CallPolicy", "LocalMixtureOfExperts", "MalformedAnswer", "MoEStats", "NoAliveExpertsError",
    "PrefixCache", "RemoteExpert", "RemoteExpertError", "RemoteMixtureOfExperts", "backward_future", "backward_futures",
    "beam_search", "expert_info", "forward_future", "forward_futures", "new_activation_id",
]
