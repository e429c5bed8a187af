"""The weight-sync group never hangs: an engine that is unreachable, refuses, or never joins fails
``WeightSyncGroup.init`` within ``sync.join_timeout_s`` with the engine's URL in the message.

The misbehaving engines here are tiny stdlib HTTP servers (the failure is the outside edge under
test); the happy path with real CPU engines is in test_sync_cpu_engines.py.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.cluster.ports import free_port
from asyncrl.config.schema import SyncConfig
from asyncrl.sync.group import EngineEndpoint, GroupJoinError, WeightSyncGroup, rank_offsets

pytestmark = pytest.mark.slow


class _Engine:
    """Answers /model_info; on /init_weights_update_group either refuses or never answers."""

    def __init__(self, behaviour: str):
        release = self.release = threading.Event()

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj, code=200):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"weight_version": "0", "model_path": "x"})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/init_weights_update_group":
                    if behaviour == "refuse":
                        self._send({"success": False, "message": "backend gloo not supported here"})
                        return
                    release.wait(60)  # "hang": never joins; freed at teardown
                self._send({"success": True, "message": ""})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines():
    made = []

    def make(behaviour):
        e = _Engine(behaviour)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _group(urls, join_timeout_s=3.0):
    return WeightSyncGroup(
        [EngineEndpoint(u) for u in urls],
        SyncConfig(join_timeout_s=join_timeout_s, backend="gloo"),
        master_address="127.0.0.1",
        control_timeout_s=2.0,
    )


def test_rank_offsets():
    es = [EngineEndpoint("a", 2), EngineEndpoint("b", 1), EngineEndpoint("c", 4)]
    assert rank_offsets(es) == [1, 3, 4]
    assert WeightSyncGroup(es, SyncConfig()).world_size == 8


def test_unreachable_engine_named():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(GroupJoinError) as ei:
        _group([url]).init()
    assert url in str(ei.value) and ei.value.urls == [url]
    assert "not reachable" in str(ei.value)
    assert time.monotonic() - t0 < 30  # bounded (generous: a shared 2-core box)


def test_refusing_engine_named_fast(engines):
    bad = engines("refuse")
    hang = engines("hang")  # a second engine stuck waiting must not delay the error
    with pytest.raises(GroupJoinError) as ei:
        _group([hang.url, bad.url], join_timeout_s=20.0).init()  # the process waits this out at its exit
    assert ei.value.urls == [bad.url]
    assert "refused to join" in str(ei.value) and "gloo not supported" in str(ei.value)


def test_engine_that_never_joins_times_out_with_url(engines):
    hang = engines("hang")
    g = _group([hang.url], join_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(GroupJoinError) as ei:
        g.init()
    assert hang.url in str(ei.value)
    assert "did not join within sync.join_timeout_s=2" in str(ei.value)
    assert time.monotonic() - t0 < 30
    assert g.pg is None


_EXIT_AFTER_REFUSAL = """
import logging, sys, time
sys.path.insert(0, {here!r})
logging.basicConfig(level=logging.INFO, format="%(message)s")
from test_sync_group_failures import _Engine, _group
from asyncrl.sync.group import GroupJoinError
refuse, hang = _Engine("refuse"), _Engine("hang")
try:
    _group([hang.url, refuse.url], join_timeout_s={timeout}).init()
except GroupJoinError:
    print(f"REFUSED {{time.monotonic():.3f}}", flush=True)
"""


def test_process_exiting_after_a_refused_join_waits_out_its_rendezvous_and_exits_clean(tmp_path):
    """One engine refuses at once, so ``init`` fails fast while the trainer's own rendezvous thread still waits (in
    torch.distributed, uninterruptible) for the engine that never joins. A process exiting right then must not die
    under that thread (it aborted with "terminate called without an active exception", exit 134, at the end of a
    test session): it waits the rendezvous out at exit, says so, and exits 0."""
    import subprocess
    import sys
    from pathlib import Path

    timeout = 3.0
    script = _EXIT_AFTER_REFUSAL.format(here=str(Path(__file__).parent), timeout=timeout)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    ended = time.monotonic()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REFUSED" in r.stdout, r.stdout + r.stderr[-3000:]
    refused_at = float(r.stdout.split("REFUSED")[1].split()[0])
    assert "terminate called" not in r.stderr
    assert "exit: waiting up to" in r.stderr and "abandoned weight-sync rendezvous" in r.stderr, r.stderr[-3000:]
    # the refusal came fast; the exit waited for the rendezvous' own timeout (monotonic clocks are system-wide)
    assert ended - refused_at >= timeout - 1.0, (ended, refused_at)
