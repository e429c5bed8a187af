"""The broker's wire protocol: every message between the broker, the agent workers and the actor.

Both ends import this module (the clients in ``client.py`` and ``worker_client.py`` use it; so does ``server.py``).

Framing: one ZeroMQ multipart message = ``[header, *frames]``. ``header`` is a msgpack map with ``"v"``
(``PROTOCOL_VERSION``) and ``"t"`` (the type, below) plus the type's fields, and ``"k"``, the run secret
(``asyncrl.cluster.auth``; sent when ``ASYNCRL_API_KEY`` is set, required by a broker that has one).

Trajectories travel in ONE shape (``asyncrl.broker.wire``): a ``groups`` table of typed columns in the header
(group columns, then ``traj``: one column per trajectory field) and raw frames holding the token data
(int32 prompt ids, int32 response ids, float32 logprobs, uint8 loss mask per trajectory), decoded zero-copy.
The trajectory's fields, their types and their order are declared once, in ``asyncrl.broker.record``.
The worker's finished groups, the actor's batch and the broker state of a checkpoint all use it; what differs
is the group columns:
  worker -> broker  ``group_id, aborted, error``            (the broker knows the rest)
  broker -> actor   ``group_id, epoch, issued_version, finished_version, aborted, item``
  checkpoint        the same as the batch
An ``item`` is the row ``[index, prompt, answers, data_source, extra]``.

Worker -> broker (DEALER, identity = worker id)          Broker -> worker
  hello   {worker_id, capacity}                           welcome  {version, group_size, hold, heartbeat_interval_s,
  hb      {worker_id}                                              per_trajectory}
  groups  {done?: [[group_id, index]], groups?: table}    issue    {rows: [[group_id, group_size, version, epoch,
          +frames: the finished groups (several per                  item], ...]}
          message) and, before them, the trajectories     control  {hold, version}
          finished in groups still running (``done``:     cancel   {group_ids}
          sent only when the welcome says                 rehello  {}   (broker does not know you: send hello)
          ``per_trajectory``: ``sample`` granularity)     shutdown {}
  bye     {worker_id}
Actor -> broker (DEALER)                                 Broker -> actor (one reply per request)
  get_batch  {step, timeout_s, actor_version | None}      batch {step, wait_s, metrics, groups: table} +frames
                                                          | timeout {step} | error {message}
  sync_begin {mode}   sync_end {version}                  ok {}
  hold_issuing {}     release_issuing {}                  ok {}   (no new prompts issued while held)
  batch_filtered {group_ids}                              ok {} | error {message}   (sample filter)
  engine_figures {running_reqs, queue_reqs,               ok {} | error {message}   (the engines' /metrics,
                  gen_tokens_per_s}                        summed; for max_inflight_groups = "auto")
  metrics    {}                                           metrics {metrics, counters, status}
  status     {}                                           status {...counts...}
  get_state  {}                                           state {state} +frames
  set_state  {state} +frames                              ok {}
  shutdown   {}                                           ok {}
  ping       {}                                           ok {}   (liveness: ``process.fail_fast_on_hang``)
A message that fails to decode, has another version or an unknown type raises ``ProtocolError``; the broker
logs and counts it and goes on. Fields are typed at this edge (``int_field``, ``float_field``,
``worker_id_field``, ``wire.column``): an integer field takes a msgpack integer in [0, ``MAX_INT``] only (a float,
``inf``, ``NaN``, a bool or a value past a signed 64-bit int is a ``ProtocolError`` naming the message type and the
field: what the broker accepts it can encode again), a reward is a number, a ``worker_id`` a short non-empty string.
A non-finite reward decodes; the core drops its group (``nonfinite_rewards``). Non-finite log-probs decode too;
the server marks their group aborted (``mark_nonfinite_logprobs``, ``stats["nonfinite_logprobs"]``): dropped too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack

from asyncrl.broker import wire
from asyncrl.broker.types import Group, Trajectory
from asyncrl.broker.wire import MAX_INT, ProtocolError, item_from_row, item_row
from asyncrl.cluster import auth

__all__ = ["MAX_INT", "ProtocolError", "item_from_row", "item_row"]

PROTOCOL_VERSION = 2

# worker -> broker
HELLO, HEARTBEAT, GROUPS, BYE = "hello", "hb", "groups", "bye"
# broker -> worker
WELCOME, ISSUE, CONTROL, CANCEL, REHELLO, SHUTDOWN = "welcome", "issue", "control", "cancel", "rehello", "shutdown"
# actor -> broker
GET_BATCH, SYNC_BEGIN, SYNC_END, METRICS, STATUS, GET_STATE, SET_STATE = (
    "get_batch",
    "sync_begin",
    "sync_end",
    "metrics",
    "status",
    "get_state",
    "set_state",
)
# broker -> actor
BATCH, TIMEOUT, OK, ERROR, STATE = "batch", "timeout", "ok", "error", "state"
# actor -> broker: a blocking eval on the shared engines stops issuing new prompts (turns go on)
HOLD_ISSUING, RELEASE_ISSUING = "hold_issuing", "release_issuing"
# actor -> broker: the batch-level sample filter removed these groups (dropped, not trained)
BATCH_FILTERED = "batch_filtered"
# actor -> broker: the engines' latest /metrics, summed (the in-flight autotuner's inputs)
ENGINE_FIGURES = "engine_figures"
# actor -> broker: liveness (actor rank 0's broker watch, on its own connection); answered ok {}, nothing else
PING = "ping"

WORKER_TYPES = frozenset({HELLO, HEARTBEAT, GROUPS, BYE})
ACTOR_TYPES = frozenset(
    {
        GET_BATCH,
        SYNC_BEGIN,
        SYNC_END,
        METRICS,
        STATUS,
        GET_STATE,
        SET_STATE,
        SHUTDOWN,
        HOLD_ISSUING,
        RELEASE_ISSUING,
        BATCH_FILTERED,
        ENGINE_FIGURES,
        PING,
    }
)
TO_WORKER_TYPES = frozenset({WELCOME, ISSUE, CONTROL, CANCEL, REHELLO, SHUTDOWN})
TO_ACTOR_TYPES = frozenset({BATCH, TIMEOUT, OK, ERROR, STATE, METRICS, STATUS})

# Bounds of the header fields a peer sends (checked at the decoder edge, before any state changes).
MAX_WORKER_ID_CHARS = 256  # ids are host/rank names; anything longer is not one of ours
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a get_batch wait longer than a week is a unit mistake
_MISSING = object()


# ---------------------------------------------------------------- header fields
def int_field(body: dict, key: str, where: str, *, lo: int = 0, hi: int = MAX_INT, default: Any = _MISSING) -> Any:
    """``body[key]`` as an integer in ``[lo, hi]`` (a msgpack int, never a float or a bool: ``1.0``, ``inf`` and
    ``NaN`` are rejected here, so no ``int()`` of them can raise later; nor past a signed 64-bit int, so the broker
    can send back what it accepted). Absent: ``default`` or an error. Raises ``ProtocolError`` naming the message
    type and the field."""
    v = body.get(key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        if default is _MISSING:
            raise ProtocolError(f"{where}: field {key!r} is required")
        return default
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"{where}: field {key!r} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def float_field(body: dict, key: str, where: str, *, lo: float, hi: float) -> float:
    """``body[key]``: a finite number in ``[lo, hi]`` (no NaN, no inf, no bool)."""
    v = body.get(key, _MISSING)
    if v is _MISSING:
        raise ProtocolError(f"{where}: field {key!r} is required")
    if type(v) not in (int, float) or not lo <= v <= hi:  # NaN fails the comparison
        raise ProtocolError(f"{where}: field {key!r} must be a finite number in [{lo:g}, {hi:g}], got {v!r:.80}")
    return float(v)


def int_list_field(body: dict, key: str, where: str, *, max_len: int) -> list[int]:
    """``body[key]``: a list of at most ``max_len`` integers in [0, ``MAX_INT``]."""
    v = body.get(key, _MISSING)
    if not isinstance(v, list):
        raise ProtocolError(f"{where}: field {key!r} must be a list of integers, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(f"{where}: field {key!r} has {len(v)} entries, at most {max_len} allowed")
    for x in v:
        if type(x) is not int or not 0 <= x <= MAX_INT:
            raise ProtocolError(f"{where}: field {key!r} must hold integers in [0, {MAX_INT}], got {x!r:.80}")
    return v


def worker_id_field(body: dict, where: str) -> Optional[str]:
    """The ``worker_id`` a worker names itself by: a non-empty string of at most ``MAX_WORKER_ID_CHARS``
    characters, or None when absent (the ZeroMQ identity is used then)."""
    v = body.get("worker_id")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_WORKER_ID_CHARS:
        raise ProtocolError(
            f"{where}: field 'worker_id' must be a non-empty string of at most "
            f"{MAX_WORKER_ID_CHARS} characters, got {v!r:.80}"
        )
    return v


# ---------------------------------------------------------------- framing
@dataclass
class Message:
    type: str
    body: dict[str, Any]
    blobs: list[Any] = field(default_factory=list)
    """Raw frames after the header (bytes, memoryview or zmq.Frame buffers)."""
    token: Any = None
    """The header's ``k``: the run secret the sender holds (``asyncrl.cluster.auth``)."""


def encode(msg_type: str, body: dict[str, Any] | None = None, blobs: Sequence[Any] = ()) -> list[Any]:
    header = {"v": PROTOCOL_VERSION, "t": msg_type}
    key = os.environ.get(auth.ENV)
    if key:
        header["k"] = key
    if body:
        header.update(body)
    return [msgpack.packb(header, use_bin_type=True), *blobs]


def decode(frames: Sequence[Any], *, allowed: frozenset[str] | None = None) -> Message:
    """Frames (bytes or zmq.Frame) -> Message. Raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty message")
    raw = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    try:
        header = msgpack.unpackb(raw[0], raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, TypeError) as e:
        raise ProtocolError(f"undecodable header: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is not a map: {type(header).__name__}")
    v = header.pop("v", None)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r}, expected {PROTOCOL_VERSION}")
    t = header.pop("t", None)
    if not isinstance(t, str) or (allowed is not None and t not in allowed):
        raise ProtocolError(f"unknown message type {t!r}")
    token = header.pop("k", None)
    return Message(t, header, raw[1:], token)


# ---------------------------------------------------------------- worker -> broker: finished groups
FinishedGroup = tuple[int, Optional[Sequence[Trajectory]], bool, str]
"""``(group_id, trajectories | None, aborted, error)``: what a worker reports of one group."""


def finished_groups_frames(entries: Sequence[FinishedGroup], done: Sequence[tuple[int, int]] = ()) -> list[Any]:
    """A worker's ``groups`` message: the finished ``entries`` and, before them, ``done``: ``(group_id,
    index)`` of trajectories finished in groups still running. All token data in the table's frames."""
    body: dict[str, Any] = {}
    frames: list = []
    if done:
        body["done"] = [[int(g), int(i)] for g, i in done]
    if entries:
        cols = {
            "group_id": [int(e[0]) for e in entries],
            "aborted": [bool(e[2]) for e in entries],
            "error": [str(e[3]) if e[3] else "" for e in entries],
        }
        body["groups"], frames = wire.pack_table(cols, [e[1] for e in entries])
    return encode(GROUPS, body, frames)


def unpack_finished_groups(
    msg: Message, *, group_size: Optional[int] = None
) -> tuple[list[tuple[int, int]], list[tuple[int, Optional[list], bool, str]]]:
    """The inverse of ``finished_groups_frames``: ``(done, entries)``; an entry's trajectories are None when it
    has none (zero-copy views of the frames otherwise). With ``group_size``, a ``done`` index must be below it."""
    where = GROUPS
    done = msg.body.get("done", [])
    if type(done) is not list or not all(
        type(d) is list and len(d) == 2 and all(type(x) is int and 0 <= x <= MAX_INT for x in d) for d in done
    ):
        raise ProtocolError(
            f"{where}: field 'done' must be a list of [group_id, index] integer pairs, got {done!r:.80}"
        )
    bad = next((i for _, i in done if i >= group_size), None) if group_size is not None else None
    if bad is not None:
        raise ProtocolError(f"{where}: field 'done' holds index {bad}, expected < group_size = {group_size}")
    table = msg.body.get("groups")
    if table is None:
        if msg.blobs:
            raise ProtocolError(f"{where}: {len(msg.blobs)} frames but no field 'groups'")
        return [tuple(d) for d in done], []
    sizes, trajs = wire.unpack_table(table, msg.blobs, where)
    n = len(sizes)
    gids = wire.column(table, "group_id", int, n, where)
    aborted = wire.column(table, "aborted", bool, n, where)
    errors = wire.column(table, "error", str, n, where)
    groups = wire.split_groups(sizes, trajs)
    return [tuple(d) for d in done], [(g, t or None, a, e) for g, t, a, e in zip(gids, groups, aborted, errors)]


def mark_nonfinite_logprobs(entries: list[tuple[int, Optional[list], bool, str]]) -> int:
    """Marks aborted, in place, every entry of ``unpack_finished_groups`` (not aborted already) with a trajectory
    whose ``rollout_logprobs`` hold NaN or inf, its error naming the group, the trajectory and the column: the core
    drops it as an aborted group (``rollout_buffer.unused_groups``), never trains on it. Returns how many."""
    n = 0
    for k, (gid, trajs, aborted, _) in enumerate(entries):
        bad = None if aborted or not trajs else wire.nonfinite_logprobs(trajs)
        if bad is not None:
            why = f"dropped by the broker: {GROUPS}: group {gid}: column 'rollout_logprobs' of trajectory {bad}"
            entries[k] = (gid, trajs, True, f"{why} holds NaN or inf")
            n += 1
    return n


# ---------------------------------------------------------------- broker -> actor (batch) and checkpoints
def pack_groups(groups: Sequence[Group]) -> tuple[dict, list]:
    """Groups -> ``(table, frames)`` (the ``batch`` message and the broker state). Unchanged trajectories
    decoded from received frames travel as slices of those frames (no copy)."""
    cols = {
        "group_id": [g.group_id for g in groups],
        "epoch": [g.epoch for g in groups],
        "issued_version": [g.issued_version for g in groups],
        "finished_version": [g.finished_version for g in groups],
        "aborted": [bool(g.aborted) for g in groups],
        "item": [item_row(g.item) for g in groups],
    }
    return wire.pack_table(cols, [g.trajectories for g in groups])


def unpack_groups(table: Any, frames: Sequence[Any], where: str = BATCH) -> list[Group]:
    sizes, trajs = wire.unpack_table(table, frames, where)
    n = len(sizes)
    ints = [wire.column(table, k, int, n, where) for k in ("group_id", "epoch", "issued_version", "finished_version")]
    aborted = wire.column(table, "aborted", bool, n, where)
    items = table.get("item")
    if type(items) is not list or len(items) != n:
        raise ProtocolError(f"{where}: column 'item' must be a list of {n} prompt items")
    return [
        Group(gid, item_from_row(it, where), epoch, ts, iv, fv, ab)
        for gid, epoch, iv, fv, ab, it, ts in zip(*ints, aborted, items, wire.split_groups(sizes, trajs))
    ]


def pack_state(state: dict) -> tuple[dict, list]:
    """``BrokerCore.state_dict()`` -> (header map, frames)."""
    table, frames = pack_groups(state["buffered"])
    body = {
        "counters": dict(state.get("counters", {})),
        "version": state["version"],
        "next_group_id": state["next_group_id"],
        "dataloader": state["dataloader"],
        "queued": [[item_row(it), e] for it, e in state["queued"]],
        "inflight": [[item_row(it), e] for it, e in state["inflight"]],
        "buffered": table,
    }
    return body, frames


def _epoch(e: Any) -> int:
    if type(e) is not int or not 0 <= e <= MAX_INT:
        raise ProtocolError(f"broker state: an epoch must be an integer in [0, {MAX_INT}], got {e!r:.80}")
    return e


def unpack_state(body: dict, blobs: Sequence[Any]) -> dict:
    where = "broker state"
    try:
        dl = dict(body["dataloader"])
        for k in ("epoch", "position", "seed", "num_prompts"):
            int_field(dl, k, f"{where}: dataloader")
        out = {
            "version": int_field(body, "version", where),
            "next_group_id": int_field(body, "next_group_id", where),
            "dataloader": dl,
            "queued": [(item_from_row(it, where), _epoch(e)) for it, e in body["queued"]],
            "inflight": [(item_from_row(it, where), _epoch(e)) for it, e in body["inflight"]],
            "buffered": unpack_groups(body["buffered"], blobs, where),
        }
        if "counters" in body:  # absent in checkpoints written before the counters were saved
            c = dict(body["counters"])
            out["counters"] = {str(k): int_field(c, k, f"{where}: counters") for k in c}
        return out
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad broker state: {e!r}") from None


def state_to_bytes(body: dict, blobs: Sequence[Any]) -> bytes:
    """A self-contained blob (what the runner writes into its checkpoint)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "state": body, "blobs": [bytes(b) for b in blobs]}, use_bin_type=True)


def state_from_bytes(data: bytes) -> tuple[dict, list[bytes]]:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if d.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"broker checkpoint of protocol version {d.get('v')!r}, expected {PROTOCOL_VERSION} "
                "(written by another version of asyncrl)"
            )
        return d["state"], d["blobs"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad broker checkpoint: {e!r}") from None
