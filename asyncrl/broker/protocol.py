"""The broker's wire protocol: every message between the broker, the agent workers and the actor.

Both ends import this module (the clients in ``client.py`` use it; so does ``server.py``).

Framing: one ZeroMQ multipart message = ``[header, *blobs]``. ``header`` is a msgpack map with
``"v"`` (``PROTOCOL_VERSION``) and ``"t"`` (the type, below) plus the type's fields, and ``"k"``, the run
secret (``asyncrl.cluster.auth``; sent when ``ASYNCRL_API_KEY`` is set, required by a broker that has one). Token data
never goes through msgpack lists: each trajectory's arrays travel as one raw blob frame, laid out
``prompt_ids int32[np] | response_ids int32[nr] | rollout_logprobs float32[nr] |
weight_versions int32[nw] | loss_mask uint8[nr]`` (little-endian; ``nw`` is 0 or ``nr``), and its
scalar fields as a small map in the header (only the ones that differ from the dataclass default).
A group's trajectories share one blob frame; a meta's ``o`` is its byte offset in it. Decoding is zero-copy
(``np.frombuffer`` over the frame): decoded token fields are numpy arrays unless ``as_lists``.

Worker -> broker (DEALER, identity = worker id)          Broker -> worker
  hello      {worker_id, capacity, rows?}                 welcome  {version, group_size, hold, heartbeat_interval_s}
  hb         {worker_id}                                  issue    {groups: [{group_id, group_size, version,
                                                                              epoch, item}, ...]}
                                                          (hello ``rows: true``: {rows: [[group_id, group_size,
                                                                   version, epoch, item row], ...]})
  traj       {group_id, index, traj: meta | None} +blob?  control  {hold, version}
  group      {group_id, aborted, error, trajs: [meta]}    cancel   {group_ids}
             +one blob for the group (trajs = [] -> use    rehello  {}   (broker does not know you: send hello)
             the trajectories sent one by one, ``traj``)  shutdown {}
  groups     {groups: [[group_id, aborted, error,
              [trajectory row]]]} +ONE blob for all of
             them: several finished groups per message
             (``finished_groups_frames``; same meaning
             as that many ``group`` messages, in order)
  bye        {worker_id}
Actor -> broker (DEALER)                                 Broker -> actor (one reply per request)
  get_batch  {step, timeout_s, actor_version | None,      batch {step, wait_s, metrics, groups: [group]} +blobs
              rows?}                                        (``rows: true`` asked: ``rows: [group row]`` instead)
                                                          | timeout {step} | error {message}
  sync_begin {mode}   sync_end {version}                  ok {}
  hold_issuing {}     release_issuing {}                  ok {}   (no new prompts issued while held)
  batch_filtered {group_ids}                              ok {} | error {message}   (sample filter)
  engine_figures {running_reqs, queue_reqs,               ok {} | error {message}   (the engines' /metrics,
                  gen_tokens_per_s}                        summed; for max_inflight_groups = "auto")
  metrics    {}                                           metrics {metrics, counters, status}
  status     {}                                           status {...counts...}
  get_state  {}                                           state {state} +blobs
  set_state  {state} +blobs                               ok {}
  shutdown   {}                                           ok {}
A ``group`` map is ``{group_id, epoch, issued_version, finished_version, aborted, item, trajs: [meta]}``;
an ``item`` map is ``{index, prompt, answers, data_source, extra}``; a trajectory ``meta`` carries
``b`` (its blob's index in the message's blob frames) and the lengths ``np``, ``nr``, ``nw``.
Rows (the high-volume ``groups`` and ``batch`` messages): a trajectory row is ``[b, o, np, nr, nw, reward,
min_version, max_version, rest]`` (``rest``: None or a map of the other non-default scalars); a group row is
``[group_id, epoch, issued_version, finished_version, aborted, [index, prompt, answers, data_source, extra],
[trajectory row]]``. Maps stay the format of ``group``, ``traj`` and checkpoints.
A message that fails to decode, has another version or an unknown type raises ``ProtocolError``;
the broker logs and counts it and goes on. Fields are typed at this edge (``int_field``, ``float_field``,
``worker_id_field`` and the row/meta decoders): an integer field takes a msgpack integer only (a float, ``inf``,
``NaN`` or a bool is a ``ProtocolError`` naming the message type and the field), a reward is a number, a
``worker_id`` a short non-empty string. A non-finite reward decodes; the core drops its group
(``nonfinite_rewards``).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np

from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.cluster import auth

PROTOCOL_VERSION = 1

# worker -> broker
HELLO, HEARTBEAT, TRAJ, GROUP, GROUPS, BYE = "hello", "hb", "traj", "group", "groups", "bye"
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

WORKER_TYPES = frozenset({HELLO, HEARTBEAT, TRAJ, GROUP, GROUPS, BYE})
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
    }
)
TO_WORKER_TYPES = frozenset({WELCOME, ISSUE, CONTROL, CANCEL, REHELLO, SHUTDOWN})
TO_ACTOR_TYPES = frozenset({BATCH, TIMEOUT, OK, ERROR, STATE, METRICS, STATUS})


class ProtocolError(ValueError):
    """A malformed message, a message of another protocol version, or an unknown type."""


# Bounds of the header fields a peer sends (checked at the decoder edge, before any state changes).
MAX_WORKER_ID_CHARS = 256  # ids are host/rank names; anything longer is not one of ours
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a get_batch wait longer than a week is a unit mistake
_MISSING = object()


def int_field(body: dict, key: str, where: str, *, lo: int = 0, default: Any = _MISSING) -> Any:
    """``body[key]`` as an integer >= ``lo`` (a msgpack int, never a float or a bool: ``1.0``, ``inf`` and
    ``NaN`` are rejected here, so no ``int()`` of them can raise later). Absent: ``default`` or an error.
    Raises ``ProtocolError`` naming the message type and the field."""
    v = body.get(key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        if default is _MISSING:
            raise ProtocolError(f"{where}: field {key!r} is required")
        return default
    if type(v) is not int or v < lo:
        raise ProtocolError(f"{where}: field {key!r} must be an integer >= {lo}, got {v!r:.80}")
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
    """``body[key]``: a list of at most ``max_len`` integers >= 0."""
    v = body.get(key, _MISSING)
    if not isinstance(v, list):
        raise ProtocolError(f"{where}: field {key!r} must be a list of integers, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(f"{where}: field {key!r} has {len(v)} entries, at most {max_len} allowed")
    for x in v:
        if type(x) is not int or x < 0:
            raise ProtocolError(f"{where}: field {key!r} must hold integers >= 0, got {x!r:.80}")
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


def _strict_int(v: Any, what: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise ProtocolError(f"{what} must be an integer >= {lo}, got {v!r:.80}")
    return v


def _finite_or_nan_reward(v: Any) -> float:
    """A reward on the wire is an int or a float (a string or a bool is malformed). Non-finite values pass
    the decoder: the core counts them and drops the group (``nonfinite_reward``), so the sender learns nothing
    is lost silently and the accounting stays exact."""
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise ProtocolError(f"trajectory reward must be a number, got {v!r:.80}")


# The types of a trajectory's optional scalar fields (the dataclass defaults' types).
_SCALAR_TYPES = {
    "num_turns": int,
    "num_tool_calls": int,
    "num_retractions": int,
    "finish_reason": str,
    "truncated": bool,
    "aborted": bool,
    "error": str,
    "timings": dict,
    "extra": dict,
}


def _check_scalars(d: dict) -> None:
    """Every optional scalar of a decoded trajectory has its field's type (counts >= 0)."""
    for k, typ in _SCALAR_TYPES.items():
        v = d[k]
        if type(v) is not typ:
            if typ is dict and v is None:
                continue
            raise ProtocolError(f"trajectory field {k!r} must be {typ.__name__}, got {v!r:.80}")
        if typ is int and v < 0:
            raise ProtocolError(f"trajectory field {k!r} must be >= 0, got {v}")


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


# ---------------------------------------------------------------- items, trajectories, groups
def item_to_wire(item: PromptItem) -> dict:
    return {
        "index": item.index,
        "prompt": item.prompt,
        "answers": list(item.answers),
        "data_source": item.data_source,
        "extra": item.extra,
    }


def item_from_wire(d: dict) -> PromptItem:
    try:
        return PromptItem(
            _strict_int(d["index"], "prompt item index"),
            d["prompt"],
            list(d.get("answers", ())),
            d.get("data_source", ""),
            dict(d.get("extra", _EMPTY)),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad prompt item: {e!r}") from None


_SCALAR_DEFAULTS = {
    "reward": 0.0,
    "min_version": 0,
    "max_version": 0,
    "num_turns": 0,
    "num_tool_calls": 0,
    "num_retractions": 0,
    "finish_reason": "",
    "truncated": False,
    "aborted": False,
    "error": "",
    "timings": {},
    "extra": {},
}


_SCALAR_ITEMS = tuple(_SCALAR_DEFAULTS.items())
_FLAT_DEFAULTS = {k: v for k, v in _SCALAR_DEFAULTS.items() if not isinstance(v, dict)}
_FLAT_GET = operator.itemgetter(*_FLAT_DEFAULTS)  # the non-dict scalar fields of a trajectory's __dict__, as a tuple
_SCALAR_KEYS = frozenset(_SCALAR_DEFAULTS)
_META_KEYS = _SCALAR_KEYS | {"b", "o", "np", "nr", "nw"}
_ALL_GET = operator.itemgetter(*_SCALAR_DEFAULTS)
_DEFAULT_VALUES = tuple(_SCALAR_DEFAULTS.values())
_EMPTY: dict = {}


_I4, _F4, _U1 = np.dtype("<i4"), np.dtype("<f4"), np.dtype(np.uint8)


def _arr(x, dtype) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=dtype)


_ARRAY_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions")


def _materialize(wire) -> tuple[np.ndarray, ...]:
    base, start, _, (n_p, n_r, n_w) = wire
    o_r = start + 4 * n_p
    o_lp = o_r + 4 * n_r
    o_wv = o_lp + 4 * n_r
    return (
        np.frombuffer(base, "<i4", n_p, start),
        np.frombuffer(base, "<i4", n_r, o_r),
        np.frombuffer(base, np.uint8, n_r, o_wv + 4 * n_w),
        np.frombuffer(base, "<f4", n_r, o_lp),
        np.frombuffer(base, "<i4", n_w, o_wv),
    )


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


def _new_wire_trajectory() -> WireTrajectory:
    return WireTrajectory.__new__(WireTrajectory)


def _unchanged(t: Trajectory, wire) -> bool:
    """True when no token field of a WireTrajectory was replaced since decoding."""
    d = t.__dict__
    mat = d.get("_wire_arrays")
    if mat is None:
        return d.keys().isdisjoint(_ARRAY_FIELDS)
    for i, f in enumerate(_ARRAY_FIELDS):
        v = d.get(f)
        if v is not None and v is not mat[i]:
            return False
    return True


def _received_meta(t: Trajectory):
    """The meta a WireTrajectory was decoded from, when none of its scalar fields changed since (else None)."""
    d = t.__dict__
    meta = d.get("_meta")
    if (
        meta is None
        or _FLAT_GET(d) != d["_snap"]
        or d["timings"] != meta.get("timings", _EMPTY)
        or d["extra"] != meta.get("extra", _EMPTY)
    ):
        return None
    return meta


def _reusable_blob(t: Trajectory):
    """The bytes a decoded trajectory came from, if its token arrays are still exactly those views."""
    wire = t.__dict__.get("_wire")
    if wire is None or not _unchanged(t, wire):
        return None
    base, start, size, _ = wire
    return base[start : start + size]


def _scalar_meta(t: Trajectory) -> dict:
    try:
        vals = _ALL_GET(t.__dict__)
    except KeyError:  # a field that does not live in __dict__ (a subclass): the slow way
        vals = tuple(getattr(t, k) for k in _SCALAR_DEFAULTS)
    if vals == _DEFAULT_VALUES:
        return {}
    meta = {k: v for k, v, dflt in zip(_SCALAR_DEFAULTS, vals, _DEFAULT_VALUES) if v != dflt}
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
    base = (
        blob if isinstance(blob, memoryview) and blob.format == "B" and blob.ndim == 1 else memoryview(blob).cast("B")
    )
    return _unpack(meta, base, as_lists)


def _unpack(meta: dict, base: memoryview, as_lists: bool) -> Trajectory:
    try:
        n_p, n_r, n_w = meta["np"], meta["nr"], meta["nw"]
        start = meta.get("o", 0)
        if not (type(n_p) is int and type(n_r) is int and type(n_w) is int and type(start) is int):
            raise ProtocolError(f"trajectory meta: offsets and lengths must be integers: {meta!r:.200}")
        size = 4 * n_p + 9 * n_r + 4 * n_w
        if (
            n_p < 0
            or n_r < 0
            or n_w < 0
            or start < 0
            or start + size > base.nbytes
            or ("o" not in meta and base.nbytes != size)
        ):
            raise ProtocolError(f"trajectory blob has {base.nbytes} bytes, expected {size} at offset {start}")
        wire = (base, start, size, (n_p, n_r, n_w))
        keys = meta.keys()
        if as_lists:
            kw = {k: meta[k] for k in keys & _SCALAR_KEYS}
            _check_scalars({**_SCALAR_DEFAULTS, **kw})
            if "reward" in kw:
                kw["reward"] = _finite_or_nan_reward(kw["reward"])
            arrays = [a.tolist() for a in _materialize(wire)]
            return Trajectory(**dict(zip(_ARRAY_FIELDS, arrays)), **kw)
        t = _new_wire_trajectory()
        d = t.__dict__
        d.update(_FLAT_DEFAULTS)
        for k in keys & _SCALAR_KEYS:
            d[k] = meta[k]
        tm, ex = d.get("timings"), d.get("extra")
        d["timings"] = {} if tm is None else dict(tm)
        d["extra"] = {} if ex is None else dict(ex)
        if type(d["min_version"]) is not int or type(d["max_version"]) is not int:
            raise ProtocolError(
                f"trajectory versions must be integers: min_version {d['min_version']!r}, "
                f"max_version {d['max_version']!r}"
            )
        if type(d["reward"]) is not float:
            d["reward"] = _finite_or_nan_reward(d["reward"])
        _check_scalars(d)
        d["_wire"] = wire
        if keys <= _META_KEYS:  # forwarded unchanged, the received meta is re-used (see _forward_metas)
            d["_meta"] = meta
            d["_snap"] = _FLAT_GET(d)
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


def _blob_base(blobs: Sequence[Any], m: Any, bases: dict) -> memoryview:
    try:
        i = m["b"]
        base = bases.get(i)
        if base is None:
            base = bases[i] = memoryview(blobs[_strict_int(i, "trajectory blob index")]).cast("B")
        return base
    except (KeyError, IndexError, TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(
            f"trajectory refers to a missing blob: {m.get('b') if isinstance(m, dict) else m!r}"
        ) from None


def unpack_trajectories(
    metas: list, blobs: Sequence[Any], *, as_lists: bool = False, bases: dict | None = None
) -> list[Trajectory]:
    """``bases`` (blob index -> memoryview) may be shared by the calls for one message, so that the
    trajectories of many groups are views of the same frame object."""
    if bases is None:
        bases = {}
    return [_unpack(m, _blob_base(blobs, m, bases), as_lists) for m in metas]


def _wire_range(trajs: Sequence[Trajectory]):
    """``(base, lo, hi)`` when every trajectory is an unchanged view of one received frame and together they
    fill ``base[lo:hi]`` exactly (so forwarding that slice sends no foreign bytes); else None."""
    if not trajs:
        return None
    w0 = trajs[0].__dict__.get("_wire")
    if w0 is None:
        return None
    base = w0[0]
    lo, hi, total = w0[1], w0[1] + w0[2], 0
    for t in trajs:
        w = t.__dict__.get("_wire")
        if (
            w is None
            or not (w[0] is base or (w[0].obj is base.obj and w[0].nbytes == base.nbytes))
            or not _unchanged(t, w)
        ):
            return None
        if w[1] < lo:
            lo = w[1]
        if w[1] + w[2] > hi:
            hi = w[1] + w[2]
        total += w[2]
    return (base, lo, hi) if hi - lo == total else None


def _forward_metas(trajs: Sequence[Trajectory], blob_index: int, lo: int) -> list[dict]:
    metas = []
    for t in trajs:
        d = t.__dict__
        w = d["_wire"]
        m = _received_meta(t)
        if m is None:
            m = _scalar_meta(t)
            n = w[3]
            m["np"], m["nr"], m["nw"] = n
        else:
            m = m.copy()
        m["b"], m["o"] = blob_index, w[1] - lo
        metas.append(m)
    return metas


def _pack_into(t: Trajectory, pieces: list, offset: int, blob_index: int) -> tuple[dict, int]:
    """Append ``t``'s token arrays to ``pieces`` (to be joined into one blob at byte ``offset``)."""
    meta = _scalar_meta(t)
    n_p, n_r, n_w, size = _token_pieces(t, pieces)
    meta["b"], meta["o"], meta["np"], meta["nr"], meta["nw"] = blob_index, offset, n_p, n_r, n_w
    return meta, size


def pack_group_blob(trajs: Sequence[Trajectory], blob_index: int) -> tuple[list[dict], Any]:
    """All token data of one group as ONE blob (metas address it by byte offset ``o``). When the
    trajectories were decoded from one frame and are unchanged, a slice of that frame is re-used: no copy."""
    r = _wire_range(trajs)
    if r is not None:
        base, lo, hi = r
        return _forward_metas(trajs, blob_index, lo), (base if lo == 0 and hi == base.nbytes else base[lo:hi])
    metas, pieces, offset = [], [], 0
    for t in trajs:
        m, n = _pack_into(t, pieces, offset, blob_index)
        metas.append(m)
        offset += n
    return metas, b"".join(pieces)


def _group_map(g: Group, metas: list[dict]) -> dict:
    return {
        "group_id": g.group_id,
        "epoch": g.epoch,
        "issued_version": g.issued_version,
        "finished_version": g.finished_version,
        "aborted": g.aborted,
        "item": item_to_wire(g.item),
        "trajs": metas,
    }


def pack_groups(groups: Sequence[Group], blobs: list) -> list[dict]:
    """Groups -> header maps; their token data is appended to ``blobs``. Groups forwarded unchanged from
    received frames travel as zero-copy slices of those frames, consecutive groups of one frame as ONE slice
    (a worker's multi-group message stays one frame); any other group is packed afresh as one blob."""
    out = []
    run = None  # [base, lo, hi, blob index]: the frame slice being extended
    for g in groups:
        trajs = g.trajectories
        r = _wire_range(trajs)
        if r is None:
            metas, blob = pack_group_blob(trajs, len(blobs))
            blobs.append(blob)
        else:
            base, lo, hi = r
            if run is not None and run[0] is base and run[2] == lo:
                run[2] = hi
            else:
                if run is not None:
                    blobs[run[3]] = _slice(run)
                run = [base, lo, hi, len(blobs)]
                blobs.append(None)
            metas = _forward_metas(trajs, run[3], run[1])
        out.append(_group_map(g, metas))
    if run is not None:
        blobs[run[3]] = _slice(run)
    return out


def _slice(run: list) -> memoryview:
    base, lo, hi, _ = run
    return base if lo == 0 and hi == base.nbytes else base[lo:hi]


def unpack_groups(maps: list, blobs: Sequence[Any], *, as_lists: bool = False) -> list[Group]:
    out = []
    bases: dict[int, memoryview] = {}
    for d in maps:
        try:
            trajs = [_unpack(m, _blob_base(blobs, m, bases), as_lists) for m in d["trajs"]]
            out.append(
                Group(
                    _strict_int(d["group_id"], "group_id"),
                    item_from_wire(d["item"]),
                    _strict_int(d["epoch"], "epoch"),
                    trajs,
                    _strict_int(d["issued_version"], "issued_version"),
                    _strict_int(d["finished_version"], "finished_version"),
                    bool(d["aborted"]),
                )
            )
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad group: {e!r}") from None
    return out


# ---------------------------------------------------------------- compact rows (the high-volume messages)
# A trajectory row: [b, o, np, nr, nw, reward, min_version, max_version, rest] where ``rest`` is None or a map
# of the other scalar fields that differ from their defaults. A group row:
# [group_id, epoch, issued_version, finished_version, aborted, item row, [trajectory rows]] with the item row
# [index, prompt, answers, data_source, extra]. Positional lists cost msgpack far less than maps (no key
# strings per group/trajectory), and a row is built straight from the trajectory's fields.
_REST = tuple(k for k in _SCALAR_DEFAULTS if k not in ("reward", "min_version", "max_version"))
_REST_GET = operator.itemgetter(*_REST)
_REST_DEFAULTS = tuple(_SCALAR_DEFAULTS[k] for k in _REST)
_REST_KEYS = frozenset(_REST)


def _row_scalars(t: Trajectory) -> tuple:
    d = t.__dict__
    try:
        rest_vals = _REST_GET(d)
        reward, mn, mx = d["reward"], d["min_version"], d["max_version"]
    except KeyError:  # a field that does not live in __dict__ (a subclass): the slow way
        rest_vals = tuple(getattr(t, k) for k in _REST)
        reward, mn, mx = t.reward, t.min_version, t.max_version
    rest = (
        None
        if rest_vals == _REST_DEFAULTS
        else {k: v for k, v, dflt in zip(_REST, rest_vals, _REST_DEFAULTS) if v != dflt}
    )
    return float(reward), mn, mx, rest


def _token_pieces(t: Trajectory, pieces: list) -> tuple[int, int, int, int]:
    """Append ``t``'s token data (the blob layout) to ``pieces``; -> (np, nr, nw, bytes)."""
    blob = _reusable_blob(t)
    if blob is not None:
        pieces.append(blob)
        n_p, n_r, n_w = t.__dict__["_wire"][3]
        return n_p, n_r, n_w, blob.nbytes
    p = np.ascontiguousarray(t.prompt_ids, _I4)
    r = np.ascontiguousarray(t.response_ids, _I4)
    lp = np.ascontiguousarray(t.rollout_logprobs, _F4)
    wv = np.ascontiguousarray(t.weight_versions, _I4)
    lm = np.ascontiguousarray(t.loss_mask, _U1)
    n_p, n_r, n_w = len(p), len(r), len(wv)
    if len(lp) != n_r or len(lm) != n_r or n_w not in (0, n_r):
        raise ValueError(
            f"trajectory arrays do not align: {n_r} response ids, {len(lp)} logprobs, "
            f"{len(lm)} loss_mask entries, {n_w} weight_versions"
        )
    size = 4 * n_p + 9 * n_r + 4 * n_w
    if size <= 16384:  # small: bytes are cheaper to make than memoryviews (the join copies either way)
        pieces += (p.tobytes(), r.tobytes(), lp.tobytes(), wv.tobytes(), lm.tobytes())
    else:
        pieces += (p.data, r.data, lp.data, wv.data, lm.data)
    return n_p, n_r, n_w, size


def _unpack_row(row: Any, blobs: Sequence[Any], bases: dict, as_lists: bool) -> Trajectory:
    try:
        b, start, n_p, n_r, n_w, reward, mn, mx, rest = row
        base = bases.get(b)
        if base is None:
            base = bases[b] = memoryview(blobs[_strict_int(b, "trajectory row: blob index")]).cast("B")
        if not (
            type(start) is int
            and type(n_p) is int
            and type(n_r) is int
            and type(n_w) is int
            and type(mn) is int
            and type(mx) is int
        ):
            raise ProtocolError(f"trajectory row: offsets, lengths and versions must be integers: {row!r:.200}")
        size = 4 * n_p + 9 * n_r + 4 * n_w
        if n_p < 0 or n_r < 0 or n_w < 0 or start < 0 or start + size > base.nbytes:
            raise ProtocolError(f"trajectory blob has {base.nbytes} bytes, expected {size} at offset {start}")
        t = _new_wire_trajectory()
        d = t.__dict__
        d.update(_FLAT_DEFAULTS)
        d["reward"] = reward if type(reward) is float else _finite_or_nan_reward(reward)
        d["min_version"] = mn
        d["max_version"] = mx
        d["timings"] = {}
        d["extra"] = {}
        if rest:
            for k in rest.keys() & _REST_KEYS:
                v = rest[k]
                d[k] = dict(v) if isinstance(v, dict) else v
            _check_scalars(d)
        d["_wire"] = (base, start, size, (n_p, n_r, n_w))
    except (IndexError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad trajectory row {row!r:.200}: {e!r}") from None
    if as_lists:
        kw = {f.name: getattr(t, f.name) for f in dataclasses.fields(Trajectory)}
        for f in _ARRAY_FIELDS:
            kw[f] = kw[f].tolist()
        return Trajectory(**kw)
    return t


def _item_row(item: PromptItem) -> list:
    return [item.index, item.prompt, list(item.answers), item.data_source, item.extra]


def _item_from_row(r: Any) -> PromptItem:
    try:
        index, prompt, answers, data_source, extra = r
        return PromptItem(_strict_int(index, "prompt item index"), prompt, list(answers), data_source, dict(extra))
    except (TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad prompt item row {r!r:.200}: {e!r}") from None


def pack_group_rows(groups: Sequence[Group], blobs: list) -> list[list]:
    """Groups -> compact group rows; token data appended to ``blobs`` like ``pack_groups`` does (unchanged
    groups forwarded from received frames are zero-copy slices, consecutive ones of a frame ONE slice)."""
    out = []
    run_base, run_lo, run_hi, run_b = None, 0, 0, -1  # the frame slice being extended
    for g in groups:
        trajs = g.trajectories
        # forwardable: every trajectory an unchanged view of the same frame object, together filling base[lo:hi]
        base, lo, hi, total = None, 0, 0, 0
        for t in trajs:
            d = t.__dict__
            w = d.get("_wire")
            if (
                w is None
                or (base is not None and w[0] is not base)
                or not (d.keys().isdisjoint(_ARRAY_FIELDS) if "_wire_arrays" not in d else _unchanged(t, w))
            ):
                base = None
                break
            if base is None:
                base, lo, hi = w[0], w[1], w[1] + w[2]
            else:
                if w[1] < lo:
                    lo = w[1]
                if w[1] + w[2] > hi:
                    hi = w[1] + w[2]
            total += w[2]
        rows = []
        if base is not None and hi - lo == total:
            if base is run_base and run_hi == lo:
                run_hi = hi
            else:
                if run_base is not None:
                    blobs[run_b] = _slice([run_base, run_lo, run_hi, run_b])
                run_base, run_lo, run_hi, run_b = base, lo, hi, len(blobs)
                blobs.append(None)
            for t in trajs:
                d = t.__dict__
                w = d["_wire"]
                n = w[3]
                rest = _REST_GET(d)  # a WireTrajectory keeps every scalar field in its __dict__
                rows.append(
                    [
                        run_b,
                        w[1] - run_lo,
                        n[0],
                        n[1],
                        n[2],
                        float(d["reward"]),
                        d["min_version"],
                        d["max_version"],
                        None
                        if rest == _REST_DEFAULTS
                        else {k: v for k, v, dflt in zip(_REST, rest, _REST_DEFAULTS) if v != dflt},
                    ]
                )
        else:
            pieces, offset, b = [], 0, len(blobs)
            for t in trajs:
                n_p, n_r, n_w, size = _token_pieces(t, pieces)
                rows.append([b, offset, n_p, n_r, n_w, *_row_scalars(t)])
                offset += size
            blobs.append(b"".join(pieces))
        it = g.item
        out.append(
            [
                g.group_id,
                g.epoch,
                g.issued_version,
                g.finished_version,
                g.aborted,
                [it.index, it.prompt, list(it.answers), it.data_source, it.extra],
                rows,
            ]
        )
    if run_base is not None:
        blobs[run_b] = _slice([run_base, run_lo, run_hi, run_b])
    return out


def unpack_group_rows(rows: Any, blobs: Sequence[Any], *, as_lists: bool = False) -> list[Group]:
    if not isinstance(rows, list):
        raise ProtocolError(f"group rows: expected a list, got {type(rows).__name__}")
    out = []
    bases: dict[int, memoryview] = {}
    for r in rows:
        try:
            gid, epoch, iv, fv, aborted, item, trows = r
            trajs = [_unpack_row(x, blobs, bases, as_lists) for x in trows]
            out.append(
                Group(
                    _strict_int(gid, "group_id"),
                    _item_from_row(item),
                    _strict_int(epoch, "epoch"),
                    trajs,
                    _strict_int(iv, "issued_version"),
                    _strict_int(fv, "finished_version"),
                    bool(aborted),
                )
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"bad group row {r!r:.200}: {e!r}") from None
    return out


# ---------------------------------------------------------------- finished groups, several per message
def finished_groups_frames(entries: Sequence[tuple[int, Optional[Sequence[Trajectory]], bool, str]]) -> list[Any]:
    """A worker's ``groups`` message: ``entries`` = ``(group_id, trajectories | None, aborted, error)``.
    Body ``{"groups": [[group_id, aborted, error, [trajectory rows]], ...]}``; the token data of all of them is
    ONE blob (rows address it by offset)."""
    out, pieces, offset = [], [], 0
    for gid, trajs, aborted, error in entries:
        rows = []
        for t in trajs or ():
            n_p, n_r, n_w, size = _token_pieces(t, pieces)
            rows.append([0, offset, n_p, n_r, n_w, *_row_scalars(t)])
            offset += size
        out.append([int(gid), bool(aborted), str(error) if error else "", rows])
    return encode(GROUPS, {"groups": out}, [b"".join(pieces)] if pieces else ())


def unpack_finished_groups(msg: Message) -> list[tuple[int, Optional[list[Trajectory]], bool, str]]:
    """The inverse of ``finished_groups_frames`` (trajectories are zero-copy views of the one blob)."""
    groups = msg.body.get("groups")
    if not isinstance(groups, list):
        raise ProtocolError(f"groups: expected a list of groups, got {type(groups).__name__}")
    bases: dict[int, memoryview] = {}
    blobs = msg.blobs
    out = []
    for g in groups:
        try:
            gid, aborted, error, rows = g
            if rows is not None and not isinstance(rows, list):
                raise ProtocolError(f"groups: trajectory rows must be a list, got {type(rows).__name__}")
            trajs = [_unpack_row(x, blobs, bases, False) for x in rows] if rows else None
            out.append((_strict_int(gid, "groups: group_id"), trajs, bool(aborted), str(error)))
        except (TypeError, ValueError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"groups: bad group {g!r:.200}: {e!r}") from None
    return out


# ---------------------------------------------------------------- broker state (checkpoints)
def pack_state(state: dict) -> tuple[dict, list[bytes]]:
    """``BrokerCore.state_dict()`` -> (header map, blobs)."""
    blobs: list[bytes] = []
    body = {
        "counters": dict(state.get("counters", {})),
        "version": state["version"],
        "next_group_id": state["next_group_id"],
        "dataloader": state["dataloader"],
        "queued": [[item_to_wire(it), e] for it, e in state["queued"]],
        "inflight": [[item_to_wire(it), e] for it, e in state["inflight"]],
        "buffered": pack_groups(state["buffered"], blobs),
    }
    return body, blobs


def unpack_state(body: dict, blobs: Sequence[Any]) -> dict:
    try:
        dl = dict(body["dataloader"])
        for k in ("epoch", "position", "seed", "num_prompts"):
            _strict_int(dl[k], f"broker state: dataloader.{k}")
        out = {
            "version": _strict_int(body["version"], "broker state: version"),
            "next_group_id": _strict_int(body["next_group_id"], "broker state: next_group_id"),
            "dataloader": dl,
            "queued": [(item_from_wire(it), _strict_int(e, "broker state: epoch")) for it, e in body["queued"]],
            "inflight": [(item_from_wire(it), _strict_int(e, "broker state: epoch")) for it, e in body["inflight"]],
            "buffered": unpack_groups(body["buffered"], blobs),
        }
        if "counters" in body:  # absent in checkpoints written before the counters were saved
            out["counters"] = {
                str(k): _strict_int(v, f"broker state: counters.{k}") for k, v in dict(body["counters"]).items()
            }
        return out
    except (KeyError, TypeError, ValueError, OverflowError) as e:
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
            raise ProtocolError(f"broker checkpoint of protocol version {d.get('v')!r}, expected {PROTOCOL_VERSION}")
        return d["state"], d["blobs"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad broker checkpoint: {e!r}") from None
