"""Starting real dmoe programs in separate processes for tests, and always stopping them.

The machinery lives in :mod:`dmoe.launch`; tests only add a default of one torch thread per child process, so
that several servers and DHT nodes share the CI machine's two cores without oversubscribing them.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

from dmoe import launch
from dmoe.launch import LISTENING, ROOT, processes  # noqa: F401  (re-exported for tests)


def _test_env(env: dict[str, str] | None) -> dict[str, str]:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}


class Proc(launch.Proc):
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None):
        super().__init__(args, _test_env(env))


@contextlib.contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[launch.Proc]:
    """Starts ``python *args`` (one torch thread unless ``env`` says otherwise) and kills it on exit."""
    with launch.running(*args, env=_test_env(env)) as proc:
        yield proc
