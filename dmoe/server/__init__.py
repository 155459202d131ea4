"""The expert server: backends, task pools and runtime, the gRPC servicer (the expert classes: dmoe.experts)."""
from dmoe.server.backend import ExpertBackend, TensorSchema, make_optimizer
from dmoe.server.in_process import ExpertOptimizerConfig, InProcessExpert, in_process_experts
from dmoe.server.runtime import Runtime
from dmoe.server.server import ExpertServer, ServerConfig
from dmoe.server.servicer import ExpertServicer
from dmoe.server.task_pool import TaskPool

__all__ = [
    "ExpertBackend", "ExpertOptimizerConfig", "ExpertServer", "ExpertServicer", "InProcessExpert", "Runtime",
    "ServerConfig", "TaskPool", "TensorSchema", "in_process_experts", "make_optimizer",
]
