"""The broker's wire protocol: every message between the broker, the agent workers and the actor.

Both ends import this module (the clients in ``client.py`` use it; so does ``server.py``).

Framing: one ZeroMQ multipart message = ``[header, *blobs]``. ``header`` is a msgpack map with
``"v"`` (``PROTOCOL_VERSION``) and ``"t"`` (the type, below) plus the type's fields. Token data
never goes through msgpack lists: each trajectory's arrays travel as one raw blob frame, laid out
``prompt_ids int32[np] | response_ids int32[nr] | rollout_logprobs float32[nr] |
weight_versions int32[nw] | loss_mask uint8[nr]`` (little-endian; ``nw`` is 0 or ``nr``), and its
scalar fields as a small map in the header (only the ones that differ from the dataclass default).
A group's trajectories share one blob frame; a meta's ``o`` is its byte offset in it. Decoding is zero-copy
(``np.frombuffer`` over the frame): decoded token fields are numpy arrays unless ``as_lists``.

Worker -> broker (DEALER, identity = worker id)          Broker -> worker
  hello      {worker_id, capacity}                        welcome  {version, group_size, hold, heartbeat_interval_s}
  hb         {worker_id}                                  issue    {groups: [{group_id, group_size, version,
                                                                              epoch, item}, ...]}
  traj       {group_id, index, traj: meta | None} +blob?  control  {hold, version}
  group      {group_id, aborted, error, trajs: [meta]}    cancel   {group_ids}
             +one blob for the group (trajs = [] -> use    rehello  {}   (broker does not know you: send hello)
             the trajectories sent one by one, ``traj``)  shutdown {}
  bye        {worker_id}
Actor -> broker (DEALER)                                 Broker -> actor (one reply per request)
  get_batch  {step, timeout_s, actor_version | None}      batch {step, wait_s, metrics, groups: [group]} +blobs
                                                          | timeout {step} | error {message}
  sync_begin {mode}   sync_end {version}                  ok {}
  metrics    {}                                           metrics {metrics, counters, status}
  status     {}                                           status {...counts...}
  get_state  {}                                           state {state} +blobs
  set_state  {state} +blobs                               ok {}
  shutdown   {}                                           ok {}
A ``group`` map is ``{group_id, epoch, issued_version, finished_version, aborted, item, trajs: [meta]}``;
an ``item`` map is ``{index, prompt, answers, data_source, extra}``; a trajectory ``meta`` carries
``b`` (its blob's index in the message's blob frames) and the lengths ``np``, ``nr``, ``nw``.
A message that fails to decode, has another version or an unknown type raises ``ProtocolError``;
the broker logs and counts it and goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from asyncrl.broker.types import Group, PromptItem, Trajectory

PROTOCOL_VERSION = 1

# worker -> broker
HELLO, HEARTBEAT, TRAJ, GROUP, BYE = "hello", "hb", "traj", "group", "bye"
# broker -> worker
WELCOME, ISSUE, CONTROL, CANCEL, REHELLO, SHUTDOWN = "welcome", "issue", "control", "cancel", "rehello", "shutdown"
# actor -> broker
GET_BATCH, SYNC_BEGIN, SYNC_END, METRICS, STATUS, GET_STATE, SET_STATE = (
    "get_batch", "sync_begin", "sync_end", "metrics", "status", "get_state", "set_state")
# broker -> actor
BATCH, TIMEOUT, OK, ERROR, STATE = "batch", "timeout", "ok", "error", "state"

WORKER_TYPES = frozenset({HELLO, HEARTBEAT, TRAJ, GROUP, BYE})
ACTOR_TYPES = frozenset({GET_BATCH, SYNC_BEGIN, SYNC_END, METRICS, STATUS, GET_STATE, SET_STATE, SHUTDOWN})
TO_WORKER_TYPES = frozenset({WELCOME, ISSUE, CONTROL, CANCEL, REHELLO, SHUTDOWN})
TO_ACTOR_TYPES = frozenset({BATCH, TIMEOUT, OK, ERROR, STATE, METRICS, STATUS})


class ProtocolError(ValueError):
    """A malformed message, a message of another protocol version, or an unknown type."""


@dataclass
class Message:
    type: str
    body: dict[str, Any]
    blobs: list[Any] = field(default_factory=list)
    """Raw frames after the header (bytes, memoryview or zmq.Frame buffers)."""


def encode(msg_type: str, body: dict[str, Any] | None = None, blobs: Sequence[Any] = ()) -> list[Any]:
    header = {"v": PROTOCOL_VERSION, "t": msg_type}
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
    return Message(t, header, raw[1:])


# ---------------------------------------------------------------- items, trajectories, groups
def item_to_wire(item: PromptItem) -> dict:
    return {"index": item.index, "prompt": item.prompt, "answers": list(item.answers),
            "data_source": item.data_source, "extra": item.extra}


def item_from_wire(d: dict) -> PromptItem:
    try:
        return PromptItem(index=int(d["index"]), prompt=d["prompt"], answers=list(d.get("answers", [])),
                          data_source=d.get("data_source", ""), extra=dict(d.get("extra", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad prompt item: {e!r}") from None


_SCALAR_DEFAULTS = {"reward": 0.0, "min_version": 0, "max_version": 0, "num_turns": 0, "num_tool_calls": 0,
                    "num_retractions": 0, "finish_reason": "", "truncated": False, "aborted": False, "error": "",
                    "timings": {}, "extra": {}}


def _arr(x, dtype) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=dtype)


_ARRAY_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions")


def _materialize(wire) -> tuple[np.ndarray, ...]:
    base, start, _, (n_p, n_r, n_w) = wire
    o_r = start + 4 * n_p
    o_lp = o_r + 4 * n_r
    o_wv = o_lp + 4 * n_r
    return (np.frombuffer(base, "<i4", n_p, start), np.frombuffer(base, "<i4", n_r, o_r),
            np.frombuffer(base, np.uint8, n_r, o_wv + 4 * n_w), np.frombuffer(base, "<f4", n_r, o_lp),
            np.frombuffer(base, "<i4", n_w, o_wv))


def _plain_trajectory(kw: dict) -> Trajectory:
    return Trajectory(**kw)


class WireTrajectory(Trajectory):
    """A ``Trajectory`` decoded from the wire. Its token fields are read-only numpy views of the received
    frame, created on first access (so a broker that only forwards it never builds them). Pickling or
    ``copy.deepcopy`` gives a plain ``Trajectory`` with copied arrays."""

    def __getattr__(self, name: str):
        d = self.__dict__
        if name in _ARRAY_FIELDS and "_wire" in d:
            arrays = _materialize(d["_wire"])
            d["_wire_arrays"] = arrays
            for f, a in zip(_ARRAY_FIELDS, arrays):
                d.setdefault(f, a)  # a field assigned before first access keeps its new value
            return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __reduce_ex__(self, protocol):
        return _plain_trajectory, ({f.name: getattr(self, f.name) for f in dataclasses.fields(Trajectory)},)


def _unchanged(t: Trajectory, wire) -> bool:
    """True when no token field of a WireTrajectory was replaced since decoding."""
    d = t.__dict__
    mat = d.get("_wire_arrays")
    for i, f in enumerate(_ARRAY_FIELDS):
        v = d.get(f)
        if v is not None and (mat is None or v is not mat[i]):
            return False
    return True


def _reusable_blob(t: Trajectory):
    """The bytes a decoded trajectory came from, if its token arrays are still exactly those views."""
    wire = t.__dict__.get("_wire")
    if wire is None or not _unchanged(t, wire):
        return None
    base, start, size, _ = wire
    return base[start:start + size]


def _scalar_meta(t: Trajectory) -> dict:
    meta = {}
    for k, d in _SCALAR_DEFAULTS.items():
        v = getattr(t, k)
        if v != d:
            meta[k] = v
    if "reward" in meta:
        meta["reward"] = float(meta["reward"])
    return meta


def pack_trajectory(t: Trajectory, blob_index: int) -> tuple[dict, Any]:
    """-> (meta for the header, one blob with all token arrays). Scalars equal to their default are omitted.
    A trajectory decoded by ``unpack_trajectory`` and left unchanged re-uses its bytes (no copy)."""
    meta = _scalar_meta(t)
    blob = _reusable_blob(t)
    if blob is not None:
        n_p, n_r, n_w = t.__dict__["_wire"][3]
        meta.update(b=blob_index, np=n_p, nr=n_r, nw=n_w)
        return meta, blob
    p = _arr(t.prompt_ids, "<i4")
    r = _arr(t.response_ids, "<i4")
    lp = _arr(t.rollout_logprobs, "<f4")
    wv = _arr(t.weight_versions, "<i4")
    lm = _arr(t.loss_mask, np.uint8)
    meta.update(b=blob_index, np=len(p), nr=len(r), nw=len(wv))
    return meta, b"".join([p.data, r.data, lp.data, wv.data, lm.data])


def unpack_trajectory(meta: dict, blob: Any, *, as_lists: bool = False) -> Trajectory:
    """``meta["o"]`` (default 0) is the trajectory's byte offset inside ``blob``."""
    base = blob if isinstance(blob, memoryview) and blob.format == "B" and blob.ndim == 1 else memoryview(blob).cast("B")
    return _unpack(meta, base, as_lists)


def _unpack(meta: dict, base: memoryview, as_lists: bool) -> Trajectory:
    try:
        n_p, n_r, n_w = int(meta["np"]), int(meta["nr"]), int(meta["nw"])
        size = 4 * n_p + 9 * n_r + 4 * n_w
        start = int(meta.get("o", 0))
        if n_p < 0 or n_r < 0 or n_w < 0 or start < 0 or start + size > base.nbytes or (
                "o" not in meta and base.nbytes != size):
            raise ProtocolError(f"trajectory blob has {base.nbytes} bytes, expected {size} at offset {start}")
        wire = (base, start, size, (n_p, n_r, n_w))
        kw = {k: v for k, v in meta.items() if k in _SCALAR_DEFAULTS}
        if as_lists:
            arrays = [a.tolist() for a in _materialize(wire)]
            return Trajectory(**dict(zip(_ARRAY_FIELDS, arrays)), **kw)
        t = WireTrajectory.__new__(WireTrajectory)
        d = t.__dict__
        for k, default in _SCALAR_DEFAULTS.items():
            v = kw.get(k, default)
            d[k] = dict(v) if isinstance(v, dict) else v
        d["_wire"] = wire
        return t
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad trajectory: {e!r}") from None


def pack_trajectories(trajs: Sequence[Trajectory], first_blob: int = 0) -> tuple[list[dict], list[Any]]:
    metas, blobs = [], []
    for i, t in enumerate(trajs):
        m, b = pack_trajectory(t, first_blob + i)
        metas.append(m)
        blobs.append(b)
    return metas, blobs


def unpack_trajectories(metas: list, blobs: Sequence[Any], *, as_lists: bool = False) -> list[Trajectory]:
    out = []
    bases: dict[int, memoryview] = {}
    for m in metas:
        try:
            i = int(m["b"])
            base = bases.get(i)
            if base is None:
                base = bases[i] = memoryview(blobs[i]).cast("B")
        except (KeyError, IndexError, TypeError, ValueError):
            raise ProtocolError(f"trajectory refers to a missing blob: {m.get('b') if isinstance(m, dict) else m!r}") \
                from None
        out.append(_unpack(m, base, as_lists))
    return out


def pack_group_blob(trajs: Sequence[Trajectory], blob_index: int) -> tuple[list[dict], Any]:
    """All token data of one group as ONE blob (metas address it by byte offset ``o``). When the
    trajectories were decoded from one blob and are unchanged, that blob is re-used: no copy at all."""
    wires = [t.__dict__.get("_wire") for t in trajs]
    if wires and all(w is not None for w in wires):
        base = wires[0][0]
        if all(w[0].obj is base.obj and w[0].nbytes == base.nbytes and _unchanged(t, w) for t, w in zip(trajs, wires)):
            metas = []
            for t, w in zip(trajs, wires):
                m = _scalar_meta(t)
                m.update(b=blob_index, o=w[1], np=w[3][0], nr=w[3][1], nw=w[3][2])
                metas.append(m)
            return metas, base
    metas, pieces = pack_trajectories(trajs, blob_index)
    offset = 0
    for m, b in zip(metas, pieces):
        m["b"], m["o"] = blob_index, offset
        offset += memoryview(b).nbytes
    return metas, b"".join(pieces)


def pack_groups(groups: Sequence[Group], blobs: list) -> list[dict]:
    """Groups -> header maps; each group's token data is appended to ``blobs`` as one blob."""
    out = []
    for g in groups:
        metas, blob = pack_group_blob(g.trajectories, len(blobs))
        blobs.append(blob)
        out.append({"group_id": g.group_id, "epoch": g.epoch, "issued_version": g.issued_version,
                    "finished_version": g.finished_version, "aborted": g.aborted, "item": item_to_wire(g.item),
                    "trajs": metas})
    return out


def unpack_groups(maps: list, blobs: Sequence[Any], *, as_lists: bool = False) -> list[Group]:
    out = []
    for d in maps:
        try:
            out.append(Group(group_id=int(d["group_id"]), item=item_from_wire(d["item"]), epoch=int(d["epoch"]),
                             trajectories=unpack_trajectories(d["trajs"], blobs, as_lists=as_lists),
                             issued_version=int(d["issued_version"]), finished_version=int(d["finished_version"]),
                             aborted=bool(d["aborted"])))
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad group: {e!r}") from None
    return out


# ---------------------------------------------------------------- broker state (checkpoints)
def pack_state(state: dict) -> tuple[dict, list[bytes]]:
    """``BrokerCore.state_dict()`` -> (header map, blobs)."""
    blobs: list[bytes] = []
    body = {"version": state["version"], "next_group_id": state["next_group_id"],
            "dataloader": state["dataloader"],
            "queued": [[item_to_wire(it), e] for it, e in state["queued"]],
            "inflight": [[item_to_wire(it), e] for it, e in state["inflight"]],
            "buffered": pack_groups(state["buffered"], blobs)}
    return body, blobs


def unpack_state(body: dict, blobs: Sequence[Any]) -> dict:
    try:
        return {"version": int(body["version"]), "next_group_id": int(body["next_group_id"]),
                "dataloader": dict(body["dataloader"]),
                "queued": [(item_from_wire(it), int(e)) for it, e in body["queued"]],
                "inflight": [(item_from_wire(it), int(e)) for it, e in body["inflight"]],
                "buffered": unpack_groups(body["buffered"], blobs)}
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad broker state: {e!r}") from None


def state_to_bytes(body: dict, blobs: Sequence[Any]) -> bytes:
    """A self-contained blob (what the runner writes into its checkpoint)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "state": body, "blobs": [bytes(b) for b in blobs]},
                         use_bin_type=True)


def state_from_bytes(data: bytes) -> tuple[dict, list[bytes]]:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if d.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"broker checkpoint of protocol version {d.get('v')!r}, expected {PROTOCOL_VERSION}")
        return d["state"], d["blobs"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad broker checkpoint: {e!r}") from None
