"""Settings of a :class:`~dmoe.collab.CollaborativeOptimizer`, in one dataclass so programs can expose them as flags
(the averager's own settings stay in :class:`~dmoe.averaging.AveragerConfig`)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dmoe.endpoints import check_host

#: a run id is one DHT key component: letters, digits, dashes and underscores
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or RUN_ID.fullmatch(run_id) is None:
        raise ValueError(f"run_id must be 1-64 letters, digits, dashes or underscores, got {run_id!r}")
    return run_id


@dataclass
class CollaborationConfig:
    """Knobs of collaborative training; every field but ``target_batch_size`` has a sensible default.

    target_batch_size: samples the whole collaboration accumulates toward one optimizer step, over all trainers.
    refresh_period: seconds between two publications of this trainer's progress (and reads of the others'); sooner
        when the collaboration is expected to reach the target earlier.
    progress_ttl: seconds a progress record lives after its last refresh: a trainer that died stops being counted
        (and waited for when the group forms) this long after it died.
    max_samples_ratio: a record claiming more samples than this many target batches is refused as absurd (an
        honest trainer overshoots the target by about one of its batches).
    max_clock_skew: a record stamped more than this many seconds in the future is refused.
    ban_time: seconds a peer is ignored after it claimed a step its state server could not back, or served a state
        that does not fit the model; its state server's machine is not downloaded from for as long (twice as long
        each time it fails again, at most 16 times), unless the refusal may be no fault of the server's and came
        quickly (see :func:`dmoe.collab.optimizer.slow_refusal`).
    grad_clip: clip the norm of the averaged gradient before each step (0: off); every trainer clips the same
        gradient, so the parameters stay equal.
    averaging_timeout: seconds one step may spend averaging (0: the averager's ``step_timeout``).
    state_timeout: seconds a state download may take.
    state_host, state_port: where this trainer serves its state to joiners (port 0 picks a free one). A trainer in
        client mode (``AveragerConfig.client_mode``) serves nothing and only downloads.
    state_announce_host: the host the others are told for the state server, as ``AveragerConfig.announce_host``.
    finish_timeout: at the end of training, seconds :meth:`CollaborativeOptimizer.finish` waits for the trainers it
        trained with to reach the last step.
    failed_download_share: the most of a trainer's time that state downloads which come to nothing may take, whatever
        their sources, after the first min(5 s, ``state_timeout`` / 4) of them: records are free to write and may
        name any address (review 107). 1 puts no limit.
    """

    target_batch_size: int
    refresh_period: float = 1.0
    progress_ttl: float = 10.0
    max_samples_ratio: float = 10.0
    max_clock_skew: float = 30.0
    ban_time: float = 60.0
    grad_clip: float = 0.0
    averaging_timeout: float = 0.0
    state_timeout: float = 60.0
    state_host: str = "127.0.0.1"
    state_port: int = 0
    state_announce_host: str | None = None
    finish_timeout: float = 60.0
    failed_download_share: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.target_batch_size, bool) or not isinstance(self.target_batch_size, int) \
                or self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be a positive int, got {self.target_batch_size!r}")
        for name in ("refresh_period", "progress_ttl", "max_clock_skew", "state_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("ban_time", "grad_clip", "averaging_timeout", "finish_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.failed_download_share <= 1:
            raise ValueError(f"failed_download_share must be in (0, 1], got {self.failed_download_share}")
        if not self.max_samples_ratio >= 1:
            raise ValueError(f"max_samples_ratio must be at least 1, got {self.max_samples_ratio}")
        if self.progress_ttl < 2 * self.refresh_period:
            raise ValueError(f"progress_ttl ({self.progress_ttl}) must be at least two refresh periods "
                             f"({self.refresh_period}): records would expire between refreshes")
        if not 0 <= self.state_port < 65536:
            raise ValueError(f"state_port must be in 0..65535, got {self.state_port}")
        if self.state_announce_host:  # (review 99 D5, as AveragerConfig.announce_host)
            try:
                check_host(self.state_announce_host)
            except ValueError as error:
                raise ValueError(f"state_announce_host: {error}") from None

    @property
    def max_samples(self) -> float:
        """The most samples a progress record may claim."""
        return self.max_samples_ratio * self.target_batch_size
