"""Starting real dmoe programs in separate processes for tests, and always stopping them.

The machinery lives in :mod:`dmoe.launch`; tests only add a default of one torch thread per child process, so
that several servers and DHT nodes share the CI machine's two cores without oversubscribing them.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

from dmoe.launch import LISTENING, ROOT, processes  # noqa: F401  (re-exported for tests)
from dmoe.launch import Proc as _Proc


class Proc(_Proc):
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None):
        super().__init__(args, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})})


@contextlib.contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """Starts ``python *args`` and kills it on exit."""
    with processes() as procs:
        proc = Proc(args, env)
        procs.append(proc)
        yield proc
