"""A minimal HTTP/1.1 client connection for the blocking engine calls (``engine.blocking``): requests on a kept-alive
socket, each answer read by a pure incremental parser. Requests may be pipelined (written before the previous one
is answered): the server answers them in order, and the bytes that came past one answer are kept for the next read.

    conn = Connection("http", "127.0.0.1", 30000, timeout_s=10)
    conn.send(request_bytes("POST", "/pause_generation", b'{"mode": "retract"}', {"Content-Type": "application/json"}))
    resp = conn.read(timeout_s=10)      # Response(status, reason, headers, body, will_close)

Why not ``http.client``: a weight sync makes five calls in a row per engine on its critical path, and the standard
client's request assembly and header parsing (the ``email`` package) cost 130-150 us a call more than this one on
2 cores (a ``/begin_weight_update`` round trip to a CPU engine: 250-277 us against 119-127 us, measured
2026-12-05). Everything the engines answer is covered: ``Content-Length`` bodies, chunked bodies (trailers
skipped), bodies ended by the close, ``1xx`` interim answers skipped, ``Connection: close`` and HTTP/1.0.

Errors: ``ConnectionClosed`` (the peer closed before a whole answer: a kept-alive connection the server had
dropped is retried by the caller when no byte came back), ``BadResponse`` (not HTTP, or over the size limits),
``TimeoutError`` (the deadline passed), and the socket's own ``OSError``s.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Optional

MAX_HEAD = 64 << 10
"""Largest status line + headers accepted."""
MAX_BODY = 64 << 20
"""Largest body accepted (an engine's answers are JSON documents and a metrics page)."""


class ConnectionClosed(ConnectionError):
    """The server closed the connection before a whole answer; ``got_bytes`` says whether any part of it came."""

    def __init__(self, message: str, *, got_bytes: bool):
        super().__init__(message)
        self.got_bytes = got_bytes


class BadResponse(Exception):
    """What came back is not an HTTP/1.x answer this client reads (or exceeds ``MAX_HEAD`` / ``MAX_BODY``)."""


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    """Names lower-cased; a repeated header's values joined with ", "."""
    body: bytes
    will_close: bool
    """The server closes the connection after this answer (do not reuse it)."""


def request_bytes(method: str, target: str, body: Optional[bytes], headers: dict[str, str], *, host: str) -> bytes:
    """One request, ready to write: ``Host``, ``Content-Length`` (with a body) and ``headers`` added."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


class ResponseParser:
    """Incremental reader of one answer: ``feed(bytes)`` until it returns the ``Response``; ``eof()`` when the
    connection closed (completes a body that ends with the close, else raises ``ConnectionClosed``). ``rest``: the
    bytes fed past the end of the answer (the start of a pipelined request's answer)."""

    def __init__(self, *, head_request: bool = False):
        self._buf = bytearray()
        self._head_request = head_request
        self._status: Optional[tuple[int, str, dict[str, str], bool]] = None
        self._length: Optional[int] = None  # body length; None with chunked or read-to-close bodies
        self._chunked = False
        self._chunks: list[bytes] = []
        self._chunked_bytes = 0
        self._got_bytes = False
        self.rest = b""

    def feed(self, data: bytes) -> Optional[Response]:
        if data:
            self._got_bytes = True
        self._buf += data
        while self._status is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise BadResponse(f"no end of headers within {MAX_HEAD} bytes")
                return None
            head, self._buf = bytes(self._buf[:end]), self._buf[end + 4 :]
            if not self._head(head):  # a 1xx interim answer: the real one follows
                continue
        if self._chunked:
            return self._chunked_body()
        if self._length is not None:
            if len(self._buf) < self._length:
                return None
            return self._done(bytes(self._buf[: self._length]), self._length)
        if len(self._buf) > MAX_BODY:
            raise BadResponse(f"body over {MAX_BODY} bytes")
        return None  # read to close

    def eof(self) -> Response:
        if self._status is not None and not self._chunked and self._length is None:
            return self._done(bytes(self._buf), len(self._buf))
        raise ConnectionClosed("the server closed the connection before a whole answer", got_bytes=self._got_bytes)

    def _head(self, head: bytes) -> bool:
        """Parse a status line and headers; False for a 1xx interim answer (skipped)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadResponse(f"malformed header line {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        conn = headers.get("connection", "").lower()
        will_close = "close" in conn or (parts[0] == "HTTP/1.0" and "keep-alive" not in conn)
        if self._head_request or status in (204, 304):
            self._length = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in headers:
            try:
                self._length = int(headers["content-length"])
            except ValueError:
                raise BadResponse(f"Content-Length {headers['content-length'][:40]!r} is not a number") from None
            if not 0 <= self._length <= MAX_BODY:
                raise BadResponse(f"Content-Length {self._length} is out of range (at most {MAX_BODY})")
        else:
            will_close = True  # the body ends with the connection
        self._status = (status, parts[2] if len(parts) > 2 else "", headers, will_close)
        return True

    def _chunked_body(self) -> Optional[Response]:
        while True:
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                return None
            size_text = bytes(self._buf[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise BadResponse(f"bad chunk size {size_text[:40]!r}") from None
            if size == 0:  # the last chunk, then trailers up to an empty line
                end = self._buf.find(b"\r\n\r\n", line_end)
                if end < 0:
                    return None
                return self._done(b"".join(self._chunks), end + 4)
            if len(self._buf) < line_end + 2 + size + 2:
                return None
            self._chunks.append(bytes(self._buf[line_end + 2 : line_end + 2 + size]))
            self._chunked_bytes += size
            if self._chunked_bytes > MAX_BODY:
                raise BadResponse(f"body over {MAX_BODY} bytes")
            del self._buf[: line_end + 2 + size + 2]

    def _done(self, body: bytes, consumed: int) -> Response:
        """The answer, its head parsed and ``body`` read; the first ``consumed`` bytes of the buffer were its body."""
        self.rest = bytes(self._buf[consumed:])
        status, reason, headers, will_close = self._status
        return Response(status, reason, headers, body, will_close)


class Connection:
    """One kept-alive connection to ``host:port`` (TLS for ``https``), opened at once; every wait bounded."""

    def __init__(self, scheme: str, host: str, port: int, *, timeout_s: float):
        self.host_header = host if port == (443 if scheme == "https" else 80) else f"{host}:{port}"
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        self.sock: Optional[socket.socket] = sock
        self._rest = b""
        """Bytes received past the last answer read: the start of the next (pipelined) answer."""

    @property
    def buffered(self) -> bool:
        """Bytes of the next answer already came (with the last one): read it without waiting for the socket."""
        return bool(self._rest)

    def send(self, data: bytes, *, timeout_s: float) -> None:
        if self.sock is None:
            raise ConnectionClosed("the connection is closed", got_bytes=False)
        self.sock.settimeout(timeout_s)
        self.sock.sendall(data)

    def read(self, *, timeout_s: float, head_request: bool = False) -> Response:
        """The answer to the oldest request not yet answered, within ``timeout_s``; closes the connection if the
        server will."""
        if self.sock is None:
            raise ConnectionClosed("the connection is closed", got_bytes=False)
        parser = ResponseParser(head_request=head_request)
        resp, self._rest = (parser.feed(self._rest) if self._rest else None), b""
        deadline = time.monotonic() + timeout_s
        while resp is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole answer within {timeout_s:g} s")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 16)
            resp = parser.feed(data) if data else parser.eof()
        self._rest = parser.rest
        if resp.will_close:
            self.close()
        return resp

    def close(self) -> None:
        self._rest = b""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
