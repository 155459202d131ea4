"""The trainer behind ``dmoe-train`` and the demo: a gated transformer language model (``model``), its byte-level
text data (``data``) and the training loop with checkpoints and validation (``loop``)."""
from dmoe.trainer.data import TextData
from dmoe.trainer.loop import TrainConfig, make_moe_factory, train
from dmoe.trainer.model import GatedTransformerLM, ModelConfig

__all__ = ["GatedTransformerLM", "ModelConfig", "TextData", "TrainConfig", "make_moe_factory", "train"]
