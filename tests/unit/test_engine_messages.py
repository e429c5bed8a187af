"""The CPU engine's two processes skip a message they cannot read instead of dying (a real socket pair, a real tiny
model): the scheduler process's receiver after garbage and a malformed call still serves a request, and the HTTP
process's reader after garbage still resolves a call's future. Frames cut at any byte arrive whole."""

from __future__ import annotations

import asyncio
import pickle
import select
import socket
import threading

import pytest

from asyncrl.cpu_engine.args import parse_args
from asyncrl.cpu_engine.frames import MAX_FRAME, FrameError, FrameReader, frame
from asyncrl.cpu_engine.sampling_params import parse_sampling_params
from asyncrl.cpu_engine.scheduler_link import SchedulerLink
from asyncrl.cpu_engine.scheduler_process import Backend, RequestSpec
from asyncrl.models.tiny import make_tiny_checkpoint


@pytest.fixture
def args(tmp_path):
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    return parse_args(["--model-path", str(model), "--port", "1", "--weight-version", "7"])


def test_frames_cut_anywhere_arrive_whole_and_in_order():
    payloads = [b"", b"x", bytes(range(256)) * 300, pickle.dumps(("reply", 1, True, "ok", (None, "1")))]
    stream = b"".join(frame(p) for p in payloads)
    for step in (1, 3, 7, 8, 9, 4096, len(stream)):
        r = FrameReader()
        got = [p for i in range(0, len(stream), step) for p in r.feed(stream[i : i + step])]
        assert got == payloads and r.pending == 0, step


def test_a_frame_header_beyond_the_limit_is_an_error_naming_it():
    with pytest.raises(FrameError, match=str(MAX_FRAME + 1)):
        FrameReader().feed((MAX_FRAME + 1).to_bytes(8, "little"))


class _Peer:
    """The test's end of a socket pair: whole messages in and out, blocking with a deadline."""

    def __init__(self, sock: socket.socket):
        self.sock, self.frames, self.got = sock, FrameReader(), []

    def send(self, payload: bytes) -> None:
        self.sock.sendall(frame(payload))

    def recv(self, timeout_s: float = 30.0) -> tuple:
        while not self.got:
            assert select.select([self.sock], [], [], timeout_s)[0], "no message within the deadline"
            data = self.sock.recv(1 << 20)
            assert data, "the other end closed"
            self.got += self.frames.feed(data)
        return pickle.loads(self.got.pop(0))


def test_scheduler_process_skips_unreadable_messages_and_keeps_serving(args, tmp_path):
    """The engine loop reads its socket between steps: garbage, a call without its fields and an unknown kind are
    logged and skipped; an unknown op is answered as a failure; the next request is served; ``stop`` ends it."""
    mine, theirs = socket.socketpair()
    http = _Peer(mine)
    backend = Backend(args, sock=theirs)
    engine = threading.Thread(target=backend.run)
    engine.start()
    try:
        for raw in (b"not a pickle", pickle.dumps(("call", 1)), pickle.dumps(("nonsense",))):
            http.send(raw)
        http.send(pickle.dumps(("call", 2, "no_such_op", ())))
        kind, cid, ok, value, state = http.recv()
        assert (kind, cid, ok) == ("reply", 2, False) and "no_such_op" in str(value) and state == (None, "7")
        spec = RequestSpec("r1", [1, 2, 3], parse_sampling_params({"max_new_tokens": 3}), False, -1, 0.0)
        http.send(pickle.dumps(("submit", [spec])))
        kind, items, state = http.recv()
        assert kind == "out" and [rid for rid, _ in items] == ["r1"]
        assert items[0][1]["meta_info"]["completion_tokens"] == 3 and state == (None, "7")
        http.send(pickle.dumps(("stop",)))
        engine.join(30)
        assert not engine.is_alive(), "the engine loop did not end on stop"
    finally:
        backend.stop()
        engine.join(10)
        mine.close()
        theirs.close()


def test_scheduler_process_stops_when_the_http_process_end_closes(args):
    """The HTTP process gone (its end of the pair closed): the engine loop ends instead of serving nobody."""
    mine, theirs = socket.socketpair()
    backend = Backend(args, sock=theirs)
    engine = threading.Thread(target=backend.run)
    engine.start()
    try:
        http = _Peer(mine)
        http.send(pickle.dumps(("call", 1, "ping", ())))
        assert http.recv()[:3] == ("reply", 1, True)
        mine.close()
        engine.join(30)
        assert not engine.is_alive(), "the engine loop kept running after its HTTP process's end closed"
    finally:
        backend.stop()
        engine.join(10)
        theirs.close()


def test_http_process_reader_skips_unreadable_messages_and_still_resolves_calls(args):
    link = SchedulerLink(args)  # the pair made, no scheduler process forked: this test plays it on the child's end
    sched = _Peer(link.child_end)
    got = {}

    async def go():
        await link.open()
        fut = link.call("ping")
        sched.send(b"garbage")
        sched.send(pickle.dumps(("reply",)))  # too short to be a reply
        sched.send(pickle.dumps(("reply", 0, True, "pong", ("retract", "9"))))
        got["value"] = await asyncio.wait_for(fut, 30)
        got["sent"] = sched.recv()
        link._transport.abort()

    try:
        t = threading.Thread(target=lambda: asyncio.run(go()))
        t.start()
        t.join(60)
        assert got.get("value") == "pong" and got["sent"] == ("call", 0, "ping", ())
        assert (link.paused, link.weight_version) == ("retract", "9")
    finally:
        link.stop()
