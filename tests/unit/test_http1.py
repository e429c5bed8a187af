"""The blocking engine calls' HTTP/1.1 reader (``asyncrl.engine.http1``): every framing an engine answers with,
cut at every byte; what is not HTTP is an error that says what it saw."""

from __future__ import annotations

import pytest

from asyncrl.engine.http1 import MAX_BODY, BadResponse, ConnectionClosed, ResponseParser, request_bytes


def _parse_split(raw: bytes, *, step: int, close: bool = False, **kw):
    p = ResponseParser(**kw)
    for i in range(0, len(raw), step):
        out = p.feed(raw[i : i + step])
        if out is not None:
            assert i + step >= len(raw), "answered before the last byte arrived"
            return out
    return p.eof() if close else None


LENGTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 16\r\n\r\n{"success": true}'[:-1]
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("step", [1, 2, 5, 64, 4096])
def test_every_framing_read_whole_at_any_cut(step):
    r = _parse_split(LENGTH, step=step)
    assert (r.status, r.body, r.will_close, r.headers["content-type"]) == (
        200,
        b'{"success": true',
        False,
        "application/json",
    )
    r = _parse_split(CHUNKED, step=step)
    assert (r.status, r.body, r.will_close) == (200, b"hello world", False)
    r = _parse_split(CONTINUE, step=step)
    assert (r.status, r.reason, r.body) == (201, "Created", b"ok")
    to_close = b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nuntil the end"
    assert _parse_split(to_close, step=step) is None  # no length: only the close ends it
    r = _parse_split(to_close, step=step, close=True)
    assert (r.body, r.will_close) == (b"until the end", True)


def test_close_and_keep_alive_and_bodiless_answers():
    r = ResponseParser().feed(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbad")
    assert (r.status, r.body, r.will_close) == (400, b"bad", True)
    r = ResponseParser().feed(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n")
    assert (r.body, r.will_close) == (b"", False)
    assert ResponseParser().feed(b"HTTP/1.1 204 No Content\r\n\r\n").body == b""
    assert ResponseParser(head_request=True).feed(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n").body == b""
    r = ResponseParser().feed(b"HTTP/1.1 200 OK\r\nSet-Cookie: a\r\nSet-Cookie: b\r\nContent-Length: 0\r\n\r\n")
    assert r.headers["set-cookie"] == "a, b"


def test_a_close_before_the_whole_answer_says_whether_anything_came():
    with pytest.raises(ConnectionClosed) as ei:
        ResponseParser().eof()
    assert not ei.value.got_bytes
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc") is None
    with pytest.raises(ConnectionClosed) as ei:
        p.eof()
    assert ei.value.got_bytes


@pytest.mark.parametrize(
    "raw, what",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 OK 200\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "Content-Length 'ten'"),
        (f"HTTP/1.1 200 OK\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode(), "out of range"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    ],
)
def test_what_is_not_http_is_named(raw, what):
    with pytest.raises(BadResponse, match=what):
        ResponseParser().feed(raw)


def test_request_bytes():
    raw = request_bytes("POST", "/pause_generation", b"{}", {"Content-Type": "application/json"}, host="h:1")
    assert raw == (
        b"POST /pause_generation HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert request_bytes("GET", "/metrics", None, {}, host="h") == b"GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n"


@pytest.mark.parametrize("first", [LENGTH, CHUNKED, b"HTTP/1.1 204 No Content\r\n\r\n"])
def test_the_bytes_past_an_answer_are_kept_for_the_next_one(first):
    """Two pipelined answers in one read: the first is returned, the second's bytes are ``rest``, whole."""
    second = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    p = ResponseParser()
    assert p.feed(first + second[:7]) is not None
    assert p.rest == second[:7]
    q = ResponseParser()
    assert q.feed(p.rest) is None
    r = q.feed(second[7:])
    assert (r.status, r.body, q.rest) == (200, b"ok", b"")
