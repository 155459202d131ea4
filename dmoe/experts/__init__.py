"""The expert zoo and the registry through which users add their own expert classes."""
from dmoe.experts.registry import (
    ExpertBuildError,
    ExpertClass,
    create_expert,
    expert_class,
    expert_class_names,
    expert_seed,
    mixture_input_problem,
    register_expert_class,
)
from dmoe.experts.zoo import TRANSFORMER_SEQ_LEN, FeedforwardExpert, NopExpert, TransformerExpert

__all__ = [
    "ExpertBuildError", "ExpertClass", "FeedforwardExpert", "NopExpert", "TRANSFORMER_SEQ_LEN", "TransformerExpert", "create_expert",
    "expert_class", "expert_class_names", "expert_seed", "mixture_input_problem", "register_expert_class",
]
