"""The one wire shape of trajectories: a table of typed columns in the header, token data in raw frames.

Every message that carries trajectories (a worker's ``groups``, the broker's ``batch``, the broker state of a
checkpoint) holds ONE table, ``pack_table``'s output, and its frames:

    {"n":      [trajectories per group],          # then the message's group columns, e.g.
     "group_id": [...], "aborted": [...], ...     # (``protocol`` names and types them per message)
     "traj":   {"np": [...], "nr": [...], "reward": [...], "min_version": [...], "max_version": [...],
                "num_turns": [...], "num_tool_calls": [...], "num_retractions": [...], "truncated": [...],
                "aborted": [...], "finish_reason": [...], "tool_errors": [...]},
     "frames": [trajectories per frame]}

A frame holds its trajectories' token data back to back, each one laid out
``prompt_ids int32[np] | response_ids int32[nr] | rollout_logprobs float32[nr] | loss_mask uint8[nr]``
(little-endian) and zero-padded to a multiple of 4 bytes, so every int32/float32 view is aligned; the sizes
must fill each frame exactly. Decoding is zero-copy: token fields are read-only ``np.frombuffer`` views of the
received frame, made on first access (a broker that only forwards a trajectory never builds them), and an
unchanged decoded trajectory is re-sent as a slice of the frame it came in (consecutive ones as ONE slice).

What travels is what is read after the worker: the token fields, the reward and versions (buffer, staleness),
``aborted`` (buffer), and the per-step rollout metrics' fields (turns, tool calls, retractions, truncation,
finish reason, ``extra["tool_errors"]``). Per-token ``weight_versions``, ``timings``, ``error`` (the group
carries its first error) and the rest of ``extra`` stay in the worker: a decoded trajectory has empty ones.

Every column is checked at this edge: a list of the table's length holding its type only (an integer column
takes msgpack integers >= 0, never a float, a bool, ``inf`` or ``NaN``); a wrong one raises ``ProtocolError``
naming the message type and the column. A non-finite reward decodes (the core counts and drops its group).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from asyncrl.broker.types import PromptItem, Trajectory


class ProtocolError(ValueError):
    """A malformed message, a message of another protocol version, or an unknown type."""


_I4, _F4, _U1 = np.dtype("<i4"), np.dtype("<f4"), np.dtype(np.uint8)
_TOKEN_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask")
_NO_VERSIONS = np.empty(0, _I4)
_NO_VERSIONS.flags.writeable = False

# The trajectory columns besides the lengths: (name, type). ``tool_errors`` is ``extra["tool_errors"]``.
TRAJ_COLUMNS: tuple[tuple[str, type], ...] = (
    ("reward", float),
    ("min_version", int),
    ("max_version", int),
    ("num_turns", int),
    ("num_tool_calls", int),
    ("num_retractions", int),
    ("truncated", bool),
    ("aborted", bool),
    ("finish_reason", str),
)
_SCALAR_NAMES = tuple(name for name, _ in TRAJ_COLUMNS)
_SCALARS_GET = operator.itemgetter(*_SCALAR_NAMES)


def token_nbytes(n_prompt: int, n_resp: int) -> int:
    """Bytes of one trajectory's token data in a frame (padded to 4)."""
    return 4 * n_prompt + 9 * n_resp + (-n_resp % 4)


# ---------------------------------------------------------------- columns (the edge's type checks)
def column(table: dict, key: str, typ: type, n: int, where: str) -> list:
    """``table[key]``: a list of ``n`` values of ``typ`` (an int column: integers >= 0; a float column:
    numbers, ints widened). Raises ``ProtocolError`` naming ``where`` and the column."""
    v = table.get(key)
    if type(v) is not list or len(v) != n:
        got = f"{len(v)} entries" if type(v) is list else type(v).__name__
        raise ProtocolError(f"{where}: column {key!r} must be a list of {n} values, got {got}")
    types = set(map(type, v))
    if typ is int:
        if not types <= {int} or (v and min(v) < 0):
            bad = next(x for x in v if type(x) is not int or x < 0)
            raise ProtocolError(f"{where}: column {key!r} must hold integers >= 0, got {bad!r:.80}")
    elif typ is float:
        if not types <= {float}:
            if not types <= {float, int}:
                bad = next(x for x in v if type(x) not in (float, int))
                raise ProtocolError(f"{where}: column {key!r} must hold numbers, got {bad!r:.80}")
            v = [float(x) for x in v]
    elif not types <= {typ}:
        bad = next(x for x in v if type(x) is not typ)
        raise ProtocolError(f"{where}: column {key!r} must hold {typ.__name__} values, got {bad!r:.80}")
    return v


def item_row(item: PromptItem) -> list:
    return [item.index, item.prompt, list(item.answers), item.data_source, item.extra]


def item_from_row(r: Any, where: str = "prompt item") -> PromptItem:
    """``[index, prompt, answers, data_source, extra]`` -> PromptItem (types checked)."""
    if type(r) is not list or len(r) != 5:
        raise ProtocolError(f"{where}: a prompt item is [index, prompt, answers, data_source, extra], got {r!r:.120}")
    index, prompt, answers, data_source, extra = r
    if type(index) is not int or index < 0:
        raise ProtocolError(f"{where}: prompt item index must be an integer >= 0, got {index!r:.80}")
    if type(prompt) is not str or type(data_source) is not str or type(answers) is not list:
        raise ProtocolError(f"{where}: prompt item {index}: prompt/data_source must be strings, answers a list")
    if type(extra) is not dict:
        raise ProtocolError(f"{where}: prompt item {index}: extra must be a map, got {type(extra).__name__}")
    return PromptItem(index, prompt, list(answers), data_source, dict(extra))


# ---------------------------------------------------------------- decoded trajectories
class WireTrajectory(Trajectory):
    """A ``Trajectory`` decoded from the wire. Its token fields are read-only numpy views of the received
    frame, made on first access. Pickling or ``copy.deepcopy`` gives a plain ``Trajectory`` with copies."""

    def __getattr__(self, name: str):
        d = self.__dict__
        if name in _TOKEN_FIELDS and "_src" in d:
            views = _views(d["_src"])
            d["_views"] = views
            for f, a in zip(_TOKEN_FIELDS, views):
                d.setdefault(f, a)  # a field assigned before first access keeps its new value
            return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __reduce_ex__(self, protocol):
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(Trajectory)}
        for f in (*_TOKEN_FIELDS, "weight_versions"):
            kw[f] = np.array(kw[f])
        return Trajectory, tuple(kw[f.name] for f in dataclasses.fields(Trajectory))


def _views(src: tuple) -> tuple[np.ndarray, ...]:
    base, off, n_p, n_r = src
    o_r = off + 4 * n_p
    o_lp = o_r + 4 * n_r
    return (
        np.frombuffer(base, _I4, n_p, off),
        np.frombuffer(base, _I4, n_r, o_r),
        np.frombuffer(base, _F4, n_r, o_lp),
        np.frombuffer(base, _U1, n_r, o_lp + 4 * n_r),
    )


def _forwardable(t: Trajectory) -> Optional[tuple]:
    """``(base, offset, np, nr)`` when ``t`` is a decoded trajectory whose token fields are unchanged."""
    d = t.__dict__
    src = d.get("_src")
    if src is None:
        return None
    views = d.get("_views")
    if views is None:
        return src if d.keys().isdisjoint(_TOKEN_FIELDS) else None
    return src if all(d.get(f) is v for f, v in zip(_TOKEN_FIELDS, views)) else None


# ---------------------------------------------------------------- encoding
def _fresh_pieces(t: Trajectory, pieces: list) -> tuple[int, int]:
    p = np.ascontiguousarray(t.prompt_ids, _I4)
    r = np.ascontiguousarray(t.response_ids, _I4)
    lp = np.ascontiguousarray(t.rollout_logprobs, _F4)
    lm = np.ascontiguousarray(t.loss_mask, _U1)
    n_r = len(r)
    if len(lp) != n_r or len(lm) != n_r:
        raise ValueError(
            f"trajectory arrays do not align: {n_r} response ids, {len(lp)} logprobs, {len(lm)} loss_mask entries"
        )
    pieces += (p.tobytes(), r.tobytes(), lp.tobytes(), lm.tobytes(), b"\0" * (-n_r % 4))
    return len(p), n_r


class _FreshFrame:
    """Frames of trajectories that are all packed afresh: ONE frame."""

    def __init__(self):
        self._pieces: list = []
        self._n = 0

    def __call__(self, t: Trajectory) -> tuple[int, int]:
        self._n += 1
        return _fresh_pieces(t, self._pieces)

    def done(self) -> tuple[list, list[int]]:
        return ([b"".join(self._pieces)], [self._n]) if self._n else ([], [])


class _Frames:
    """Frames being built: runs of forwarded slices (one frame per contiguous run) and of fresh bytes."""

    def __init__(self):
        self.frames: list[Any] = []
        self.counts: list[int] = []
        self._base, self._lo, self._hi = None, 0, 0  # the slice run being extended
        self._pieces: list = []  # the fresh run being built

    def _close(self) -> None:
        if self._base is not None:
            base, lo, hi = self._base, self._lo, self._hi
            self.frames.append(base if lo == 0 and hi == base.nbytes else base[lo:hi])
            self._base = None
        elif self._pieces:
            self.frames.append(b"".join(self._pieces))
            self._pieces = []

    def __call__(self, t: Trajectory) -> tuple[int, int]:
        src = _forwardable(t)
        if src is not None:
            base, off, n_p, n_r = src
            if self._base is not base or self._hi != off:
                self._close()
                self.counts.append(0)
                self._base, self._lo, self._hi = base, off, off
            self._hi += 4 * n_p + 9 * n_r + (-n_r % 4)
        else:
            if self._base is not None or not self.counts:
                self._close()
                self.counts.append(0)
            n_p, n_r = _fresh_pieces(t, self._pieces)
        self.counts[-1] += 1
        return n_p, n_r

    def done(self) -> tuple[list, list[int]]:
        self._close()
        return self.frames, self.counts


def pack_table(group_columns: dict[str, list], trajectories: Sequence[Optional[Sequence[Trajectory]]]) -> tuple:
    """Group columns (each a list, one value per group) and each group's trajectories (None: none) ->
    ``(table, frames)``. Raises ValueError for a trajectory whose arrays do not align."""
    if not any("_src" in t.__dict__ for trajs in trajectories for t in trajs or ()):
        add = _FreshFrame()  # nothing to forward (a worker's message): one frame, no run bookkeeping
    else:
        add = _Frames()
    fr = add
    n_p, n_r, sizes, rows, tool_errors = [], [], [], [], []
    for trajs in trajectories:
        sizes.append(len(trajs) if trajs else 0)
        for t in trajs or ():
            a, b = add(t)
            n_p.append(a)
            n_r.append(b)
            try:
                rows.append(_SCALARS_GET(t.__dict__))
            except KeyError:  # a field that does not live in __dict__ (a subclass): the slow way
                rows.append(tuple(getattr(t, k) for k in _SCALAR_NAMES))
            ex = t.extra
            tool_errors.append(int(ex.get("tool_errors", 0)) if ex else 0)
    cols = [list(c) for c in zip(*rows)] if rows else [[] for _ in _SCALAR_NAMES]
    cols[0] = [float(x) for x in cols[0]]
    traj = {"np": n_p, "nr": n_r, **dict(zip(_SCALAR_NAMES, cols)), "tool_errors": tool_errors}
    frames, counts = fr.done()
    return {"n": sizes, **group_columns, "traj": traj, "frames": counts}, frames


# ---------------------------------------------------------------- decoding
def unpack_table(table: Any, frames: Sequence[Any], where: str) -> tuple[list[int], list[WireTrajectory]]:
    """A table's group sizes and its trajectories (in order). The caller reads the group columns with
    ``column``. Raises ``ProtocolError`` naming ``where`` and the field."""
    if type(table) is not dict:
        raise ProtocolError(f"{where}: the group table must be a map, got {type(table).__name__}")
    tc = table.get("traj")
    if type(tc) is not dict:
        raise ProtocolError(f"{where}: field 'traj' must be a map of columns, got {type(tc).__name__}")
    sizes = column(table, "n", int, _len(table.get("n")), where)
    n = sum(sizes)
    n_p = column(tc, "np", int, n, where)
    n_r = column(tc, "nr", int, n, where)
    cols = [column(tc, name, typ, n, where) for name, typ in TRAJ_COLUMNS]
    tool_errors = column(tc, "tool_errors", int, n, where)
    counts = column(table, "frames", int, _len(table.get("frames")), where)
    if sum(counts) != n or len(counts) != len(frames):
        raise ProtocolError(
            f"{where}: field 'frames' says {sum(counts)} trajectories in {len(counts)} frames; "
            f"the table has {n} trajectories and the message {len(frames)} frames"
        )
    return sizes, _trajectories(frames, counts, n_p, n_r, zip(*cols, tool_errors), where)


_NAMES_AND_TOOL_ERRORS = (*_SCALAR_NAMES, "tool_errors")


def _trajectories(frames: Sequence[Any], counts: list[int], n_p: list, n_r: list, rows, where: str) -> list:
    """One WireTrajectory per row (its scalars) over the frames' token data; the frames must be filled exactly."""
    out: list[WireTrajectory] = []
    new = WireTrajectory.__new__
    names = _NAMES_AND_TOOL_ERRORS
    for f, cnt in zip(frames, counts):
        base = memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B")
        off, k = 0, len(out)
        for i, row in zip(range(k, k + cnt), rows):
            a, b = n_p[i], n_r[i]
            t = new(WireTrajectory)
            d = t.__dict__
            d.update(zip(names, row))
            k_err = d.pop("tool_errors")
            d["_src"] = (base, off, a, b)
            d["weight_versions"] = _NO_VERSIONS
            d["error"] = ""
            d["timings"] = {}
            d["extra"] = {"tool_errors": k_err} if k_err else {}
            off += 4 * a + 9 * b + (-b % 4)
            out.append(t)
        if off != base.nbytes:
            raise ProtocolError(f"{where}: a frame of {base.nbytes} bytes holds trajectories of {off} bytes")
    return out


def _len(v: Any) -> int:
    return len(v) if type(v) is list else -1


def split_groups(sizes: list[int], trajs: list) -> list[list]:
    """The flat trajectory list cut into groups of ``sizes``."""
    out, k = [], 0
    for s in sizes:
        out.append(trajs[k : k + s])
        k += s
    return out
