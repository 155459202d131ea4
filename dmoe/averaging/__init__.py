"""Decentralized averaging (Moshpit SGD): peers average their tensors in small groups found through the DHT.

``DecentralizedAverager`` is the one public object: ``step()`` runs one round (matchmaking through signed DHT
records, :mod:`~dmoe.averaging.matchmaking`; butterfly all-reduce over gRPC, :mod:`~dmoe.averaging.allreduce` and
:mod:`~dmoe.averaging.service`); ``AveragerConfig`` holds the knobs; the Moshpit grid lives in
:mod:`~dmoe.averaging.grid`.
"""
from dmoe.averaging.averager import DecentralizedAverager, GroupInfo
from dmoe.averaging.config import AveragerConfig

__all__ = ["AveragerConfig", "DecentralizedAverager", "GroupInfo"]
