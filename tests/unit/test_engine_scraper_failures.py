"""The engine scraper against a real HTTP server that stops answering and comes back: one warning per outage,
not one a scrape, and the recovery said (``asyncrl.trainer.engine_scraper``)."""

from __future__ import annotations

import http.server
import logging
import threading

from asyncrl.cpu_engine.metrics import prometheus_text
from asyncrl.trainer.engine_scraper import EngineScraper


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = prometheus_text({"num_running_reqs": 3, "num_queue_reqs": 0}, model_name="m").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


def _serve(port: int = 0) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _stop(srv: http.server.ThreadingHTTPServer) -> None:
    srv.shutdown()
    srv.server_close()


def test_an_engine_that_stops_answering_is_warned_about_once_per_outage(caplog):
    srv = _serve()
    port = srv.server_address[1]
    url = f"http://127.0.0.1:{port}"
    scraper = EngineScraper([url], interval_s=3600, timeout_s=2.0)
    scraper.close()  # the test drives the scrapes
    caplog.set_level(logging.DEBUG, logger="asyncrl.trainer")
    try:
        assert scraper.scrape()["engine/0/num_running_reqs"] == 3.0
        _stop(srv)  # the engine is gone (connection refused)
        for _ in range(3):
            assert "engine/0/num_running_reqs" not in scraper.scrape()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "/metrics scrape failed" in warnings[0].getMessage() and url in warnings[0].getMessage()
        assert "engine step 'metrics' failed" in warnings[0].getMessage()  # not called a weight-sync step
        assert sum("failed again" in r.getMessage() for r in caplog.records) == 2
        srv = _serve(port)  # it answers again: said once, and the next outage is warned about again
        assert scraper.scrape()["engine/0/num_running_reqs"] == 3.0
        assert sum("answers again" in r.getMessage() for r in caplog.records) == 1
        _stop(srv)
        scraper.scrape()
        assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2
    finally:
        srv.server_close()
