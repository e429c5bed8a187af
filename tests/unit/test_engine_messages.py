"""The CPU engine's two processes skip a message they cannot read instead of dying (real ZeroMQ sockets, a real
tiny model): the scheduler process's receiver after garbage and a malformed call still serves a request, and the
HTTP process's reader after garbage still resolves a call's future."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
import zmq

from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.rollout.engine_args import parse_args
from asyncrl.rollout.engine_backend import Backend, RequestSpec
from asyncrl.rollout.engine_link import SchedulerLink
from asyncrl.rollout.sampling_params import parse_sampling_params


@pytest.fixture
def args(tmp_path):
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    return parse_args(["--model-path", str(model), "--port", "1", "--weight-version", "7"])


def test_scheduler_process_skips_unreadable_messages_and_keeps_serving(args, tmp_path):
    """The engine loop reads its socket between steps: garbage, a call without its fields and an unknown kind are
    logged and skipped; an unknown op is answered as a failure; the next request is served; ``stop`` ends it."""
    ctx = zmq.Context()
    to_http, to_backend = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    to_http.bind(f"ipc://{tmp_path}/out")
    to_backend.bind(f"ipc://{tmp_path}/in")
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"ipc://{tmp_path}/in")
    push.connect(f"ipc://{tmp_path}/out")
    backend = Backend(args, pull=pull, push=push)
    engine = threading.Thread(target=backend.run)
    engine.start()
    try:
        for raw in (b"not a pickle", pickle.dumps(("call", 1)), pickle.dumps(("nonsense",))):
            to_backend.send(raw)
        to_backend.send(pickle.dumps(("call", 2, "no_such_op", ())))
        assert to_http.poll(30_000), "the call after the bad messages was never answered"
        kind, cid, ok, value, state = pickle.loads(to_http.recv())
        assert (kind, cid, ok) == ("reply", 2, False) and "no_such_op" in str(value) and state == (None, "7")
        spec = RequestSpec("r1", [1, 2, 3], parse_sampling_params({"max_new_tokens": 3}), False, -1, 0.0)
        to_backend.send(pickle.dumps(("submit", [spec])))
        assert to_http.poll(30_000), "the request after the bad messages was never answered"
        kind, items, state = pickle.loads(to_http.recv())
        assert kind == "out" and [rid for rid, _ in items] == ["r1"]
        assert items[0][1]["meta_info"]["completion_tokens"] == 3 and state == (None, "7")
        to_backend.send(pickle.dumps(("stop",)))
        engine.join(30)
        assert not engine.is_alive(), "the engine loop did not end on stop"
    finally:
        backend.stop()
        engine.join(10)
        for sock in (to_http, to_backend, pull, push):
            sock.close(0)
        ctx.term()


def test_http_process_reader_skips_unreadable_messages_and_still_resolves_calls(args):
    link = SchedulerLink(args)  # sockets bound, no scheduler process forked: this test plays it
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(link.from_backend)
    pull = ctx.socket(zmq.PULL)  # the calls' end (a PUSH with no peer would hold them)
    pull.connect(link.to_backend)
    got = {}

    async def go():
        await link.open()
        fut = link.call("ping")
        push.send(b"garbage")
        push.send(pickle.dumps(("reply",)))  # too short to be a reply
        push.send(pickle.dumps(("reply", 0, True, "pong", ("retract", "9"))))
        got["value"] = await asyncio.wait_for(fut, 30)
        got["sent"] = pickle.loads(pull.recv())
        link._reader.cancel()

    try:
        t = threading.Thread(target=lambda: asyncio.run(go()))
        t.start()
        t.join(60)
        assert got.get("value") == "pong" and got["sent"] == ("call", 0, "ping", ())
        assert (link.paused, link.weight_version) == ("retract", "9")
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
        link.stop()
