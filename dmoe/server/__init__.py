"""The expert server: backends, task pools and runtime, the gRPC servicer, and the expert zoo."""
from dmoe.server.backend import ExpertBackend, TensorSchema, expert_seed, make_optimizer
from dmoe.server.layers import create_expert, expert_class_names, register_expert_class
from dmoe.server.runtime import Runtime
from dmoe.server.server import ExpertServer, ServerConfig
from dmoe.server.servicer import ExpertServicer
from dmoe.server.task_pool import TaskPool

__all__ = [
    "ExpertBackend", "ExpertServer", "ExpertServicer", "Runtime", "ServerConfig", "TaskPool",
    "TensorSchema", "create_expert", "expert_class_names", "expert_seed", "make_optimizer", "register_expert_class",
]
