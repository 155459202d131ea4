"""Small HTTP servers (an expert server's ``/metrics``, the monitor's page) that clients cannot use to pile up
threads, nor to lock other clients out.

``http.server``'s threading server starts a thread per connection and keeps it for as long as the client keeps the
connection open; a client that connects and never finishes its request (or trickles a byte now and then) holds one
forever. On a public host (``--host 0.0.0.0`` makes ``/metrics`` public by default) anyone could grow a server's
thread count until the process could start no more threads, gRPC's and torch's included. Here (:class:`HTTPLimits`):

- at most ``max_connections`` connections are served at once, and at most ``max_per_client`` of one client machine
  (an IPv4 address, an IPv6 /64, as :func:`dmoe.endpoints.machine_of` counts them): one client opening many could
  otherwise take every slot, and every other client was turned away;
- a connection must send its request line and headers within ``header_timeout`` seconds of its acceptance: a
  per-read timeout alone was reset by every byte, so a client trickling a byte every 10 s kept its slot for good;
- a connection is closed after ``idle_timeout`` seconds without a byte;
- a connection beyond those limits is answered ``503 Service Unavailable`` and closed at once (counted in
  :attr:`BoundedHTTPServer.refused`), not closed silently.
"""
from __future__ import annotations

import dataclasses
import io
import ipaddress
import logging
import math
import socket
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from dmoe.endpoints import bare_host, machine_of

logger = logging.getLogger(__name__)

#: connections served at once by default (each holds a thread while it lasts)
MAX_CONNECTIONS = 32
#: connections of one client machine served at once by default
MAX_PER_CLIENT = 8
#: seconds a connection may send nothing before it is closed
IDLE_TIMEOUT = 30.0
#: seconds from a connection's acceptance to the end of its request's headers
HEADER_TIMEOUT = 10.0
#: reads of 64 KiB at most of what a refused connection sent, before it is closed (review 69)
REFUSAL_READS = 4
#: the share of its time a process spends rendering a page at most, however often it is asked for
#: (:class:`ThrottledPage`): after a render of d seconds, the next starts d * (1 / share - 1) seconds later at the
#: soonest (4 d)
RENDER_SHARE = 0.2
#: seconds between the end of one render of a page and the start of the next, at least (:class:`ThrottledPage`)
RENDER_INTERVAL = 0.0


@dataclasses.dataclass(frozen=True)
class HTTPLimits:
    """What one client, and all together, may hold of a :class:`BoundedHTTPServer` (see the module's docstring)."""

    max_connections: int = MAX_CONNECTIONS
    max_per_client: int = MAX_PER_CLIENT
    idle_timeout: float = IDLE_TIMEOUT
    header_timeout: float = HEADER_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout", "header_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")


def client_machine(host: str) -> str:
    """The machine a client's address stands for (per-client limits key on it: one machine may use any address of
    its IPv6 /64); the host itself when it is no IP address."""
    try:
        return machine_of(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        return host


def _refusal(reason: str) -> bytes:
    body = f"{reason}; try again later\n".encode()
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
    return head + body


class BoundedHTTPServer(ThreadingHTTPServer):
    """A :class:`ThreadingHTTPServer` (IPv6 for a host with a colon) serving connections on daemon threads within
    ``limits``. Give it a handler derived from :class:`QuietHandler`, which applies the limits' timeouts."""

    daemon_threads = True
    block_on_close = False  # threads are not kept in a list to join: they end with their connection or the process

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], limits: HTTPLimits | None = None):
        host = bare_host(host)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.limits = limits or HTTPLimits()
        self.refused = 0  # connections answered 503 and closed at once: every slot, or the client's, taken
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()  # client machine -> connections served now
        super().__init__((host, port), handler)

    @property
    def max_connections(self) -> int:
        return self.limits.max_connections

    def _take_slot(self, client: str) -> str | None:
        """Counts a connection of ``client`` as served; or the reason it may not be (nothing counted)."""
        with self._lock:
            if sum(self._open.values()) >= self.limits.max_connections:
                return f"{self.limits.max_connections} connections open, the most served at once"
            if self._open[client] >= self.limits.max_per_client:
                return f"{self.limits.max_per_client} connections open from this client, the most served at once"
            self._open[client] += 1
            return None

    def _release_slot(self, client: str) -> None:
        with self._lock:
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]

    def process_request(self, request: Any, client_address: Any) -> None:
        client = client_machine(client_address[0])
        reason = self._take_slot(client)
        if reason is not None:
            self._refuse(request, client, reason)
            return
        try:
            super().process_request(request, client_address)  # a thread runs process_request_thread
        except BaseException:
            self._release_slot(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release_slot(client_machine(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed: a client that went away (reset, broken pipe, a scrape that timed out) at DEBUG
        level, anything else as an error with its traceback, in the log. socketserver printed each to stderr, 31
        lines a reset whatever the log level (review 91)."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            logger.debug("connection from %s ended: %r", client_address, error)
        else:
            logger.error("failed serving a connection from %s", client_address, exc_info=True)

    def _refuse(self, request: socket.socket, client: str, reason: str) -> None:
        """Answers 503 without blocking the accepting thread (a fresh socket's send buffer takes it whole), then
        closes: a silent close told a client nothing, and looked like a crash."""
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            logger.warning("HTTP on port %d: %s; answering 503 to new ones (%d so far, latest from %s)",
                           self.server_address[1], reason, self.refused, client)
        try:
            request.setblocking(False)
            request.send(_refusal(reason))
            # what the client sent already (closing with it unread would reset), a request's worth at most: a client
            # sending on and on would otherwise hold the accepting thread, and every other client with it
            for _ in range(REFUSAL_READS):
                if not request.recv(65536):
                    break
        except OSError:
            pass
        self.shutdown_request(request)


class _DeadlineReader(io.RawIOBase):
    """A connection's socket read under two limits: ``idle`` seconds per read, and a total ``deadline``
    (``time.monotonic()``) for everything read, as a request's line and headers are (HTTP/1.0: one request per
    connection). A read past either raises TimeoutError, which ``http.server`` answers by closing the connection."""

    def __init__(self, sock: socket.socket, idle: float, deadline: float):
        super().__init__()
        self._sock, self._idle, self._deadline = sock, idle, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's headers took too long")
        self._sock.settimeout(min(self._idle, left))
        return self._sock.recv_into(buffer)


class QuietHandler(BaseHTTPRequestHandler):
    """A base request handler that applies its server's :class:`HTTPLimits` timeouts and logs requests at DEBUG
    level (``http.server`` writes each to stderr)."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        super().setup()
        limits = self.server.limits
        self.rfile.close()  # (the socket stays open: wfile and the server hold it)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, limits.idle_timeout,
                                                       time.monotonic() + limits.header_timeout))

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.connection.settimeout(self.server.limits.idle_timeout)  # writing the answer: its whole time bounded
        return parsed

    def send_body(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        # escaped as http.server escapes it: a request line may carry a terminal's control sequences (review 91)
        logger.debug("%s %s", self.address_string(), (format % args).translate(self._control_char_table))


class ThrottledPage:
    """A page that costs its process at most ``share`` of its time in renders, however many clients ask for it.

    Rendering a big page (a server's ``/metrics``: 178 ms for 64 experts) holds the GIL in the process it serves,
    so clients asking for it over and over, up to one per connection at once, stalled that process. Here one render
    runs at a time, and the next starts no sooner than ``interval`` seconds, nor than ``1 / share - 1`` times the
    previous render's duration, after the previous one ended (a small page is rendered again almost at once; one of
    178 ms, 0.7 s later). A request gets the first render that started after it arrived, so what it reads is never
    older than the request (a counter read before and after a call shows the call); requests arriving meanwhile
    wait and share that render. A client scraping more often waits instead of costing more renders.
    """

    def __init__(self, render: Callable[[], bytes], interval: float = RENDER_INTERVAL, share: float = RENDER_SHARE):
        if not (interval >= 0 and math.isfinite(interval)):
            raise ValueError(f"interval must be a finite number of seconds >= 0, got {interval}")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self._render, self.interval, self.share = render, interval, share
        self._cond = threading.Condition()
        self._body: bytes | None = None
        self._started = -math.inf  # when the render that gave _body started
        self._next = -math.inf  # when the next render may start
        self._rendering = False
        self.renders = 0

    def get(self) -> bytes:
        """The page as of this call or later; waits for a render in progress, or for the interval to pass."""
        arrived = time.monotonic()
        with self._cond:
            while True:
                if self._body is not None and self._started >= arrived:
                    return self._body
                if not self._rendering:
                    wait = self._next - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            self._rendering = True
        return self._render_now()

    def _render_now(self) -> bytes:
        started = time.monotonic()
        body: bytes | None = None
        try:
            body = self._render()
            return body
        finally:
            with self._cond:
                if body is not None:
                    self._body, self._started = body, started
                    self.renders += 1
                self._rendering = False
                ended = time.monotonic()
                self._next = ended + max(self.interval, (ended - started) * (1 / self.share - 1))
                self._cond.notify_all()


class HTTPThread:
    """Runs a :class:`BoundedHTTPServer` on a daemon thread it owns; ``close()`` stops it and frees the port."""

    def __init__(self, server: BoundedHTTPServer, name: str):
        self.server = server
        self._thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> "HTTPThread":
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
            self._thread.join(5)
        self.server.server_close()
