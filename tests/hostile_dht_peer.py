"""A hostile DHT peer for tests: UDP sockets that speak the DHT protocol in raw datagrams, from a thread.

Modes (what it names in every find_node / find_value(s) reply):

- ``chain``: 20 never-seen ids, each closer to the key than any it named before, at its own sockets (round robin):
  a lookup that follows them never runs out of closer contacts.
- ``relay``: as ``chain``, but all at the socket after the one asked (the last one's at the first): a lookup can
  follow them only one socket per round.
- ``dead``: 20 never-seen ids at a socket of its own that never answers.
- ``sybil``: its own ids (``ids``, spread over its sockets), and for ``key`` the record ``record``; :meth:`ping`
  makes them its peers' contacts.

``delay`` holds every reply back that many seconds (a peer just fast enough not to time out).
"""
from __future__ import annotations

import heapq
import json
import os
import selectors
import socket
import threading
import time
from typing import Any, Sequence

import msgpack

from dmoe.dht.messages import VALUES_HEADER, encode_record
from dmoe.dht.storage import Record
from dmoe.dht.transport import HEADER_BYTES, REQUEST, RESPONSE

CONTACTS_PER_REPLY = 20


class HostilePeer(threading.Thread):
    def __init__(self, mode: str, *, host: str = "127.0.0.1", sockets: int = 1, ids: Sequence[bytes] = (),
                 key: bytes | None = None, record: Record | None = None, delay: float = 0.0):
        super().__init__(daemon=True)
        self.mode, self.delay, self.key = mode, delay, key
        self.sockets = []
        for _ in range(sockets):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((host, 0))
            sock.setblocking(False)
            self.sockets.append(sock)
        self.silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # dead mode: its contacts live here
        self.silent.bind((host, 0))
        self.ids = list(ids) or [os.urandom(20) for _ in self.sockets]
        self.record = encode_record(record or {})
        self.answered = 0  # requests answered
        self.replies = 0  # replies received (to its pings)
        self._closest: dict[bytes, int] = {}  # key -> XOR distance of the last contact named for it
        self._named = 0
        self._stopping = threading.Event()

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [sock.getsockname()[:2] for sock in self.sockets]

    def home(self, index: int) -> tuple[str, int]:
        return self.sockets[index % len(self.sockets)].getsockname()[:2]

    def ping(self, peers: Sequence[tuple[str, int]], count: int | None = None) -> None:
        """Introduces its ids (the first ``count``; each from its socket) to every peer, which takes them as
        contacts."""
        for peer in peers:
            for index, node_id in enumerate(self.ids[:count]):
                sock = self.sockets[index % len(self.sockets)]
                sock.sendto(REQUEST + os.urandom(20) + msgpack.packb(["ping", [node_id]]), tuple(peer))

    def contacts(self, key: bytes, asked: int) -> list[list[Any]]:
        """What it names for ``key`` when asked at its socket number ``asked``."""
        if self.mode == "sybil":
            return [[node_id.hex(), *self.home(index)] for index, node_id in enumerate(self.ids)]
        target = int.from_bytes(key, "big")
        distance = self._closest.get(key, 1 << 150)
        contacts = []
        for step in range(1, CONTACTS_PER_REPLY + 1):
            where = (self.silent.getsockname()[:2] if self.mode == "dead" else self.home(asked + 1)
                     if self.mode == "relay" else self.home(self._named))
            self._named += 1
            contacts.append([(target ^ (distance - step)).to_bytes(20, "big").hex(), *where])
        self._closest[key] = distance - CONTACTS_PER_REPLY - 1
        return contacts

    def value_reply(self, key: bytes, asked: int) -> tuple[str, bytes, str]:
        text, auth = self.record if key == self.key else ("[]", b"")
        return text, auth, json.dumps(self.contacts(key, asked), separators=(",", ":"))

    def answer(self, name: str, args: list, asked: int) -> Any:
        if name == "ping":
            return self.ids[asked % len(self.ids)]  # the (first) id at the socket asked
        if name == "store":
            return [True] * len(args[2])
        if name == "find_node":
            return [(bytes.fromhex(node_id), host, port) for node_id, host, port in self.contacts(args[1], asked)]
        if name == "find_value":
            text, auth, nodes = self.value_reply(args[1], asked)
            return {"record": text, "auth": auth, "nodes": nodes}
        if name == "find_values":
            parts = []
            for key in args[1]:
                text, auth, nodes = self.value_reply(key, asked)
                parts += [VALUES_HEADER.pack(len(text), len(auth), len(nodes)), text.encode(), auth, nodes.encode()]
            return b"".join(parts)
        return None

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        for sock in self.sockets:
            selector.register(sock, selectors.EVENT_READ)
        later: list[tuple[float, int, socket.socket, bytes, tuple]] = []  # replies held back (delay)
        count = 0
        while not self._stopping.is_set():
            timeout = 0.05 if not later else max(0.0, min(0.05, later[0][0] - time.monotonic()))
            for event, _ in selector.select(timeout):
                sock = event.fileobj
                try:
                    data, address = sock.recvfrom(65536)
                except OSError:
                    continue
                if data[:1] != REQUEST:
                    self.replies += data[:1] == RESPONSE
                    continue
                try:
                    name, args = msgpack.unpackb(data[HEADER_BYTES:])
                    reply = self.answer(name, args, self.sockets.index(sock))
                except Exception:  # noqa: BLE001 - whatever it was sent, the peer goes on
                    continue
                if reply is None:
                    continue
                self.answered += 1
                count += 1
                datagram = RESPONSE + data[1:HEADER_BYTES] + msgpack.packb(reply)
                heapq.heappush(later, (time.monotonic() + self.delay, count, sock, datagram, address))
            while later and later[0][0] <= time.monotonic():
                _, _, sock, datagram, address = heapq.heappop(later)
                sock.sendto(datagram, address)
        selector.close()

    def __enter__(self) -> "HostilePeer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self.join(5)
        for sock in self.sockets + [self.silent]:
            sock.close()
