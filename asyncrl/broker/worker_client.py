"""The agent workers' connections to the broker: ``WorkerConnection`` (blocking) and ``AsyncWorkerConnection``
(asyncio, the production worker's). Each owns one DEALER socket that **connects** to the broker's ROUTER
(the actor's ``BrokerClient`` is in ``asyncrl.broker.client``).

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
same methods as coroutines and heartbeats from a background task. Neither is thread-safe. The asyncio
connection (the production worker's) also watches its TCP link: once it has stayed closed
``BROKER_LOST_AFTER_HEARTBEATS`` heartbeat intervals (at least 5 s), ``recv`` raises ``BrokerLost`` naming the
broker, so a worker whose broker died (and never sent ``shutdown``) stops instead of waiting forever.

Batching: finished groups (and ``done`` notices) travel as ``groups`` messages (several groups, one header,
one table, their token frames; ``protocol``). The blocking connection queues what is sent with
``flush=False`` (and every ``send_done``) until ``flush()``, ``poll()``, any other send or
``MAX_GROUPS_PER_MESSAGE`` queued; the asyncio connection coalesces by itself what finished in the same
event-loop turn. Order is kept: what is queued always leaves before any later message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from asyncrl.broker import protocol as P
from asyncrl.broker.core import BrokerError
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


def dealer(ctx: zmq.Context, address: str, identity: Optional[str]) -> zmq.Socket:
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
        self.sock = dealer(context or zmq.Context.instance(), address, worker_id)
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

    def close(self, *, say_bye: bool = True) -> None:
        self.flush()
        if say_bye:
            try:
                self.sock.send_multipart(P.encode(P.BYE, {"worker_id": self.worker_id}), zmq.NOBLOCK)
            except zmq.Again:
                pass
        self.sock.close(linger=500 if say_bye else 0)


BROKER_LOST_AFTER_HEARTBEATS = 5
"""An asyncio worker whose connection to the broker stays closed this many heartbeat intervals (at least 5 s)
stops with ``BrokerLost``: the broker process is gone, and nobody would tell the worker to shut down."""


class BrokerLost(ConnectionError):
    """The broker's connection closed and did not come back (``AsyncWorkerConnection.recv``)."""


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
        self.sock = dealer(context or zmq.asyncio.Context.instance(), address, worker_id)
        self._hb_task: Optional[asyncio.Task] = None
        self._early: list[WorkerEvent] = []
        self.welcome: Optional[Welcome] = None
        self._out = _Outbox()
        self._flush_task: Optional[asyncio.Task] = None
        self._flush_waited = False  # a send_group caller waits on _flush_task; later callers of the turn don't
        self.broker_lost_after_s = max(5.0, BROKER_LOST_AFTER_HEARTBEATS * heartbeat_interval_s)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._link_task: Optional[asyncio.Task] = None
        self._down_since: Optional[float] = None  # when the TCP connection to the broker closed (None: it is up)

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
        self._link_task = asyncio.create_task(self._watch_link())
        return self.welcome

    async def _watch_link(self) -> None:
        """The socket's connect/disconnect events (ZeroMQ reconnects by itself; a dead broker never comes back)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and self._down_since is None:
                self._down_since = time.monotonic()
            elif event == zmq.EVENT_CONNECTED:
                self._down_since = None

    def _check_link(self) -> None:
        down = self._down_since
        if down is not None and time.monotonic() - down > self.broker_lost_after_s:
            raise BrokerLost(
                f"broker at {self.address}: its connection closed {time.monotonic() - down:.0f} s ago and did not "
                f"come back (the broker process died, or its host is unreachable); worker {self.worker_id!r} stops"
            )

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            await self.sock.send_multipart(P.encode(P.HEARTBEAT, {"worker_id": self.worker_id}))

    async def recv(self, *, timeout_s: Optional[float] = None) -> Optional[WorkerEvent]:
        """The next event, or None after ``timeout_s`` (None = wait forever). Raises ``BrokerLost`` once the
        broker's connection has stayed closed ``broker_lost_after_s``."""
        if self._early:
            return self._early.pop(0)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check_link()  # raises BrokerLost
            left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            if not await self.sock.poll(int(left * 1000)):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
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
        for task in (self._hb_task, self._link_task):
            if task is not None:
                task.cancel()
        await self.flush()
        if say_bye:
            await self.sock.send_multipart(P.encode(P.BYE, {"worker_id": self.worker_id}))
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=500 if say_bye else 0)
