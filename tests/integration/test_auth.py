"""The run secret: the broker and the CPU engine refuse a peer without it, count it, and go on.

- broker: a real broker process started with ``ASYNCRL_API_KEY``; control and worker messages without the
  secret (or with a wrong one) are answered with an error and counted in ``stats["unauthenticated"]``; the
  broker keeps serving the peers that hold it.
- CPU engine with ``--api-key`` (SGLang's flag): 401 ``{"error": "Unauthorized"}`` without or with a wrong
  ``Authorization: Bearer``, ``/health`` and ``/metrics`` stay open, the right key generates (scheme in any case,
  as sglang 0.5.23's ``decide_request_auth``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq
from agent_fixtures import make_scripted_model, start_cpu_engine

from asyncrl.broker import protocol as P
from asyncrl.broker.client import BrokerClient
from asyncrl.broker.core import BrokerError
from asyncrl.cluster.auth import ENV
from asyncrl.runner.broker_process import start_broker

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-of-this-run"


def _raw(address: str, header: dict) -> dict:
    """One message from a peer that builds its own frames; returns the broker's answer header."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([msgpack.packb({"v": P.PROTOCOL_VERSION, **header})])
        assert sock.poll(10_000), "the broker did not answer"
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    finally:
        sock.close()


def test_broker_refuses_peers_without_the_run_secret(tmp_path, monkeypatch):
    model = make_scripted_model(tmp_path)
    monkeypatch.setenv(ENV, SECRET)  # the broker process inherits it, as from its rank
    broker = start_broker(
        str(REPO / "configs/tiny.toml"),
        [f"data.train_path={model.data_dir / 'train.jsonl'}"],
        log_path=str(tmp_path / "broker.log"),
    )
    try:
        monkeypatch.delenv(ENV)
        stranger = BrokerClient(broker.address, timeout_s=10)
        with pytest.raises(BrokerError, match="unauthenticated"):
            stranger.status()
        stranger.close()
        hello = {"t": "hello", "worker_id": "intruder", "capacity": 4}
        assert _raw(broker.address, hello)["t"] == P.ERROR
        assert _raw(broker.address, {**hello, "k": "wrong"})["t"] == P.ERROR
        assert _raw(broker.address, {**hello, "k": 12345})["t"] == P.ERROR  # a key of the wrong type too
        monkeypatch.setenv(ENV, SECRET)
        ours = BrokerClient(broker.address, timeout_s=10)
        status = ours.status()
        ours.close()
    finally:
        broker.stop()
    assert status["stats"]["unauthenticated"] == 4
    assert status["workers"] == {}  # the intruder's hello changed nothing
    assert status["counters"].get("issued", 0) == 0


def _post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cpu_engine_api_key_like_sglang(tmp_path):
    model = make_scripted_model(tmp_path)
    engine, url = start_cpu_engine(model.path, tmp_path / "engine.log", api_key=SECRET)
    try:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        assert _post(url + "/generate", body, None) == (401, {"error": "Unauthorized"})
        assert _post(url + "/generate", body, "wrong") == (401, {"error": "Unauthorized"})
        assert _post(url + "/update_weight_version", {"new_version": "9"}, None)[0] == 401
        for path in ("/health", "/metrics"):  # open, as in SGLang: probes and scrapes need no key
            with urllib.request.urlopen(url + path, timeout=10) as r:
                assert r.status == 200
        status, out = _post(url + "/generate", body, SECRET)
        assert status == 200 and out["meta_info"]["completion_tokens"] >= 1
        req = urllib.request.Request(
            url + "/generate",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"bearer {SECRET}"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:  # SGLang compares the scheme case-insensitively
            assert r.status == 200
        assert engine.proc.poll() is None
    finally:
        engine.stop()
