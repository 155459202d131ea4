"""Exclusive locks on files: one program at a time writes a checkpoint (a server's directory, a trainer's file).

``flock`` on a side file rather than on the checkpoint itself: checkpoints are replaced by renaming a temporary
file over them, which a lock on the old file's inode would not cover. The kernel drops the lock when its holder
exits, however it exits, so a crash never leaves a stale lock behind.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not POSIX: nothing is locked
    fcntl = None  # type: ignore[assignment]


class InUse(ValueError):
    """Another live process holds the lock."""


def lock_file(path: str | os.PathLike, what: str, holder_kind: str, advice: str,
              error: type[InUse] = InUse) -> IO[str] | None:
    """Takes the exclusive lock on ``path`` (created, with its directory, if missing) and returns the open file,
    which holds it until closed (or the process ends). Raises ``error`` saying ``what`` is in use by another
    ``holder_kind`` (the kind of program that takes such a lock), its pid, and ``advice``. None where the platform
    has no ``flock``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return None
    file = open(path, "a+")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as failure:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        if failure.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise error(f"{what} is in use by another {holder_kind} (pid {holder}): {advice}") from None
        raise
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


def lock_existing(path: str | os.PathLike, what: str, holder_kind: str, advice: str,
                  error: type[InUse] = InUse) -> IO[bytes] | None:
    """Takes the exclusive lock on the existing file ``path`` itself, opened read-only, and returns the open file,
    which holds it until closed: for a file that is never replaced and may sit where nothing can be written (a key
    on a read-only mount, where a side file cannot be created). Raises ``error`` as :func:`lock_file` does (without
    the holder's pid, which nothing can record there), OSError if ``path`` cannot be opened; None where the platform
    has no ``flock``."""
    file = open(path, "rb")
    if fcntl is None:
        file.close()
        return None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as failure:
        file.close()
        if failure.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise error(f"{what} is in use by another {holder_kind}: {advice}") from None
        raise
    return file
