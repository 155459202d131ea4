"""The UDP transport under the DHT protocol: framing, message ids, timeouts, request and reply budgets.

Stock ``rpcudp`` lets a reply grow past a datagram (it is then dropped silently and the asker evicts the peer),
waits 5 s for every dead peer, and dies on a malformed datagram with an exception in a task. Here every request
fits under :data:`MAX_REQUEST_BYTES` (stores are chunked), every reply in one datagram, the RPC timeout is short,
at most ``max_concurrent_rpcs`` requests are in flight, and anything malformed or oversized is logged and dropped.
A datagram is a kind byte (:data:`REQUEST` or :data:`RESPONSE`), a 20-byte message id and a msgpack payload: a
request is ``[rpc name, [arguments]]``, served by the subclass's ``rpc_<name>`` method.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from hashlib import sha1
from typing import Any, Callable, NamedTuple

import msgpack
from rpcudp.protocol import RPCProtocol

from dmoe.dht.config import DHTConfig
from dmoe.dht.messages import MalformedRequest, canonical_ip, valid_port
from dmoe.dht.throttle import ThrottledWarnings

logger = logging.getLogger(__name__)

REQUEST, RESPONSE = b"\x00", b"\x01"
HEADER_BYTES = 21  # kind byte + 20-byte message id, as in rpcudp
#: Requests above this are refused by stock rpcudp peers too; ours are chunked below it.
MAX_REQUEST_BYTES = 8192
#: Largest UDP payload over IPv4; a reply must fit in it or it is never delivered.
MAX_DATAGRAM_BYTES = 65507
#: find_values replies stop adding records past this many bytes; the asker re-asks for the rest one by one.
REPLY_BUDGET_BYTES = MAX_DATAGRAM_BYTES - 8192


class MessageTooLarge(ValueError):
    """A message that cannot be sent in one datagram."""


def chunk_entries(entries: list[list[Any]], budget: int = MAX_REQUEST_BYTES - 200) -> list[list[list[Any]]]:
    """Splits entries into lists whose packed size stays under ``budget`` bytes (one request each)."""
    chunks: list[list[list[Any]]] = [[]]
    size = 0
    for entry in entries:
        entry_size = len(msgpack.packb(entry))
        if entry_size > budget:
            raise MessageTooLarge(f"record entry of {entry_size} bytes cannot fit in one request")
        if size + entry_size > budget and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += entry_size
    return chunks if chunks[-1] else []


def peer_address(address: tuple[Any, ...]) -> tuple[str, int]:
    """Whom a datagram sent to or received from ``address`` is exchanged with, to match a reply to its request: the
    IP in its canonical spelling (:func:`~dmoe.dht.messages.canonical_ip`; IPv6 flow info and scope dropped, an
    IPv4-mapped IPv6 address as its IPv4 address, one machine as :func:`~dmoe.endpoints.machine_of` counts it) and
    the port. The kernel names a reply's sender in its own spelling: a request sent to ``0:0:0:0:0:0:0:1`` (or
    ``::0001``, or ``2001:DB8::1``) was answered from ``::1`` and its reply dropped as misdirected."""
    host = str(address[0]).partition("%")[0]
    ip = canonical_ip(host) or host
    if ip.startswith("::ffff:") and "." in ip:
        ip = ip[len("::ffff:"):]
    return ip, address[1]


class PendingRequest(NamedTuple):
    """A request sent and not answered yet."""
    future: "asyncio.Future[tuple[bool, Any]]"  # resolves to (True, reply), or (False, None) at the timeout
    timeout: asyncio.TimerHandle
    address: tuple[str, int]  # where it went (:func:`peer_address`): a reply from elsewhere is ignored


class UDPTransport(RPCProtocol):
    """Sends requests and matches their replies, serves requests with ``rpc_<name>`` methods, and owns the
    background tasks of the node (:meth:`spawn`), all cancelled by :meth:`close_tasks`.

    rpc_names: the requests served; any other is dropped.
    """

    rpc_names: frozenset[str] = frozenset()

    def __init__(self, config: DHTConfig):
        super().__init__(wait_timeout=config.rpc_timeout)
        self.serves = not config.client_mode  # a client-mode node answers no request
        self._outstanding: dict[bytes, PendingRequest] = {}
        self._slots = asyncio.Semaphore(config.max_concurrent_rpcs)
        self._tasks: set[asyncio.Future] = set()  # strong references to fire-and-forget work
        self._drain_socket: socket.socket | None = None  # see drain()
        self.warnings = ThrottledWarnings(logger)  # about what peers send: a flood of garbage must not flood the log

    # ---- receiving ----------------------------------------------------------------------------------------
    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        """Handles one datagram; nothing a peer sends may raise out of here. An exception would reach asyncio's
        reader, which logs a traceback per datagram past the throttle, or :meth:`drain` inside :meth:`_timeout`,
        which then left its request unresolved and its slot taken for good."""
        try:
            self._receive(data, addr)
        except Exception:  # a bug handling one datagram must not take the node (or the request timing out) down
            self.warnings.warn("unhandled", addr[0], "failed to handle a datagram of %d bytes from %s", len(data),
                               addr, exc_info=True)

    def _receive(self, data: bytes, addr: tuple[str, int]) -> None:
        kind = data[:1]
        if len(data) < HEADER_BYTES + 1 or kind not in (REQUEST, RESPONSE):
            self.warnings.warn("malformed", addr[0], "dropping malformed datagram of %d bytes from %s", len(data),
                               addr)
            return
        if kind == REQUEST and not self.serves:
            logger.debug("not answering a request from %s: this node is in client mode", addr)
            return
        if kind == REQUEST and len(data) > HEADER_BYTES + MAX_REQUEST_BYTES:
            self.warnings.warn("oversized", addr[0], "dropping oversized request of %d bytes from %s", len(data),
                               addr)
            return
        msg_id = data[1:HEADER_BYTES]
        unawaited: Callable[[Any], None] | None = None
        if kind == RESPONSE:
            # a reply to no request of ours (or from another address than asked) is dropped before it is decoded:
            # replies are not capped as requests are, and a spoofed 64 KB one took 7 ms of the loop (review 89)
            pending = self._outstanding.get(msg_id)
            if pending is None:
                unawaited = self.unawaited_reply(msg_id, peer_address(addr), len(data))
                if unawaited is None:
                    logger.debug("ignoring late or unknown response from %s", addr)
                    return
            elif peer_address(addr) != pending.address:
                self.warnings.warn("misdirected", addr[0], "ignoring response from %s to a request sent to %s", addr,
                                   pending.address)
                return
        try:
            payload = msgpack.unpackb(data[HEADER_BYTES:])
        except Exception as error:  # msgpack raises many types on garbage; none may kill the node
            self.warnings.warn("undecodable", addr[0], "dropping undecodable datagram from %s: %r", addr, error)
            return
        if kind == REQUEST:
            self._handle_request(msg_id, payload, addr)
        elif unawaited is not None:
            unawaited(payload)
        else:
            self._accept_response(msg_id, payload, addr)

    def unawaited_reply(self, msg_id: bytes, address: tuple[str, int], size: int) -> Callable[[Any], None] | None:
        """What handles a reply of ``size`` bytes from ``address`` (:func:`peer_address`) whose message id is no
        outstanding request's: a request sent by :meth:`send_unawaited` whose message id the subclass can recognise
        (checked before the reply is decoded). None (this transport's answer): the reply is dropped."""
        return None

    def _accept_response(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        pending = self._outstanding.get(msg_id)
        if pending is None or peer_address(address) != pending.address:  # (checked before decoding: _receive)
            return
        pending.timeout.cancel()
        del self._outstanding[msg_id]
        if not pending.future.done():
            pending.future.set_result((True, data))

    def _handle_request(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        # (the name's type first: a list or a map is unhashable, and the membership test would raise)
        if not (isinstance(data, (list, tuple)) and len(data) == 2 and isinstance(data[0], str)
                and data[0] in self.rpc_names and isinstance(data[1], (list, tuple))):
            self.warnings.warn("malformed", address[0], "dropping malformed request from %s", address)
            return
        name, args = data
        try:
            response = getattr(self, f"rpc_{name}")(address, *args)
        except (MalformedRequest, TypeError, ValueError) as error:
            self.warnings.warn("malformed", address[0], "dropping malformed %s request from %s: %s", name, address,
                               error)
            return
        except Exception:  # a bug serving one request must not take the node down (nor flood the log)
            self.warnings.warn("failed", address[0], "failed to serve %s request from %s", name, address,
                               exc_info=True)
            return
        payload = msgpack.packb(response)
        if len(payload) + HEADER_BYTES > MAX_DATAGRAM_BYTES:  # records are capped, so this is a bug, not a peer
            logger.error("reply to %s from %s would be %d bytes, over one datagram", name, address, len(payload))
            payload = msgpack.packb({"error": "reply too large"})
        if self.transport is not None:
            self.transport.sendto(RESPONSE + msg_id + payload, address)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # asyncio hands out a socket wrapper without recvfrom; a duplicate descriptor reads the same socket
        sock = transport.get_extra_info("socket")
        self._drain_socket = socket.socket(sock.family, sock.type, fileno=os.dup(sock.fileno()))
        self._drain_socket.setblocking(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_drain_socket()
        super().connection_lost(exc)

    def _close_drain_socket(self) -> None:
        if self._drain_socket is not None:
            self._drain_socket.close()
            self._drain_socket = None

    def drain(self) -> int:
        """Reads every datagram already waiting in the socket; returns how many.

        asyncio reads one datagram per loop iteration but fires every due timer in that iteration, so when the loop
        lags (a process whose other threads hold the GIL) replies that arrived in time sat unread while their
        timeouts fired: every replica of a record looked dead and a read came back empty. Timeouts and lateness
        are judged after draining."""
        sock = self._drain_socket
        count = 0
        while sock is not None and count < 4096:
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM_BYTES + 64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:  # e.g. an ICMP error queued on the socket; asyncio would report the same
                self.error_received(error)
                break
            count += 1
            self.datagram_received(data, addr)
        return count

    def _timeout(self, msg_id: bytes) -> None:
        try:
            if msg_id in self._outstanding:
                self.drain()  # its reply may be waiting unread
        finally:  # whatever drain met, the request ends here: else its future and its slot were never given back
            pending = self._outstanding.pop(msg_id, None)
            if pending is not None and not pending.future.done():
                pending.future.set_result((False, None))

    # ---- sending ------------------------------------------------------------------------------------------
    def _call(self, address: tuple[str, int], name: str, *args: Any) -> "asyncio.Future[tuple[bool, Any]]":
        """Sends one request; the future resolves to ``(True, reply)`` or ``(False, None)`` after the timeout."""
        payload = msgpack.packb([name, list(args)])
        if len(payload) > MAX_REQUEST_BYTES:
            raise MessageTooLarge(f"{name} request of {len(payload)} bytes exceeds {MAX_REQUEST_BYTES}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        msg_id = sha1(os.urandom(32)).digest()
        timeout = loop.call_later(self._wait_timeout, self._timeout, msg_id)
        self._outstanding[msg_id] = PendingRequest(future, timeout, peer_address(address))
        # only the port, which would close the socket: addresses from peers were checked whole when parsed
        if self.transport is None or not valid_port(address[1]):
            timeout.cancel()
            del self._outstanding[msg_id]
            future.set_result((False, None))
        else:
            self.transport.sendto(REQUEST + msg_id + payload, address)
        return future

    def send_unawaited(self, address: tuple[str, int], msg_id: bytes, name: str, *args: Any) -> None:
        """Sends a request under ``msg_id`` and keeps nothing: no future, no timeout, no slot. Its reply comes to
        :meth:`unawaited_reply`, which must recognise ``msg_id`` from the reply alone; for requests that many
        peers, some of them forged sources that never answer, may draw at once (review 101 D2)."""
        payload = msgpack.packb([name, list(args)])
        if len(payload) > MAX_REQUEST_BYTES:
            raise MessageTooLarge(f"{name} request of {len(payload)} bytes exceeds {MAX_REQUEST_BYTES}")
        if self.transport is not None and valid_port(address[1]):
            self.transport.sendto(REQUEST + msg_id + payload, address)

    async def request(self, address: tuple[str, int], name: str, *args: Any,
                      on_sent: Callable[[], None] | None = None) -> tuple[bool, Any]:
        """One request, waiting for a free slot first (at most ``max_concurrent_rpcs`` in flight)."""
        async with self._slots:
            if on_sent is not None:
                on_sent()
            return await self._call(address, name, *args)

    # ---- background work ----------------------------------------------------------------------------------
    def spawn(self, coro: Any) -> None:
        """Runs ``coro`` in the background, owned by this transport (cancelled by :meth:`close_tasks`)."""
        self.adopt(asyncio.ensure_future(coro))

    def adopt(self, task: "asyncio.Future[Any]") -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close_tasks(self) -> None:
        """Cancels the background tasks and fails every request still waiting for its reply."""
        self._close_drain_socket()  # also here: the loop may stop before the transport reports its loss
        for task in list(self._tasks):
            task.cancel()
        for pending in list(self._outstanding.values()):
            pending.timeout.cancel()
            if not pending.future.done():
                pending.future.set_result((False, None))
        self._outstanding.clear()
