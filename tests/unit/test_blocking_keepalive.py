"""The blocking engine calls keep their connections alive, and survive an engine that closed an idle one."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest

from asyncrl.engine import blocking
from asyncrl.engine.blocking import Call, EngineStepError, Exchange, post_json


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that went away (the exchange raised before reading a slow answer) is not a failure here


class _Server:
    """A keep-alive HTTP/1.1 server counting the TCP connections it accepted; ``close_after_reply`` makes it
    drop each connection after answering, without saying so (as an engine whose idle timeout passed)."""

    def __init__(
        self,
        *,
        close_after_reply: bool = False,
        status: int = 200,
        gate: threading.Event | None = None,
        chunked: bool = False,
    ):
        outer = self
        self.connections = 0
        self.paths: list[str] = []
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with outer.lock:
                    outer.connections += 1

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with outer.lock:
                    outer.paths.append(self.path)
                if gate is not None:
                    gate.wait(30)
                body = json.dumps({"success": status < 400, "message": self.path}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if chunked:  # as uvicorn streams: two chunks, then the last one
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    half = len(body) // 2
                    for part in (body[:half], body[half:], b""):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                else:
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                self.wfile.flush()
                if close_after_reply:
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def _empty_pool():
    blocking._pool.clear()
    yield
    blocking._pool.clear()


def test_calls_reuse_one_connection():
    with _Server() as s:
        for _ in range(5):
            assert post_json(s.url, "/continue_generation", {}, timeout_s=10, step="continue")["success"] is True
        assert s.connections == 1


def test_a_chunked_answer_is_read_whole_and_its_connection_reused():
    with _Server(chunked=True) as s:
        for _ in range(3):
            assert post_json(s.url, "/update_weight_version", {}, timeout_s=10, step="v")["message"] == (
                "/update_weight_version"
            )
        assert s.connections == 1


def test_a_connection_the_engine_closed_is_replaced_not_failed():
    with _Server(close_after_reply=True) as s:
        for _ in range(3):
            assert post_json(s.url, "/flush_cache", {}, timeout_s=10, step="flush_cache")["success"] is True
        assert s.connections == 3


def test_http_error_names_engine_and_step_and_keeps_the_connection():
    with _Server(status=400) as s:
        for _ in range(2):
            with pytest.raises(EngineStepError) as ei:
                post_json(s.url, "/pause_generation", {"mode": "retract"}, timeout_s=10, step="pause_generation")
            assert ei.value.urls == [s.url] and ei.value.step == "pause_generation" and "HTTP 400" in str(ei.value)
        assert s.connections == 1


def test_refused_is_unreachable():
    with _Server() as s:
        url = s.url
    with pytest.raises(EngineStepError, match="unreachable"):
        post_json(url, "/continue_generation", {}, timeout_s=5, step="continue")


def test_exchange_runs_each_chain_in_order_and_the_chains_side_by_side():
    """Two engines, two calls each, from this one thread: answers in chain and call order, an engine's second
    call only after its first answered, one kept-alive connection per engine across exchanges."""
    with _Server() as a, _Server() as b:
        for _ in range(2):
            chains = [
                (s.url, [Call("/pause_generation", {}, "pause"), Call("/begin_weight_update", {}, "begin")])
                for s in (a, b)
            ]
            answers = Exchange(chains, timeout_s=10).run()
            assert [[x["message"] for x in ans] for ans in answers] == [
                ["/pause_generation", "/begin_weight_update"]
            ] * 2
        assert a.paths == b.paths == ["/pause_generation", "/begin_weight_update"] * 2
        assert a.connections == b.connections == 1


def test_exchange_raises_the_first_failure_without_waiting_for_a_slow_engine():
    gate = threading.Event()
    try:
        with _Server(gate=gate) as slow, _Server(status=400) as bad:
            ex = Exchange(
                [
                    (slow.url, [Call("/end_weight_update", {}, "end")]),
                    (bad.url, [Call("/end_weight_update", {}, "end")]),
                ],
                timeout_s=30,
            )
            with pytest.raises(EngineStepError) as ei:
                ex.run()
            assert ei.value.urls == [bad.url] and ei.value.step == "end" and "HTTP 400" in str(ei.value)
            assert not gate.is_set()  # the slow engine had not answered
    finally:
        gate.set()


def test_exchange_names_the_engines_past_its_deadline_and_polls_while_waiting():
    gate = threading.Event()
    polls = []
    try:
        with _Server(gate=gate) as slow, _Server() as fast:
            ex = Exchange(
                [
                    (slow.url, [Call("/continue_generation", {}, "continue")]),
                    (fast.url, [Call("/continue_generation", {}, "continue")]),
                ],
                timeout_s=2.0,  # the fast engine answers within it on a loaded host too
            )
            with pytest.raises(EngineStepError) as ei:
                ex.start().wait(poll=lambda: polls.append(1))
            assert ei.value.urls == [slow.url] and "no answer within 2 s" in str(ei.value) and polls
    finally:
        gate.set()


def test_exchange_replaces_a_connection_the_engine_closed():
    with _Server(close_after_reply=True) as s:
        for _ in range(3):
            assert (
                Exchange([(s.url, [Call("/flush_cache", {}, "flush_cache")])], timeout_s=10).run()[0][0]["success"]
                is True
            )
        assert s.connections == 3


def _raw_server(n_requests: int, answers: bytes):
    """A bare TCP server for one connection: it reads until ``n_requests`` whole requests came, BEFORE it answers
    anything (so they must have been written without waiting for an answer), then sends ``answers`` in one write."""
    srv = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            buf = b""
            while buf.count(b"\r\n\r\n") < n_requests or not buf.endswith(b"{}"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
            seen.append(buf)
            conn.sendall(answers)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t, seen, f"http://127.0.0.1:{srv.getsockname()[1]}"


def _ok(message: str) -> bytes:
    body = json.dumps({"success": True, "message": message}).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_a_pipelined_call_is_written_before_the_answer_and_both_answers_read_from_one_read():
    srv, t, seen, url = _raw_server(2, _ok("pause") + _ok("begin"))
    with srv:
        calls = [Call("/pause_generation", {}, "pause"), Call("/begin_weight_update", {}, "begin", pipelined=True)]
        answers = Exchange([(url, calls)], timeout_s=10).run()
        t.join(10)
    assert [a["message"] for a in answers[0]] == ["pause", "begin"]
    assert seen[0].index(b"POST /pause_generation") < seen[0].index(b"POST /begin_weight_update")


def test_pipelined_calls_run_in_order_on_one_connection_then_the_chain_goes_on():
    with _Server() as s:
        for _ in range(2):
            calls = [
                Call("/update_weights_from_distributed", {}, "update"),
                Call("/end_weight_update", {}, "end", pipelined=True),
                Call("/continue_generation", {}, "continue"),
            ]
            answers = Exchange([(s.url, calls)], timeout_s=10).run()
            assert [a["message"] for a in answers[0]] == [c.path for c in calls]
        assert s.paths == [c.path for c in calls] * 2
        assert s.connections == 1  # the pipelined pair's connection went back to the pool once both were answered


def test_a_pipelined_call_lost_to_a_close_is_sent_again_on_a_new_connection():
    """The engine answers the first call and drops the connection without reading the one behind it."""
    with _Server(close_after_reply=True) as s:
        calls = [Call("/pause_generation", {}, "pause"), Call("/begin_weight_update", {}, "begin", pipelined=True)]
        answers = Exchange([(s.url, calls)], timeout_s=10).run()
        assert [a["message"] for a in answers[0]] == ["/pause_generation", "/begin_weight_update"]
        assert s.paths == ["/pause_generation", "/begin_weight_update"] and s.connections == 2


def test_a_failed_call_with_one_pipelined_behind_it_raises_and_its_connection_is_not_reused():
    with _Server(status=400) as s:
        calls = [
            Call("/update_weights_from_distributed", {}, "update"),
            Call("/end_weight_update", {}, "end", pipelined=True),
        ]
        with pytest.raises(EngineStepError) as ei:
            Exchange([(s.url, calls)], timeout_s=10).run()
        assert ei.value.step == "update" and "HTTP 400" in str(ei.value)
        with pytest.raises(EngineStepError):  # a fresh connection: the one with end's answer due was closed
            post_json(s.url, "/continue_generation", {}, timeout_s=10, step="continue")
        assert s.connections == 2
