"""Signed record entries: each writer has an Ed25519 identity, and every entry it stores carries its public key
and a signature over (record key digest, subkey, value, expiration, issue time).

Nodes verify entries before storing them and clients verify what they receive before using it, so an entry
cannot be forged, re-dated (the expiration and the issue time are signed) or moved to another record or subkey.
Ownership rules (who may replace what) live in :mod:`dmoe.dht.storage`; this module only says whether an entry is
authentic.

The issue time (``issued_us``, integer microseconds of the writer's wall clock when it signed) orders one
owner's entries of an owned subkey: the latest issued replaces the others, whatever their expirations (see
:func:`dmoe.dht.storage.supersedes`). :meth:`Identity.entry` stamps it, strictly increasing per identity.
"""
from __future__ import annotations

import functools
import logging
import os
import struct
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dmoe.dht.storage import Entry, Subkey

logger = logging.getLogger(__name__)

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
AUTH_BYTES = PUBLIC_KEY_BYTES + SIGNATURE_BYTES
#: v2: the issue time is signed too (v1 entries, without it, verify under no v2 message)
_DOMAIN = b"dmoe-dht-entry-v2\x00"
#: v1: what the signatures that are no DHT entry's cover (see :func:`entry_message`)
_DOMAIN_V1 = b"dmoe-dht-entry-v1\x00"
#: the issue times a signed message can carry: non-negative and packed in 8 bytes (``struct`` ">q")
MAX_ISSUED_US = 2**63 - 1


def entry_message(key: bytes, subkey: Subkey, value: str, expiration: float, issued_us: int | None = None) -> bytes:
    """The bytes an entry's signature covers. The kind byte tells the int subkey 3 (an owned entry) from the
    str subkey "3" (a shared one), so a signature for one kind can never pass for the other. ``issued_us``: when the
    writer signed it, for a DHT entry (every one carries it); None for the signatures that are no DHT entry's
    (replica snapshots, averaging parts), which cover the message of version 1, without it: a replica held on disk
    since an earlier version still verifies, and can be adopted."""
    kind = b"i" if isinstance(subkey, int) else b"s"
    subkey_bytes = str(subkey).encode()
    times = struct.pack(">d", float(expiration)) if issued_us is None else \
        struct.pack(">dq", float(expiration), issued_us)
    return b"".join((_DOMAIN_V1 if issued_us is None else _DOMAIN, key, times, kind,
                     len(subkey_bytes).to_bytes(1, "big"), subkey_bytes, value.encode()))


class Identity:
    """An Ed25519 key pair: a node's identity in the DHT (owner of the int subkeys it stores first).

    Use :meth:`load_or_create` for an identity that survives restarts, or ``Identity()`` for an ephemeral one.
    """

    def __init__(self, private_key: Ed25519PrivateKey | None = None):
        self._private_key = private_key or Ed25519PrivateKey.generate()
        self.public_key: bytes = self._private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self._last_issued_us = 0
        self._issue_lock = threading.Lock()

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """The identity of a raw 32-byte Ed25519 seed (:attr:`seed`)."""
        if len(seed) != 32:
            raise ValueError(f"an Ed25519 seed has 32 bytes, not {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def seed(self) -> bytes:
        """The private key's raw 32 bytes: what :meth:`load_or_create` stores, :meth:`from_seed` reads."""
        return self._private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                               serialization.NoEncryption())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> "Identity":
        """The key stored at ``path`` (raw 32-byte Ed25519 seed), created there (mode 0600, atomically) if absent."""
        path = Path(path)
        if path.exists():
            seed = path.read_bytes()
            if len(seed) != 32:
                raise ValueError(f"identity file {path} is not a 32-byte Ed25519 key ({len(seed)} bytes)")
            identity = cls.from_seed(seed)
            logger.info("loaded DHT identity %s from %s", identity.public_key.hex()[:16], path)
            return identity
        identity = cls()
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = identity.seed
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(seed)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        logger.info("created DHT identity %s in %s", identity.public_key.hex()[:16], path)
        return identity

    def sign(self, key: bytes, subkey: Subkey, value: str, expiration: float, issued_us: int | None = None) -> bytes:
        return self._private_key.sign(entry_message(key, subkey, value, expiration, issued_us))

    def issue_time(self) -> int:
        """Now, in microseconds of the wall clock, and later than any issue time this identity gave before: two
        entries signed in the same microsecond (or tick of a coarse clock) must still be ordered (the later one
        replaces the earlier)."""
        with self._issue_lock:
            self._last_issued_us = max(int(time.time() * 1_000_000), self._last_issued_us + 1)
            return self._last_issued_us

    def entry(self, key: bytes, subkey: Subkey, value: str, expiration: float, issued_us: int | None = None) -> Entry:
        """A record entry signed by this identity, for the record whose key digest is ``key``, issued now (or at
        ``issued_us``)."""
        expiration = float(expiration)
        issued_us = self.issue_time() if issued_us is None else issued_us
        return Entry(value, expiration, self.public_key, self.sign(key, subkey, value, expiration, issued_us),
                     issued_us)


def valid_issue_time(issued_us: object) -> bool:
    """An issue time a signed message can carry: an int (not a bool) in ``[0, MAX_ISSUED_US]``."""
    return isinstance(issued_us, int) and not isinstance(issued_us, bool) and 0 <= issued_us <= MAX_ISSUED_US


def verify(key: bytes, subkey: Subkey, value: str, expiration: float, owner: bytes, signature: bytes,
           issued_us: int | None = None) -> bool:
    """True when ``signature`` is ``owner``'s over this entry (``issued_us``: see :func:`entry_message`)."""
    if len(owner) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES or (
            issued_us is not None and not valid_issue_time(issued_us)):
        return False
    try:
        _public_key(owner).verify(signature, entry_message(key, subkey, value, expiration, issued_us))
    except (InvalidSignature, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _public_key(owner: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(owner)


class Verifier:
    """:func:`verify` with a bounded memo: lookups re-read the same entries every few seconds, and a verification
    costs far more than a look-up of the memo."""

    def __init__(self, capacity: int = 1 << 17):
        self.capacity = capacity
        self._known: dict[tuple, bool] = {}

    def known(self, key: bytes, subkey: Subkey, value: str, expiration: float, owner: bytes, signature: bytes,
              issued_us: int | None = None) -> bool | None:
        """The remembered verdict on this entry, or None when checking it would cost a verification."""
        return self._known.get((key, subkey, value, expiration, owner, signature, issued_us))

    def __call__(self, key: bytes, subkey: Subkey, value: str, expiration: float, owner: bytes,
                 signature: bytes, issued_us: int | None = None) -> bool:
        memo = (key, subkey, value, expiration, owner, signature, issued_us)
        known = self._known.get(memo)
        if known is None:
            if len(self._known) >= self.capacity:
                self._known.clear()
            known = self._known[memo] = verify(key, subkey, value, expiration, owner, signature, issued_us)
        return known
