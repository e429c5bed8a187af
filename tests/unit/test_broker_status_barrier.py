"""A ``status`` answer is a barrier (``BrokerServer``): what the messages before it caused -- here the ``issue`` of
a worker's ``hello`` -- is sent before the answer, also when both messages are handled in the same round.

The broker sends a round's outputs at the end of the round, after the replies of the round's requests; a ``status``
handled in the same round as a ``hello`` was answered before that worker's ``issue``. A peer that is a worker and
asks ``status`` on one connection (``tests/integration/test_broker_fuzz.py``) then read no ``issue`` up to the
answer: on a loaded machine the round took the next ``status`` too, and the fuzz test failed 3 runs in 12.
One in-process broker over ``inproc`` (delivered at once): both messages are queued before its one round runs.
"""

from __future__ import annotations

import time

import zmq

from asyncrl.broker import protocol as P
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.server import BrokerServer
from asyncrl.broker.types import PromptItem


def test_status_answer_comes_after_the_issue_of_a_hello_handled_in_the_same_round():
    settings = CoreSettings(
        rollout_batch_size=2, group_size=2, max_inflight_groups=4, max_buffered_groups=8, max_dropped_groups_per_step=10
    )
    core = BrokerCore([PromptItem(i, f"q{i}", [f"a{i}"]) for i in range(8)], settings=settings, clock=time.monotonic)
    ctx = zmq.Context()
    server = BrokerServer(core, bind="inproc://status-barrier", tick_s=3600.0, context=ctx)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"w0")
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(server.address)
    try:
        peer.send_multipart(P.encode(P.HELLO, {"worker_id": "w0", "capacity": 4}))
        peer.send_multipart(P.encode(P.STATUS))
        poller = zmq.Poller()
        poller.register(server.sock, zmq.POLLIN)
        server.serve_once(poller, timeout_s=5.0)
        assert server.stats["worker_hello"] == 1 and server.stats["actor_status"] == 1  # one round took both
        types = []
        while not types or types[-1] != P.STATUS:
            assert peer.poll(5000), f"no status answer; received {types}"
            types.append(P.decode(peer.recv_multipart()).type)
        assert types == [P.WELCOME, P.ISSUE, P.STATUS]
        assert core.counters["issued"] == 4
    finally:
        peer.close(0)
        server.sock.close(0)
        ctx.term()
