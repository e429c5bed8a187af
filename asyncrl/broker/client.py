"""The actor's client of the broker: ``BrokerClient`` (actor rank 0), one DEALER socket that **connects** to the
broker's ROUTER, and ``broker_handshake`` (any rank's one round trip at start-up). The agent workers'
connections are in ``asyncrl.broker.worker_client``.

Actor side:

    client = BrokerClient(address, timeout_s=60)
    batch = client.get_batch(step, timeout_s=600)     # -> Batch(step, groups, wait_s, metrics)
    client.sync_begin("retract"); client.sync_end(new_version)
    blob = client.get_state(); client.set_state(blob) # checkpoint / resume (opaque bytes)
    client.metrics(); client.status(); client.shutdown()
    ping = BrokerPing(address); ping(timeout_s=1.0)    # -> True when the broker answered (process.fail_fast_on_hang)

Batches decode zero-copy: token fields of the returned trajectories are read-only numpy views of the
received frames (``prompt_ids``/``response_ids``/``weight_versions`` int32, ``rollout_logprobs`` float32,
``loss_mask`` uint8; ``asyncrl.broker.wire``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import zmq

from asyncrl.broker import protocol as P
from asyncrl.broker.core import Batch, BrokerError
from asyncrl.broker.worker_client import dealer


class BrokerClient:
    """The actor's connection (actor rank 0). One request at a time; every call has a timeout."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, context: Optional[zmq.Context] = None):
        self.address, self.timeout_s = address, timeout_s
        self.sock = dealer(context or zmq.Context.instance(), address, f"actor-{os.getpid()}-{id(self):x}")

    def _call(
        self, msg_type: str, body: Optional[dict] = None, blobs=(), *, timeout_s: Optional[float] = None
    ) -> P.Message:
        self.sock.send_multipart(P.encode(msg_type, body, blobs), copy=not blobs)
        t = self.timeout_s if timeout_s is None else timeout_s
        if not self.sock.poll(int(t * 1000)):
            raise TimeoutError(
                f"broker at {self.address} did not answer {msg_type!r} within {t:.0f}s "
                f"(is the broker process alive? see its log in the run directory)"
            )
        msg = P.decode(self.sock.recv_multipart(copy=False), allowed=P.TO_ACTOR_TYPES)
        if msg.type == P.ERROR:
            raise BrokerError(msg.body.get("message", "broker error"))
        return msg

    def get_batch(self, step: int, *, timeout_s: float, actor_version: Optional[int] = None) -> Batch:
        """Block until the oldest ``rollout_batch_size`` groups are ready (``Batch.wait_s`` is time/wait_data).
        Raises TimeoutError after ``timeout_s`` (the request is withdrawn) and BrokerError when the broker
        stopped the run (e.g. ``rollout_buffer.max_dropped_groups_per_step``)."""
        body = {"step": step, "timeout_s": timeout_s, "actor_version": actor_version}
        msg = self._call(P.GET_BATCH, body, timeout_s=timeout_s + self.timeout_s)
        if msg.type == P.TIMEOUT:
            raise TimeoutError(f"no batch for step {step} from the broker at {self.address} within {timeout_s:.1f}s")
        b = msg.body
        groups = P.unpack_groups(b["groups"], msg.blobs)
        return Batch(step=int(b["step"]), groups=groups, wait_s=float(b["wait_s"]), metrics=dict(b["metrics"]))

    def sync_begin(self, mode: str = "retract") -> None:
        """A weight sync starts (``drain``: the broker stops issuing and workers hold new turns)."""
        self._call(P.SYNC_BEGIN, {"mode": mode})

    def sync_end(self, version: int) -> None:
        """The engines now carry weight ``version``; issuing resumes."""
        self._call(P.SYNC_END, {"version": int(version)})

    def hold_issuing(self) -> None:
        """Stop issuing new prompts (a blocking eval on the shared engines); in-flight groups go on and
        are buffered, nothing is aborted, workers keep taking turns. Undo with ``release_issuing``."""
        self._call(P.HOLD_ISSUING)

    def release_issuing(self) -> None:
        """Issue new prompts again."""
        self._call(P.RELEASE_ISSUING)

    def engine_figures(self, *, running_reqs: float, queue_reqs: float, gen_tokens_per_s: float) -> None:
        """The engines' latest ``/metrics`` summed over engines (``max_inflight_groups = "auto"`` uses them)."""
        body = {"running_reqs": running_reqs, "queue_reqs": queue_reqs, "gen_tokens_per_s": gen_tokens_per_s}
        self._call(P.ENGINE_FIGURES, {k: float(v) for k, v in body.items()})

    def batch_filtered(self, group_ids: list[int]) -> None:
        """The sample filter removed these groups of the last batch: the broker counts them as
        dropped, not trained."""
        self._call(P.BATCH_FILTERED, {"group_ids": [int(g) for g in group_ids]})

    def metrics(self) -> dict[str, Any]:
        """``{"metrics": last step's metrics, "counters": lifetime totals, "status": status()}``."""
        return self._call(P.METRICS).body

    def status(self) -> dict[str, Any]:
        return self._call(P.STATUS).body

    def get_state(self) -> bytes:
        """Opaque checkpoint blob: dataloader position, version, queued and in-flight prompts, buffered groups."""
        msg = self._call(P.GET_STATE)
        return P.state_to_bytes(msg.body["state"], msg.blobs)

    def set_state(self, state: bytes) -> None:
        """Restore a ``get_state`` blob; groups in flight at checkpoint time are issued again first."""
        body, blobs = P.state_from_bytes(state)
        self._call(P.SET_STATE, {"state": body}, blobs)

    def shutdown(self) -> None:
        """Stop the broker (it tells the workers to shut down)."""
        self._call(P.SHUTDOWN)

    def close(self) -> None:
        self.sock.close(linger=0)


def broker_handshake(address: str, *, timeout_s: float, who: str) -> dict[str, Any]:
    """One real round trip to the broker (``status``) from ``who`` (e.g. ``rollout rank 8 (engine 0)``), so a
    broker that this rank cannot reach fails the start within ``timeout_s``, naming the address, instead of a
    silent worker later. Returns the broker's status."""
    client = BrokerClient(address, timeout_s=timeout_s, context=zmq.Context.instance())
    try:
        return client.status()
    except TimeoutError:
        raise TimeoutError(
            f"{who}: no answer from the broker at {address} within {timeout_s:.0f}s "
            f"(cluster.broker_handshake_timeout_s); is that address reachable from this node? On several nodes set "
            f"cluster.broker_host to an address of node 0 that every node reaches"
        ) from None
    finally:
        client.close()


class BrokerPing:
    """A liveness probe of the broker on its own connection (actor rank 0's watcher thread; ``P.PING``). At most one
    ping is outstanding: ``__call__(timeout_s)`` sends one unless one is still unanswered, and returns True when an
    answer arrived within ``timeout_s``. Its own ZeroMQ context, so that it never holds up another's teardown."""

    def __init__(self, address: str):
        self.address = address
        self.sock = dealer(zmq.Context(), address, f"actor-ping-{os.getpid()}-{id(self):x}")
        self._outstanding = False

    def __call__(self, timeout_s: float) -> bool:
        if not self._outstanding:
            self.sock.send_multipart(P.encode(P.PING, {}))
            self._outstanding = True
        if not self.sock.poll(int(timeout_s * 1000)):
            return False
        P.decode(self.sock.recv_multipart(), allowed=P.TO_ACTOR_TYPES)
        self._outstanding = False
        return True
