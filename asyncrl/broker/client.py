"""Clients of the broker: ``WorkerConnection`` / ``AsyncWorkerConnection`` (agent workers) and
``BrokerClient`` (actor rank 0). Each owns one DEALER socket that **connects** to the broker's ROUTER.

Worker side (every call has a timeout; a silent broker raises ``TimeoutError`` from ``connect``):

    conn = WorkerConnection(address, worker_id="engine0", capacity=64, heartbeat_interval_s=2.0)
    welcome = conn.connect(timeout_s=30)              # -> Welcome(version, group_size, hold, ...)
    for ev in conn.poll(timeout_s=0.1):               # also sends a heartbeat when one is due
        if isinstance(ev, Assignment): ...            # run ev.group_size trajectories of ev.item
        elif isinstance(ev, Control): ...             # ev.hold: hold new turns (drain); ev.version
        elif isinstance(ev, Cancel): ...              # stop these group ids (results are ignored)
        elif isinstance(ev, Shutdown): ...
    conn.send_done(group_id, index)                   # a trajectory finished (only if welcome.per_trajectory)
    conn.send_group(group_id, trajs, aborted=False)   # the finished group with its trajectories
    conn.send_group(gid, trajs, flush=False); conn.flush()   # several groups in ONE ``groups`` message

``poll`` must be called at least every ``heartbeat_interval_s``; ``AsyncWorkerConnection`` has the
same methods as coroutines and heartbeats from a background task. Neither is thread-safe.

Batching: finished groups (and ``done`` notices) travel as ``groups`` messages (several groups, one header,
one table, their token frames; ``protocol``). The blocking connection queues what is sent with
``flush=False`` (and every ``send_done``) until ``flush()``, ``poll()``, any other send or
``MAX_GROUPS_PER_MESSAGE`` queued; the asyncio connection coalesces by itself what finished in the same
event-loop turn. Order is kept: what is queued always leaves before any later message.

Actor side:

    client = BrokerClient(address, timeout_s=60)
    batch = client.get_batch(step, timeout_s=600)     # -> Batch(step, groups, wait_s, metrics)
    client.sync_begin("retract"); client.sync_end(new_version)
    blob = client.get_state(); client.set_state(blob) # checkpoint / resume (opaque bytes)
    client.metrics(); client.status(); client.shutdown()

Batches decode zero-copy: token fields of the returned trajectories are read-only numpy views of the
received frames (``prompt_ids``/``response_ids`` int32, ``rollout_logprobs`` float32, ``loss_mask`` uint8;
``weight_versions`` is empty: it does not travel, ``asyncrl.broker.wire``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import zmq
import zmq.asyncio

from asyncrl.broker import protocol as P
from asyncrl.broker.core import Batch, BrokerError
from asyncrl.broker.types import PromptItem, Trajectory


@dataclass
class Welcome:
    version: int
    group_size: int
    hold: bool
    heartbeat_interval_s: float
    per_trajectory: bool = False
    """The broker frees a slot per finished trajectory (``sample`` granularity): send ``send_done``."""

    @classmethod
    def from_body(cls, b: dict) -> Welcome:
        return cls(
            int(b["version"]),
            int(b["group_size"]),
            bool(b["hold"]),
            float(b["heartbeat_interval_s"]),
            bool(b.get("per_trajectory", False)),
        )


@dataclass
class Assignment:
    """A group to generate: ``group_size`` trajectories of ``item``."""

    group_id: int
    item: PromptItem
    epoch: int
    group_size: int
    version: int
    """The broker's weight version when it was issued."""


@dataclass
class Control:
    hold: bool
    """True while a ``drain`` weight sync runs: start no new turns (finish running ones)."""
    version: int


@dataclass
class Cancel:
    group_ids: list[int]


@dataclass
class Shutdown:
    pass


WorkerEvent = Union[Assignment, Control, Cancel, Shutdown]


def _dealer(ctx: zmq.Context, address: str, identity: Optional[str]) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


MAX_GROUPS_PER_MESSAGE = 256
"""A connection's queue of finished groups is sent as soon as it holds this many."""


def _hello(worker_id: str, capacity: int) -> list:
    return P.encode(P.HELLO, {"worker_id": worker_id, "capacity": capacity})


def _to_events(msg: P.Message) -> list[WorkerEvent]:
    b = msg.body
    if msg.type == P.ISSUE:  # rows: [group_id, group_size, version, epoch, item row]
        return [
            Assignment(gid, P.item_from_row(item, P.ISSUE), epoch, size, version)
            for gid, size, version, epoch, item in b["rows"]
        ]
    if msg.type == P.CONTROL:
        return [Control(bool(b["hold"]), int(b["version"]))]
    if msg.type == P.CANCEL:
        return [Cancel([int(g) for g in b["group_ids"]])]
    if msg.type == P.SHUTDOWN:
        return [Shutdown()]
    return []


class _Outbox:
    """What a worker connection has queued for its next ``groups`` message: ``done`` notices, then groups."""

    def __init__(self):
        self.done: list[tuple[int, int]] = []
        self.groups: list[P.FinishedGroup] = []

    def __bool__(self) -> bool:
        return bool(self.groups or self.done)

    def take(self) -> list:
        frames = P.finished_groups_frames(self.groups, self.done)
        self.done, self.groups = [], []
        return frames


class WorkerConnection:
    """Blocking worker-side connection (see the module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        worker_id: str,
        capacity: int,
        heartbeat_interval_s: float = 2.0,
        context: Optional[zmq.Context] = None,
    ):
        self.address, self.worker_id, self.capacity = address, worker_id, capacity
        self.heartbeat_interval_s = heartbeat_interval_s
        self.sock = _dealer(context or zmq.Context.instance(), address, worker_id)
        self._last_sent = 0.0
        self.welcome: Optional[Welcome] = None
        self._out = _Outbox()
        self._early: list[WorkerEvent] = []

    def _send(self, frames: list) -> None:
        self.flush()
        self.sock.send_multipart(frames)
        self._last_sent = time.monotonic()

    def flush(self) -> None:
        """Send what is queued (``send_group(..., flush=False)``, ``send_done``) as one ``groups`` message."""
        if self._out:
            self.sock.send_multipart(self._out.take(), copy=False)
            self._last_sent = time.monotonic()

    def connect(self, *, timeout_s: float = 30.0) -> Welcome:
        """Say hello and wait for the welcome (events that arrive first are kept for ``poll``)."""
        self._send(_hello(self.worker_id, self.capacity))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError(
                    f"broker at {self.address} did not answer hello from worker {self.worker_id!r} "
                    f"within {timeout_s:.0f}s"
                )
            msg = P.decode(self.sock.recv_multipart(), allowed=P.TO_WORKER_TYPES | {P.ERROR})
            if msg.type == P.WELCOME:
                self.welcome = Welcome.from_body(msg.body)
                return self.welcome
            if msg.type == P.ERROR:
                raise BrokerError(f"broker at {self.address} refused worker {self.worker_id!r}: {msg.body['message']}")
            self._early.extend(_to_events(msg))

    def poll(self, timeout_s: float = 0.0) -> list[WorkerEvent]:
        """Events received within ``timeout_s`` (returns as soon as one arrives); heartbeats when due."""
        self.flush()
        if time.monotonic() - self._last_sent >= self.heartbeat_interval_s:
            self.heartbeat()
        out, self._early = self._early, []
        if not out and not self.sock.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = P.decode(frames, allowed=P.TO_WORKER_TYPES | {P.ERROR})
            if msg.type == P.REHELLO:
                self._send(_hello(self.worker_id, self.capacity))
            elif msg.type == P.ERROR:
                raise BrokerError(f"broker at {self.address}: {msg.body.get('message')}")
            else:
                out.extend(_to_events(msg))

    def heartbeat(self) -> None:
        self._send(P.encode(P.HEARTBEAT, {"worker_id": self.worker_id}))

    def send_done(self, group_id: int, index: int) -> None:
        """Trajectory ``index`` of a running group finished (frees its slot under ``sample`` granularity; send it
        only when ``welcome.per_trajectory``). Queued: it leaves with the next message."""
        self._out.done.append((group_id, index))

    def send_group(
        self,
        group_id: int,
        trajectories: Optional[Sequence[Trajectory]] = None,
        *,
        aborted: bool = False,
        error: str = "",
        flush: bool = True,
    ) -> None:
        """The group finished, with its ``trajectories`` (None or [] for an aborted group). ``aborted=True`` (a
        generate/tool call failed; ``error`` says what) makes the broker apply ``rollout_buffer.unused_groups``;
        it is never trained. ``flush=False`` queues it: the queued groups travel together in one message at the
        next ``flush``/``poll``/send (or when ``MAX_GROUPS_PER_MESSAGE`` are queued). Trajectories must not
        change until then."""
        self._out.groups.append((group_id, trajectories, aborted, error))
        if flush or len(self._out.groups) >= MAX_GROUPS_PER_MESSAGE:
            self.flush()

    def send_groups(self, groups: Sequence[tuple[int, Optional[Sequence[Trajectory]]]]) -> None:
        """Several finished (not aborted) groups ``(group_id, trajectories)`` in one message."""
        for gid, trajs in groups:
            self.send_group(gid, trajs, flush=False)
        self.flush()

    def close(self, *, say_bye: bool = True) -> None:
        self.flush()
        if say_bye:
            try:
                self.sock.send_multipart(P.encode(P.BYE, {"worker_id": self.worker_id}), zmq.NOBLOCK)
            except zmq.Again:
                pass
        self.sock.close(linger=500 if say_bye else 0)


class AsyncWorkerConnection:
    """The same as ``WorkerConnection`` for asyncio programs (pyzmq's asyncio sockets).

    conn = AsyncWorkerConnection(address, worker_id="engine0", capacity=64)
    await conn.connect(timeout_s=30)       # starts the heartbeat task
    ev = await conn.recv(timeout_s=1.0)    # one WorkerEvent or None
    await conn.send_group(gid, trajs)
    await conn.close()
    """

    def __init__(
        self,
        address: str,
        *,
        worker_id: str,
        capacity: int,
        heartbeat_interval_s: float = 2.0,
        context: Optional[zmq.asyncio.Context] = None,
    ):
        self.address, self.worker_id, self.capacity = address, worker_id, capacity
        self.heartbeat_interval_s = heartbeat_interval_s
        self.sock = _dealer(context or zmq.asyncio.Context.instance(), address, worker_id)
        self._hb_task: Optional[asyncio.Task] = None
        self._early: list[WorkerEvent] = []
        self.welcome: Optional[Welcome] = None
        self._out = _Outbox()
        self._flush_task: Optional[asyncio.Task] = None
        self._flush_waited = False  # a send_group caller waits on _flush_task; later callers of the turn don't

    async def connect(self, *, timeout_s: float = 30.0) -> Welcome:
        await self.sock.send_multipart(_hello(self.worker_id, self.capacity))
        deadline = time.monotonic() + timeout_s
        while self.welcome is None:
            left = deadline - time.monotonic()
            if left <= 0 or not await self.sock.poll(int(left * 1000)):
                raise TimeoutError(
                    f"broker at {self.address} did not answer hello from worker {self.worker_id!r} "
                    f"within {timeout_s:.0f}s"
                )
            msg = P.decode(await self.sock.recv_multipart(), allowed=P.TO_WORKER_TYPES | {P.ERROR})
            if msg.type == P.WELCOME:
                self.welcome = Welcome.from_body(msg.body)
            elif msg.type == P.ERROR:
                raise BrokerError(f"broker at {self.address} refused worker {self.worker_id!r}: {msg.body['message']}")
            else:
                self._early.extend(_to_events(msg))
        self._hb_task = asyncio.create_task(self._heartbeats())
        return self.welcome

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            await self.sock.send_multipart(P.encode(P.HEARTBEAT, {"worker_id": self.worker_id}))

    async def recv(self, *, timeout_s: Optional[float] = None) -> Optional[WorkerEvent]:
        """The next event, or None after ``timeout_s`` (None = wait forever)."""
        if self._early:
            return self._early.pop(0)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not await self.sock.poll(None if left is None else int(left * 1000)):
                return None
            msg = P.decode(await self.sock.recv_multipart(), allowed=P.TO_WORKER_TYPES | {P.ERROR})
            if msg.type == P.REHELLO:
                await self.sock.send_multipart(_hello(self.worker_id, self.capacity))
            elif msg.type == P.ERROR:
                raise BrokerError(f"broker at {self.address}: {msg.body.get('message')}")
            else:
                self._early.extend(_to_events(msg))
                if self._early:
                    return self._early.pop(0)

    def send_done(self, group_id: int, index: int) -> None:
        """Trajectory ``index`` of a running group finished (send only when ``welcome.per_trajectory``): queued,
        it leaves in this event-loop turn's ``groups`` message."""
        self._out.done.append((group_id, index))
        self._schedule_flush()

    async def send_group(
        self,
        group_id: int,
        trajectories: Optional[Sequence[Trajectory]] = None,
        *,
        aborted: bool = False,
        error: str = "",
    ) -> None:
        """Groups finished by several tasks in the same event-loop turn travel together in one ``groups``
        message: the first caller yields once to the loop, then sends what was queued meanwhile (the others
        return at once; their group is in that message, and a failed send raises in that first caller).
        Trajectories must not change after the call."""
        self._out.groups.append((group_id, trajectories, aborted, error))
        if len(self._out.groups) >= MAX_GROUPS_PER_MESSAGE:
            await self.flush()
            return
        if self._flush_waited:  # this turn's flush is on its way, a caller waits on it: it takes this group too
            return
        self._flush_waited = True
        await asyncio.shield(self._schedule_flush())  # a cancelled caller does not stop the others' groups

    def _schedule_flush(self) -> asyncio.Task:
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush_soon())
        return self._flush_task

    async def _flush_soon(self) -> None:
        await asyncio.sleep(0)
        self._flush_task, self._flush_waited = None, False
        await self.flush()

    async def flush(self) -> None:
        """Send what is queued now (one message)."""
        if self._out:
            await self.sock.send_multipart(self._out.take(), copy=False)

    async def close(self, *, say_bye: bool = True) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
        await self.flush()
        if say_bye:
            await self.sock.send_multipart(P.encode(P.BYE, {"worker_id": self.worker_id}))
        self.sock.close(linger=500 if say_bye else 0)


class BrokerClient:
    """The actor's connection (actor rank 0). One request at a time; every call has a timeout."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, context: Optional[zmq.Context] = None):
        self.address, self.timeout_s = address, timeout_s
        self.sock = _dealer(context or zmq.Context.instance(), address, f"actor-{os.getpid()}-{id(self):x}")

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
