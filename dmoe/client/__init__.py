"""The client side: calling remote experts."""
from dmoe.client.remote_expert import (
    RemoteExpert,
    RemoteExpertError,
    backward_future,
    expert_info,
    forward_future,
)

__all__ = ["RemoteExpert", "RemoteExpertError", "backward_future", "expert_info", "forward_future"]
