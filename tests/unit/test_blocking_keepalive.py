"""The blocking engine calls keep their connections alive, and survive an engine that closed an idle one."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from asyncrl.engine import blocking
from asyncrl.engine.blocking import EngineStepError, post_json


class _Server:
    """A keep-alive HTTP/1.1 server counting the TCP connections it accepted; ``close_after_reply`` makes it
    drop each connection after answering, without saying so (as an engine whose idle timeout passed)."""

    def __init__(self, *, close_after_reply: bool = False, status: int = 200):
        outer = self
        self.connections = 0
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with outer.lock:
                    outer.connections += 1

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                body = json.dumps({"success": status < 400, "message": "ok"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if close_after_reply:
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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
