"""dmoe.httpd's limits, over real sockets on loopback: a client trickling its headers is closed at the deadline, and
one client's connections cannot lock another client out (127.0.0.2 is loopback too on Linux: another machine to
the per-client count)."""
from __future__ import annotations

import contextlib
import http.client
import socket
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from dmoe.httpd import BoundedHTTPServer, HTTPLimits, HTTPThread, QuietHandler


class Hello(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_body(b"hello", "text/plain")


@contextlib.contextmanager
def serving(limits: HTTPLimits) -> Iterator[tuple[str, int]]:
    http_thread = HTTPThread(BoundedHTTPServer("127.0.0.1", 0, Hello, limits), "test-http").start()
    try:
        yield "127.0.0.1", http_thread.port
    finally:
        http_thread.close()


def read_to_end(connection: socket.socket, timeout: float = 10.0) -> bytes:
    connection.settimeout(timeout)
    data = b""
    while chunk := connection.recv(4096):
        data += chunk
    return data


def get_from(source: str, host: str, port: int) -> tuple[int, bytes]:
    client = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    try:
        client.request("GET", "/")
        response = client.getresponse()
        return response.status, response.read()
    finally:
        client.close()


def test_a_client_trickling_its_headers_is_closed_at_the_header_deadline():
    """A byte every 0.2 s never leaves the connection idle for idle_timeout (30 s): the per-read timeout alone kept
    such a connection, and its slot, for as long as the client trickled."""
    with serving(HTTPLimits(idle_timeout=30.0, header_timeout=1.0)) as (host, port), \
            socket.create_connection((host, port), timeout=10) as trickler:
        trickler.sendall(b"GET / HTTP/1.0\r\n")
        trickler.settimeout(0.2)
        started, closed = time.monotonic(), False
        while not closed and time.monotonic() - started < 20:
            try:
                trickler.sendall(b"X")
                closed = trickler.recv(1) == b""
            except socket.timeout:
                continue
            except OSError:  # reset: closed as well
                closed = True
        assert closed, "a connection trickling its headers was still open after 20 s"
        assert get_from("127.0.0.1", host, port) == (200, b"hello")  # its slot is free again


def test_one_client_s_connections_leave_slots_for_others_and_refusals_are_answered_503():
    """One client opening every connection the server serves used to lock everybody out (each refused connection
    closed without a word) for as long as it kept them open."""
    limits = HTTPLimits(max_connections=4, max_per_client=2, idle_timeout=30.0, header_timeout=30.0)
    with serving(limits) as (host, port), contextlib.ExitStack() as stack:
        held = []
        for _ in range(4):  # half a request each, from one machine
            connection = stack.enter_context(socket.create_connection((host, port), timeout=10))
            connection.sendall(b"GET / HTTP/1.0\r\n")
            held.append(connection)
        refused = [read_to_end(connection) for connection in held[2:]]
        assert all(answer.startswith(b"HTTP/1.0 503 ") for answer in refused), refused
        with pytest.raises(urllib.error.HTTPError) as same_client:
            urllib.request.urlopen(f"http://{host}:{port}/", timeout=10)
        assert same_client.value.code == 503
        assert get_from("127.0.0.2", host, port) == (200, b"hello")  # another machine: served
        for connection in held[:2]:  # the first two are still being served (waiting for their headers)
            connection.setblocking(False)
            with pytest.raises(BlockingIOError):
                connection.recv(1)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_per_client"):
        HTTPLimits(max_per_client=0)
    with pytest.raises(ValueError, match="header_timeout"):
        HTTPLimits(header_timeout=float("inf"))


def test_a_page_asked_for_over_and_over_costs_at_most_its_share_of_the_time():
    """One client asking again as soon as it has the page, as a tight scraping loop does: the renders (here 0.1 s
    each) take at most a fifth of the time, each one still begun after the request it answers."""
    from dmoe.httpd import ThrottledPage

    rendered: list[float] = []

    def render() -> bytes:
        rendered.append(time.monotonic())
        time.sleep(0.1)
        return str(len(rendered)).encode()

    page = ThrottledPage(render, share=0.2)
    started = time.monotonic()
    assert [page.get() for _ in range(4)] == [b"1", b"2", b"3", b"4"]
    # 4 renders of 0.1 s with 0.4 s after each of the first 3 (a sleep lasts at least its time, however loaded)
    assert time.monotonic() - started >= 4 * 0.1 + 3 * 0.4
    assert all(later - earlier >= 0.5 for earlier, later in zip(rendered, rendered[1:]))
    with pytest.raises(ValueError, match="share"):
        ThrottledPage(render, share=0)


def test_clients_that_reset_their_connection_write_nothing_to_stderr(capfd):
    """socketserver printed a 31-line traceback to stderr for each reset connection, whatever the log level: a
    Prometheus scrape that timed out, or anyone on purpose, flooded a server's stderr (review 91)."""
    import struct

    from dmoe.server.metrics import ServerMetrics

    metrics = ServerMetrics({})
    port = int(metrics.serve("127.0.0.1", 0).rsplit(":", 1)[1])
    try:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port)) as client:
                client.sendall(b"GET / HTTP/1.0\r\n")  # reset before its headers ended
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200  # served after them (each reset connection's thread has ended by now)
    finally:
        metrics.close()
    assert "Traceback" not in capfd.readouterr().err
