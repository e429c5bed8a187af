"""The broker process's limits, over real ZeroMQ sockets, with a run secret:
- integer fields and columns hold what the wire carries back (a signed 64-bit int): a ``sync_end`` with version
  2**64 - 1 (before: accepted, and the broker echoed a version nobody's int64 holds) is malformed, naming the field;
- ``zmq.MAXMSGSIZE`` on the ROUTER, derived from the config: a peer WITHOUT the secret sending a frame over it is
  disconnected before the broker buffers it (before: 2 x 64 MB frames were received, then refused), the broker
  stays up and serves a legitimate peer, and a legitimate worker message of the largest size still gets through;
- a group whose rollout log-probs hold NaN or inf is never trained on: counted (``nonfinite_logprobs``) and dropped
  like an aborted group, never fatal (before: it reached the actor's batch).
"""

from __future__ import annotations

import math
import time

import msgpack
import numpy as np
import pytest
import zmq
from test_broker_fuzz import ProcessPeer, _hello, _traj, _write_inputs
from zmq.utils.monitor import recv_monitor_message

from asyncrl.broker import protocol as P
from asyncrl.broker import wire
from asyncrl.broker.serve import max_message_bytes
from asyncrl.broker.types import Trajectory
from asyncrl.broker.worker_client import MAX_GROUPS_PER_MESSAGE
from asyncrl.cluster import auth
from asyncrl.config import load_config
from asyncrl.runner.broker_process import start_broker

MAX_TOKENS = 64
OVERRIDES = [f"agentloop.max_total_tokens={MAX_TOKENS}", f"data.max_prompt_tokens={MAX_TOKENS}"]
WAIT_S = 20.0


@pytest.fixture
def broker(tmp_path, monkeypatch):
    """The broker process with a run secret (``ASYNCRL_API_KEY``: this process's peers send it, the child
    inherits it) -> (peer registered as worker ``fuzz``, the process, its config, the group ids issued to it)."""
    monkeypatch.setenv(auth.ENV, "limits-test-secret")
    cfg_path, prompts = _write_inputs(tmp_path)
    bp = start_broker(cfg_path, OVERRIDES, prompts_path=prompts, log_path=str(tmp_path / "broker.log"), timeout_s=30)
    peer = ProcessPeer(bp.address, bp.proc)
    try:
        replies, _ = peer.exchange(_hello())
        gids = [row[0] for m in replies if m.type == P.ISSUE for row in m.body["rows"]]
        yield peer, bp, load_config(cfg_path, OVERRIDES), gids
    finally:
        peer.close()
        code = bp.stop()
    assert code == 0, (tmp_path / "broker.log").read_text()[-3000:]


def _errors(replies: list[P.Message]) -> list[str]:
    return [m.body["message"] for m in replies if m.type == P.ERROR]


# ---------------------------------------------------------------- 3: integer bounds
@pytest.mark.parametrize("value", [2**64 - 1, 2**63])
def test_a_version_beyond_int64_is_malformed_naming_the_field(broker, value):
    peer, *_ = broker
    replies, s = peer.exchange(P.encode(P.SYNC_END, {"version": value}))
    assert any("'version'" in e and P.SYNC_END in e for e in _errors(replies)), replies
    assert s["version"] == 0 and s["stats"]["malformed"] == 1 and s["failure"] is None
    replies, s = peer.exchange(P.encode(P.GET_BATCH, {"step": value, "timeout_s": 0.0, "actor_version": None}))
    assert any("'step'" in e for e in _errors(replies)) and s["stats"]["malformed"] == 2
    replies, s = peer.exchange(P.encode(P.SYNC_END, {"version": 3}))  # a sane one still works
    assert [m.type for m in replies if m.type in (P.OK, P.ERROR)] == [P.OK] and s["version"] == 3


def test_a_column_beyond_int64_is_malformed_naming_it(broker):
    peer, *_ = broker
    _, s0 = peer.exchange()
    frames = P.finished_groups_frames([(0, [_traj(1.0), _traj(0.0)], False, "")])
    header = msgpack.unpackb(frames[0], raw=False)
    header["groups"]["traj"]["min_version"][0] = 2**64 - 1
    replies, s = peer.exchange([msgpack.packb(header), *frames[1:]])
    assert any("'min_version'" in e for e in _errors(replies)), replies
    assert s["stats"]["malformed"] == 1 and s["counters"] == s0["counters"] and s["num_buffered_groups"] == 0


def test_int_bounds_at_the_edge():
    assert P.int_field({"v": P.MAX_INT}, "v", "x") == P.MAX_INT == 2**63 - 1
    with pytest.raises(P.ProtocolError, match="x: field 'v'"):
        P.int_field({"v": P.MAX_INT + 1}, "v", "x")
    assert wire.column({"c": [0, P.MAX_INT]}, "c", int, 2, "x") == [0, P.MAX_INT]
    for bad in (P.MAX_INT + 1, 2**64 - 1, 2**64, -1):
        with pytest.raises(P.ProtocolError, match="x: column 'c'"):
            wire.column({"c": [0, bad]}, "c", int, 2, "x")
    with pytest.raises(P.ProtocolError, match="'group_ids'"):
        P.int_list_field({"group_ids": [2**63]}, "group_ids", "x", max_len=4)
    with pytest.raises(P.ProtocolError, match="index"):
        P.item_from_row([2**63, "q", [], "", {}])


# ---------------------------------------------------------------- 4: the maximum frame size
def _disconnected_or_answered(sock: zmq.Socket, monitor: zmq.Socket) -> str:
    """Whichever comes first: the broker closes the connection, or it answers."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ready = dict(poller.poll(100))
        if sock in ready:
            return f"answered: {P.decode(sock.recv_multipart())}"
        if monitor in ready and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return "disconnected"
    return "neither"


def test_an_oversized_frame_without_the_secret_is_dropped_and_the_broker_serves_on(broker):
    peer, bp, cfg, _ = broker
    cap = max_message_bytes(cfg)
    assert cap < 64 << 20  # derived from this small config, not a blanket constant
    rogue = peer.ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    monitor = rogue.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    rogue.connect(bp.address)
    header = msgpack.packb({"v": P.PROTOCOL_VERSION, "t": P.STATUS})  # no secret
    rogue.send_multipart([header, b"\0" * (cap + 1)])
    try:
        assert _disconnected_or_answered(rogue, monitor) == "disconnected"
    finally:
        rogue.disable_monitor()
        monitor.close(0)
        rogue.close(0)
    _, s = peer.exchange()  # alive, and the frame never reached the handler
    assert bp.proc.poll() is None and "unauthenticated" not in s["stats"] and "malformed" not in s["stats"]

    # the largest legitimate worker message still gets through: MAX_GROUPS_PER_MESSAGE groups of
    # group_size trajectories of MAX_TOKENS tokens (group ids nobody issued: counted late, nothing trained)
    gsize = cfg.algorithm.group_size
    long = Trajectory(
        prompt_ids=[1] * 8,
        response_ids=[3] * (MAX_TOKENS - 8),
        loss_mask=[1] * (MAX_TOKENS - 8),
        rollout_logprobs=[-0.5] * (MAX_TOKENS - 8),
        reward=1.0,
    )
    entries = [(10_000 + i, [long] * gsize, False, "") for i in range(MAX_GROUPS_PER_MESSAGE)]
    frames = P.finished_groups_frames(entries)
    assert sum(len(f) for f in frames[1:]) == MAX_GROUPS_PER_MESSAGE * gsize * wire.token_nbytes(8, MAX_TOKENS - 8)
    assert max(len(f) for f in frames) <= cap
    _, s = peer.exchange(frames)
    assert s["stats"]["late_reports"] == MAX_GROUPS_PER_MESSAGE and "malformed" not in s["stats"]


# ---------------------------------------------------------------- 5: non-finite log-probs
def _with_logprobs(lp: list[float]) -> Trajectory:
    t = _traj(1.0)
    t.rollout_logprobs = np.array(lp, np.float32)
    return t


def test_nonfinite_logprobs_are_counted_dropped_and_never_trained(broker):
    peer, _, _, gids = broker
    assert len(gids) >= 4, gids
    bad = {gids[0]: [-0.5, math.nan, -0.5], gids[1]: [-0.5, -0.5, -math.inf]}
    reports = [P.finished_groups_frames([(g, [_traj(0.0), _with_logprobs(lp)], False, "")]) for g, lp in bad.items()]
    reports += [P.finished_groups_frames([(g, [_traj(1.0), _traj(0.0)], False, "")]) for g in gids[2:4]]
    replies, s = peer.exchange(*reports)
    assert not _errors(replies) and "malformed" not in s["stats"]
    assert s["stats"]["nonfinite_logprobs"] == 2 and s["counters"]["dropped"] == 2 and s["failure"] is None
    assert "fuzz" in s["workers"]  # never fatal, for the broker nor the worker
    replies, s = peer.exchange(P.encode(P.GET_BATCH, {"step": 0, "timeout_s": 5.0, "actor_version": 0}))
    (batch,) = [m for m in replies if m.type == P.BATCH]
    groups = P.unpack_groups(batch.body["groups"], batch.blobs)
    assert sorted(g.group_id for g in groups) == gids[2:4]
    assert all(np.isfinite(t.rollout_logprobs).all() for g in groups for t in g.trajectories)
