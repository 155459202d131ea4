"""Collaborative training (DeDLOC): many volunteer trainers, each on its own data, train one set of dense
parameters; the experts keep training on their servers.

:class:`CollaborativeOptimizer` (:mod:`~dmoe.collab.optimizer`) wraps a trainer's torch optimizer: gradients
accumulate until the collaboration's samples reach the target batch size, then every trainer averages them with
the others (:class:`~dmoe.averaging.DecentralizedAverager`) and applies the same step. Progress lives in signed DHT
records (:mod:`~dmoe.collab.progress`); joiners and stragglers download the state from a live trainer
(:mod:`~dmoe.collab.state_sync`); :class:`CollaborationConfig` holds the knobs.
"""
from dmoe.collab.config import CollaborationConfig
from dmoe.collab.optimizer import CollaborativeOptimizer
from dmoe.collab.progress import CollaborationState, Progress, ProgressTracker
from dmoe.collab.state_sync import StateDownloadError, StateMismatch, TrainingState

__all__ = ["CollaborationConfig", "CollaborationState", "CollaborativeOptimizer", "Progress", "ProgressTracker",
           "StateDownloadError", "StateMismatch", "TrainingState"]
