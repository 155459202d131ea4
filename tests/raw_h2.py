"""A bare HTTP/2 client for tests of what a gRPC library would never do: send calls on a connection that gives the
server no flow-control window (``window=0``), so the answers stay unsent in the server's memory. It answers SETTINGS
and PINGs as a live client does, so the server keeps the connection, keeps within the windows the server gives it,
and reads nothing else."""
from __future__ import annotations

import socket
import struct
import threading

DATA, HEADERS, SETTINGS, PING, WINDOW_UPDATE = 0, 1, 4, 6, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
SETTINGS_INITIAL_WINDOW_SIZE = 4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME = 16384  # the smallest SETTINGS_MAX_FRAME_SIZE, which every peer accepts
DEFAULT_WINDOW = 65535  # what HTTP/2 allows a sender before the peer's SETTINGS and WINDOW_UPDATEs say more


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding (names and values < 127)."""
    name_bytes, value_bytes = name.encode(), value.encode()
    return b"\x00" + bytes([len(name_bytes)]) + name_bytes + bytes([len(value_bytes)]) + value_bytes


class RawConnection:
    """One connection to ``endpoint`` (HOST:PORT) whose streams start with ``window`` bytes of flow-control window."""

    def __init__(self, endpoint: str, window: int = 0):
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.settimeout(None)  # (the connect's timeout would end the reader after 30 s of silence)
        self._lock = threading.Lock()
        self._windows = threading.Condition()
        self._connection_window, self._initial_window = DEFAULT_WINDOW, DEFAULT_WINDOW
        self._stream_windows: dict[int, int] = {}
        self._next_stream = 1
        self._send(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, window)))
        self._reader = threading.Thread(target=self._read, daemon=True, name="raw-h2-reader")
        self._reader.start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def _read(self) -> None:
        pending = b""
        try:
            while chunk := self.sock.recv(65536):
                pending += chunk
                while len(pending) >= 9 and len(pending) >= 9 + int.from_bytes(pending[:3], "big"):
                    length = int.from_bytes(pending[:3], "big")
                    kind, flags = pending[3], pending[4]
                    stream = int.from_bytes(pending[5:9], "big") & 0x7FFFFFFF
                    payload, pending = pending[9:9 + length], pending[9 + length:]
                    if kind == SETTINGS and not flags & ACK:
                        self._settings(payload)
                        self._send(frame(SETTINGS, ACK, 0))
                    elif kind == WINDOW_UPDATE:
                        self._window_update(stream, int.from_bytes(payload[:4], "big") & 0x7FFFFFFF)
                    elif kind == PING and not flags & ACK:
                        self._send(frame(PING, ACK, 0, payload))
        except OSError:
            pass

    def _settings(self, payload: bytes) -> None:
        with self._windows:
            for at in range(0, len(payload) - 5, 6):
                setting, value = struct.unpack(">HI", payload[at:at + 6])
                if setting == SETTINGS_INITIAL_WINDOW_SIZE:
                    for stream in self._stream_windows:
                        self._stream_windows[stream] += value - self._initial_window
                    self._initial_window = value
            self._windows.notify_all()

    def _window_update(self, stream: int, increment: int) -> None:
        with self._windows:
            if stream == 0:
                self._connection_window += increment
            elif stream in self._stream_windows:
                self._stream_windows[stream] += increment
            self._windows.notify_all()

    def call(self, path: str, message: bytes) -> int:
        """Sends one unary gRPC call of ``message`` (serialized) to ``path`` (waiting for the server's flow-control
        windows to take its bytes); returns its stream id."""
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        headers = b"".join(_literal(k, v) for k, v in [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
            ("content-type", "application/grpc"), ("te", "trailers")])
        with self._windows:
            self._stream_windows[stream] = self._initial_window
        self._send(frame(HEADERS, END_HEADERS, stream, headers))
        body = memoryview(b"\x00" + struct.pack(">I", len(message)) + message)
        while body:
            with self._windows:
                if not self._windows.wait_for(lambda: min(self._connection_window,
                                                          self._stream_windows[stream]) > 0, timeout=30):
                    raise TimeoutError("the server gave no flow-control window for 30 s")
                size = min(len(body), MAX_FRAME, self._connection_window, self._stream_windows[stream])
                self._connection_window -= size
                self._stream_windows[stream] -= size
            self._send(frame(DATA, END_STREAM if size == len(body) else 0, stream, bytes(body[:size])))
            body = body[size:]
        return stream

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=10)

    def __enter__(self) -> "RawConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
