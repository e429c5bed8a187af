"""The broker process's shell: one ZeroMQ ROUTER socket around ``BrokerCore``. Moves bytes only.

Contract
- Socket: the broker **binds** one ROUTER socket (``bind``, default ``tcp://127.0.0.1:0``: the OS
  picks the port; ``address`` is the resolved endpoint, published by ``__main__`` in an address file).
  Agent workers and the actor **connect** DEALER sockets (``worker_client.py``, ``client.py``); workers set
  their ZMQ identity to their worker id, so a reconnecting worker keeps its identity.
- High-water marks are 0 (unlimited) on the ROUTER: what can queue is bounded by the admission limits (issues <=
  in-flight groups, at most one batch per actor request), so nothing is ever dropped by ZeroMQ. ``ROUTER_MANDATORY``
  is on: a send to a peer that vanished raises, and that worker is treated as gone (its groups are re-issued).
  ``MAXMSGSIZE`` is ``max_message_bytes`` (``serve.max_message_bytes``: twice a run's largest legitimate frame): a
  peer sending a bigger frame is disconnected by ZeroMQ before it is buffered, secret or not (the secret is checked
  only on a whole message); its message is dropped, the broker goes on.
- Slow joiners: nothing is published; the broker only sends to a worker after its ``hello``
  (request/reply style), so a late connection loses nothing. A worker the broker does not know
  (e.g. declared dead after missed heartbeats) gets ``rehello`` and re-registers.
- One thread, a poll loop: every ready message is drained first (up to ``MAX_MESSAGES_PER_ROUND``);
  finished groups (``groups`` messages) are collected and reach the core in ONE ``groups_finished`` call
  per round (or before any other message, so the order of events is kept; a message's ``done`` notices,
  trajectories finished in running groups, reach the core first, in order);
  every other message becomes one core call. Then the core's outputs (issues, batched per worker,
  cancellations, a ready batch, control changes) are sent. A ``status`` request is a barrier: those outputs
  are sent before its answer, so a peer that reads up to that answer on one connection has received every
  output of the messages it sent before it (else a ``status`` handled in the same round as a ``hello``
  would be answered before that worker's ``issue``).
  ``core.tick()`` runs every ``tick_s`` (heartbeat expiry, the no-data warning).
- A malformed, unknown or other-version message is logged and counted
  (``stats["malformed"]``), answered with ``error`` when the sender is known, never fatal. Every field is
  checked before the core is called, so a rejected message never moves the core's counters
  (``tests/integration/test_broker_fuzz.py`` fuzzes this in process and against the process).
- ``stop()`` ends the loop after the round (workers are told ``shutdown``); the process body (``serve.py``) calls
  it from its signal handlers and its watch of the supervising parent, which runs at every tick (``on_tick``).
- With a run secret (``ASYNCRL_API_KEY``, ``asyncrl.cluster.auth``) a message without it is refused the same
  way before it reaches the core (``stats["unauthenticated"]``).

    server = BrokerServer(core, bind="tcp://127.0.0.1:0", heartbeat_interval_s=2.0)
    print(server.address); server.serve_forever()   # returns after an actor ``shutdown``
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from asyncrl.broker import protocol as P
from asyncrl.broker.core import BrokerCore, BrokerError
from asyncrl.cluster import auth

log = logging.getLogger("asyncrl.broker")

MAX_MESSAGES_PER_ROUND = 1024  # bound the work between two flushes of the core's outputs
MAX_WORKER_CAPACITY = 1_000_000  # concurrent trajectories one worker may declare; more is a corrupt hello
MAX_MESSAGE_BYTES = 1 << 30  # frame cap without a config (tests): over any test's; a run's: serve.max_message_bytes
SYNC_MODES = ("retract", "in_place", "drain", "abort")  # the pause modes a sync may announce (rollout.pause_mode)


_ALLOWED = P.WORKER_TYPES | P.ACTOR_TYPES


@dataclass
class _PendingBatch:
    ident: bytes
    step: int
    deadline: float


class BrokerServer:
    def __init__(
        self,
        core: BrokerCore,
        *,
        bind: str = "tcp://127.0.0.1:0",
        heartbeat_interval_s: float = 2.0,
        tick_s: float = 0.2,
        context: Optional[zmq.Context] = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        self.core = core
        self.heartbeat_interval_s = heartbeat_interval_s
        self.shutdown_grace_s = max(2.0, 2 * heartbeat_interval_s)  # the shutdown's wait for byes (``_close``)
        self.tick_s = tick_s
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.sock.bind(bind)
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stats: Counter[str] = Counter()
        self.secret = auth.current()
        """The run secret every message must carry (``asyncrl.cluster.auth``); None: not checked."""
        self._worker_ident: dict[str, bytes] = {}
        self._pending: Optional[_PendingBatch] = None
        self._control_sent: dict[str, tuple[bool, int]] = {}
        self._stop = False
        self.on_tick: Callable[[], None] = lambda: None
        """Called every ``tick_s``, before the core's tick (the process body watches its parent there)."""
        self._last_tick = 0.0
        self._finished: list[tuple[int, Any, bool]] = []  # finished groups received, not yet given to the core
        self._item_rows: dict[int, tuple[Any, list]] = {}  # prompt index -> (item, its wire row)

    # ----------------------------------------------------------------- loop
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        log.info("broker listening on %s", self.address)
        while not self._stop:
            self.serve_once(poller, timeout_s=self.tick_s)
        self._close()

    def serve_once(self, poller: zmq.Poller, *, timeout_s: float) -> None:
        """One round of the loop: wait up to ``timeout_s`` for messages, handle every ready one, tick when due,
        send the core's outputs. (``serve_forever`` repeats it; tests drive it one round at a time.)"""
        events = dict(poller.poll(timeout=int(timeout_s * 1000)))
        if self.sock in events:
            # drain every ready message first; finished groups reach the core in one call per round
            for _ in range(MAX_MESSAGES_PER_ROUND):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
                if self._stop:
                    break
            self._finish_pending()
        now = time.monotonic()
        if now - self._last_tick >= self.tick_s:
            self._last_tick = now
            self.on_tick()
            self.core.tick()
            known = self.core.workers()
            for wid in [w for w in self._worker_ident if w not in known]:  # expired by missed heartbeats
                self._worker_ident.pop(wid)
                self._control_sent.pop(wid, None)
                self.stats["workers_lost"] += 1
        self._flush()

    def stop(self, *_: Any) -> None:
        """End the loop after this round (a signal handler may call it: it only sets a flag)."""
        self._stop = True

    def _close(self) -> None:
        """Tell every worker to shut down; wait (``shutdown_grace_s``) for their byes, the proof it arrived: a message
        still queued in ZeroMQ's thread when the process exits is lost, and the worker would keep its rank alive."""
        told = list(self._worker_ident)
        for wid in told:
            self._send_worker(wid, P.SHUTDOWN, {})
        deadline = time.monotonic() + self.shutdown_grace_s
        while any(w in self._worker_ident for w in told):  # a bye removes its worker (``_worker_gone``)
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                break
            self._handle(self.sock.recv_multipart(copy=False))
        silent = ", ".join(w for w in told if w in self._worker_ident)
        end = f"no bye from [{silent}]" if silent else "every one said bye"
        (log.warning if silent else log.info)("broker: shut down: %d workers told, %s", len(told), end)
        self.sock.close(linger=1000)

    # ----------------------------------------------------------------- sending
    def _send(self, ident: bytes, msg_type: str, body: Optional[dict] = None, blobs=()) -> bool:
        frames = [ident, *P.encode(msg_type, body, blobs)]
        try:
            self.sock.send_multipart(frames, copy=len(blobs) == 0)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def _send_worker(self, wid: str, msg_type: str, body: dict) -> None:
        ident = self._worker_ident.get(wid)
        if ident is None or not self._send(ident, msg_type, body):
            self._worker_gone(wid, "unreachable")

    def _worker_gone(self, wid: str, why: str) -> None:
        self._worker_ident.pop(wid, None)
        self._control_sent.pop(wid, None)
        gone = self.core.remove_worker(wid)
        self.stats["workers_lost"] += 1
        log.warning("worker %s gone (%s); %d in-flight groups re-queued", wid, why, len(gone))

    def _flush(self) -> None:
        core = self.core
        cancels: dict[str, list[int]] = {}
        for wid, gid in core.take_cancelled():
            cancels.setdefault(wid, []).append(gid)
        for wid, gids in cancels.items():
            if wid in self._worker_ident:
                self._send_worker(wid, P.CANCEL, {"group_ids": gids})
        self._flush_control()
        for _ in range(8):  # a lost worker re-queues groups, which issues again
            issues = core.take_issues()
            if not issues:
                break
            self._send_issues(issues)
        drops = core.take_drops()
        for d in drops if log.isEnabledFor(logging.DEBUG) else ():
            log.debug(
                "dropped group %d (prompt %d, epoch %d): %s%s",
                d.group_id,
                d.item.index,
                d.epoch,
                d.reason,
                " -> retried" if d.retried else "",
            )
        self._flush_batch()

    def _send_issues(self, issues: list) -> None:
        """One ``issue`` message per worker: ``[group_id, group_size, version, epoch, item row]`` each."""
        per_worker: dict[str, list] = {}
        cache = self._item_rows
        for iss in issues:
            it = iss.item
            hit = cache.get(it.index)
            if hit is None or hit[0] is not it:
                hit = cache[it.index] = (it, P.item_row(it))
            lst = per_worker.get(iss.worker_id)
            if lst is None:
                lst = per_worker[iss.worker_id] = []
            lst.append([iss.group_id, iss.group_size, iss.version, iss.epoch, hit[1]])
        for wid, rows in per_worker.items():
            if wid in self._worker_ident:  # else: issued to a worker that just vanished (re-queued)
                self._send_worker(wid, P.ISSUE, {"rows": rows})

    def _flush_control(self) -> None:
        control = (self.core.hold_new_turns, self.core.version)
        for wid in list(self._worker_ident):
            if self._control_sent.get(wid) != control:
                self._control_sent[wid] = control
                self._send_worker(wid, P.CONTROL, {"hold": control[0], "version": control[1]})

    def _flush_batch(self) -> None:
        pend = self._pending
        if pend is None:
            return
        try:
            batch = self.core.take_batch()
        except BrokerError as e:
            self._pending = None
            self._send(pend.ident, P.ERROR, {"message": str(e), "kind": type(e).__name__})
            return
        if batch is not None:
            self._pending = None
            table, frames = P.pack_groups(batch.groups)
            body = {"step": batch.step, "wait_s": batch.wait_s, "metrics": batch.metrics, "groups": table}
            self._send(pend.ident, P.BATCH, body, frames)
        elif time.monotonic() >= pend.deadline:
            self._pending = None
            self.core.cancel_request()
            self._send(pend.ident, P.TIMEOUT, {"step": pend.step})

    # ----------------------------------------------------------------- receiving
    def _handle(self, frames: list) -> None:
        ident = bytes(frames[0].buffer) if frames else b""
        try:
            msg = P.decode(frames[1:], allowed=_ALLOWED)
            if not auth.secret_matches(msg.token, self.secret):
                self._refuse(ident, msg.type)
                return
            if msg.type in P.WORKER_TYPES:
                self._on_worker(ident, msg)
            else:
                self._finish_pending()
                self._on_actor(ident, msg)
        except (P.ProtocolError, KeyError, TypeError, ValueError, OverflowError) as e:  # bad fields too
            self.stats["malformed"] += 1
            log.warning("malformed message from %r (%d so far): %s", ident, self.stats["malformed"], e)
            if ident:
                self._send(ident, P.ERROR, {"message": f"malformed message: {e}", "kind": "ProtocolError"})

    def _refuse(self, ident: bytes, msg_type: str) -> None:
        """A message without the run secret: counted, answered with an error, nothing else happens."""
        self.stats["unauthenticated"] += 1
        n = self.stats["unauthenticated"]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a flood does not flood the log
            log.warning("refused %r from %r without the run secret (%d so far)", msg_type, ident, n)
        if ident:
            self._send(
                ident,
                P.ERROR,
                {"message": "unauthenticated: this broker needs the run secret (ASYNCRL_API_KEY)", "kind": "AuthError"},
            )

    def _finish_pending(self) -> None:
        """Hand the finished groups received so far to the core (one call: one admission check)."""
        if self._finished:
            reports, self._finished = self._finished, []
            known = self.core.groups_finished(reports)
            late = len(known) - sum(known)
            if late:
                self.stats["late_reports"] += late

    def _on_worker(self, ident: bytes, msg: P.Message) -> None:
        wid = P.worker_id_field(msg.body, msg.type) or ident.decode("utf-8", "replace")
        self.stats["worker_" + msg.type] += 1
        if msg.type == P.GROUPS and wid in self._worker_ident and self.core.heartbeat(wid):
            self._on_groups(wid, msg)
            return
        self._finish_pending()  # every other message sees the groups that arrived before it
        if msg.type == P.HELLO:
            self._on_hello(ident, wid, msg.body)
        elif wid not in self._worker_ident:
            if msg.type != P.BYE:
                self.stats["unknown_worker"] += 1
                self._send(ident, P.REHELLO, {})
        elif msg.type == P.BYE and self._stop:  # the answer to the shutdown (``_close``): the core is done
            self._worker_ident.pop(wid, None)
        elif msg.type == P.BYE:
            self._worker_gone(wid, "said bye")
        elif not self.core.heartbeat(wid):  # the core forgot it (cannot happen while the maps agree)
            self._worker_ident.pop(wid, None)
            self._send(ident, P.REHELLO, {})

    def _on_hello(self, ident: bytes, wid: str, b: dict) -> None:
        cap = P.int_field(b, "capacity", P.HELLO, lo=1, hi=MAX_WORKER_CAPACITY)
        core = self.core
        self._worker_ident[wid] = ident
        self._control_sent[wid] = (core.hold_new_turns, core.version)
        welcome = {
            "version": core.version,
            "group_size": core.s.group_size,
            "hold": core.hold_new_turns,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "per_trajectory": core.s.submission_granularity == "sample",
        }
        self._send(ident, P.WELCOME, welcome)
        core.add_worker(wid, capacity=cap)
        log.info("worker %s joined (capacity %d)", wid, cap)

    def _on_groups(self, wid: str, msg: P.Message) -> None:
        """Trajectories finished in running groups (``done``: frees their slots now), then finished groups
        (collected: they reach the core in one call per round). Everything is decoded before the core moves."""
        done, entries = P.unpack_finished_groups(msg, group_size=self.core.s.group_size)
        self.stats["nonfinite_logprobs"] += P.mark_nonfinite_logprobs(entries)  # dropped, never trained on
        if done:
            self._finish_pending()
            for gid, index in done:
                if not self._foreign(wid, gid) and not self.core.trajectory_finished(gid, index):
                    self.stats["late_reports"] += 1
        for gid, trajs, aborted, error in entries:
            if self._foreign(wid, gid):
                continue
            if aborted and error:
                log.warning("worker %s aborted group %s: %.200s", wid, gid, error)
            self._finished.append((gid, trajs, aborted))

    def _foreign(self, wid: str, gid: int) -> bool:
        """A report for a group in flight on ANOTHER worker: ignored and counted (``foreign_reports``), so a
        confused or rogue peer cannot finish -- and get trained -- groups it was never issued."""
        owner = self.core.owner(gid)
        if owner is None or owner == wid:
            return False
        self.stats["foreign_reports"] += 1
        log.warning("worker %s reported group %d, which is in flight on worker %s; ignored", wid, gid, owner)
        return True

    def _on_actor(self, ident: bytes, msg: P.Message) -> None:
        self.stats["actor_" + msg.type] += 1
        try:
            reply = self._actor_handlers[msg.type](self, ident, msg.body, msg.blobs)
            if reply is not None:
                self._send(ident, *reply)
        except (BrokerError, ValueError) as e:
            if isinstance(e, P.ProtocolError):
                raise
            if msg.type == P.GET_BATCH:
                self._pending = None
            self.stats["actor_errors"] += 1
            self._send(ident, P.ERROR, {"message": str(e), "kind": type(e).__name__})
        except (KeyError, TypeError) as e:
            raise P.ProtocolError(f"{msg.type}: {e!r}") from None

    # One handler per actor request: (server, ident, body, frames) -> the reply (type, body[, frames]) or None.
    def _get_batch(self, ident: bytes, b: dict, _frames) -> None:
        if self._pending is not None and self._pending.ident != ident:
            raise P.ProtocolError("get_batch: another actor request is already pending")
        step = P.int_field(b, "step", P.GET_BATCH)
        timeout_s = P.float_field(b, "timeout_s", P.GET_BATCH, lo=0.0, hi=P.MAX_TIMEOUT_S)
        actor_version = P.int_field(b, "actor_version", P.GET_BATCH, default=None)
        self._pending = _PendingBatch(ident, step, time.monotonic() + timeout_s)
        self.core.request_batch(step, actor_version=actor_version)
        self._flush_batch()

    def _sync_begin(self, _ident, b: dict, _frames) -> tuple:
        mode = b.get("mode", "retract")
        if mode not in SYNC_MODES:
            raise P.ProtocolError(f"sync_begin: field 'mode' must be one of {list(SYNC_MODES)}, got {mode!r:.80}")
        self.core.sync_begin(mode)
        self._flush_control()  # the hold is on its way to every worker before the actor hears OK
        return (P.OK,)

    def _sync_end(self, _ident, b: dict, _frames) -> tuple:
        self.core.sync_end(P.int_field(b, "version", P.SYNC_END))
        self._flush_control()
        return (P.OK,)

    def _batch_filtered(self, _ident, b: dict, _frames) -> tuple:
        limit = self.core.s.rollout_batch_size
        self.core.batch_filtered(P.int_list_field(b, "group_ids", P.BATCH_FILTERED, max_len=limit))
        return (P.OK,)

    def _engine_figures(self, _ident, b: dict, _frames) -> tuple:
        figures = {k: float(b[k]) for k in ("running_reqs", "queue_reqs", "gen_tokens_per_s")}
        bad = [k for k, v in figures.items() if not v >= 0]
        if bad:
            raise ValueError(f"engine_figures: {bad} must be numbers >= 0, got {figures}")
        self.core.engine_figures(**figures)
        return (P.OK,)

    def _metrics(self, _ident, _b, _frames) -> tuple:
        core = self.core
        return P.METRICS, {"metrics": core.last_metrics, "counters": dict(core.counters), "status": self.status()}

    def _status(self, _ident, _b, _frames) -> tuple:
        self._flush()  # a barrier: what the messages before it caused is sent before its answer
        return P.STATUS, self.status()

    def _get_state(self, _ident, _b, _frames) -> tuple:
        body, frames = P.pack_state(self.core.state_dict())
        return P.STATE, {"state": body}, frames

    def _set_state(self, _ident, b: dict, frames) -> tuple:
        self.core.load_state_dict(P.unpack_state(b["state"], frames))
        return (P.OK,)

    def _shutdown(self, _ident, _b, _frames) -> tuple:
        self._stop = True
        return (P.OK,)

    _actor_handlers = {
        P.GET_BATCH: _get_batch,
        P.SYNC_BEGIN: _sync_begin,
        P.SYNC_END: _sync_end,
        P.HOLD_ISSUING: lambda self, *_: (self.core.hold_issuing(), (P.OK,))[1],
        P.RELEASE_ISSUING: lambda self, *_: (self.core.release_issuing(), (P.OK,))[1],
        P.BATCH_FILTERED: _batch_filtered,
        P.ENGINE_FIGURES: _engine_figures,
        P.METRICS: _metrics,
        P.STATUS: _status,
        P.GET_STATE: _get_state,
        P.SET_STATE: _set_state,
        P.SHUTDOWN: _shutdown,
        P.PING: lambda self, *_: (P.OK,),
    }

    def status(self) -> dict:
        c = self.core
        return {
            "version": c.version,
            "num_inflight_groups": c.num_inflight_groups,
            "num_inflight_samples": c.num_inflight_samples,
            "num_buffered_groups": c.num_buffered_groups,
            "workers": c.workers(),
            "hold": c.hold_new_turns,
            "waiting_step": c.waiting_step,
            "issuing_held": c.issuing_held,
            "failure": None if c.failure is None else str(c.failure),
            "counters": dict(c.counters),
            "stats": dict(self.stats),
        }
