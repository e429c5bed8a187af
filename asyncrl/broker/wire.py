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
must fill each frame exactly. Decoding is columnar and lazy: a decoded trajectory holds only its table and
its row; each field is read from the table's columns on first access (token fields: read-only
``np.frombuffer`` views of the received frame), so a broker that only forwards a trajectory never builds
them. Consecutive unchanged decoded trajectories of one table are re-sent as slices of its columns and of the
frame they came in (one slice per run); one with an assigned field, or whose ``extra`` was read, is packed
field by field (its token data still forwarded when unchanged).

What travels is what is read after the worker: the token fields, the reward and versions (buffer, staleness),
``aborted`` (buffer), and the per-step rollout metrics' fields (turns, tool calls, retractions, truncation,
finish reason, ``extra["tool_errors"]``). Per-token ``weight_versions``, ``timings``, ``error`` (the group
carries its first error) and the rest of ``extra`` stay in the worker: a decoded trajectory has empty ones.

Every column is checked at this edge: a list of the table's length holding its type only (an integer column
takes msgpack integers in [0, ``MAX_INT``], never a float, a bool, ``inf`` or ``NaN``); a wrong one raises
``ProtocolError`` naming the message type and the column. A non-finite reward decodes (the core counts and drops
its group); so do non-finite log-probs (``nonfinite_logprobs`` finds them; the broker drops their group).
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from asyncrl.broker.types import PromptItem, Trajectory


class ProtocolError(ValueError):
    """A malformed message, a message of another protocol version, or an unknown type."""


_I4, _F4, _U1 = np.dtype("<i4"), np.dtype("<f4"), np.dtype(np.uint8)

MAX_INT = 2**63 - 1
"""The largest integer a field or column may hold: a signed 64-bit int, what every reader of a value the broker
echoes back (a version, a step, a group id) can hold (numpy, torch, msgpack's int64), and the seeds' range
(``runner.seed``). Counters that grow by one never come near it; a larger value is a corrupt or hostile peer."""

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
_COL_NAMES = (*_SCALAR_NAMES, "tool_errors")  # the trajectory columns besides the lengths, as they travel


def token_nbytes(n_prompt: int, n_resp: int) -> int:
    """Bytes of one trajectory's token data in a frame (padded to 4)."""
    return 4 * n_prompt + 9 * n_resp + (-n_resp % 4)


# ---------------------------------------------------------------- columns (the edge's type checks)
def column(table: dict, key: str, typ: type, n: int, where: str) -> list:
    """``table[key]``: a list of ``n`` values of ``typ`` (an int column: integers in [0, ``MAX_INT``]; a float column:
    numbers, ints widened). Raises ``ProtocolError`` naming ``where`` and the column."""
    v = table.get(key)
    if type(v) is not list or len(v) != n:
        got = f"{len(v)} entries" if type(v) is list else type(v).__name__
        raise ProtocolError(f"{where}: column {key!r} must be a list of {n} values, got {got}")
    # one C pass over the types, counted (half the time of a set of them; columns are thousands long)
    types = list(map(type, v))
    if typ is int:
        if types.count(int) != n:
            bad = next(x for x in v if type(x) is not int)
            raise ProtocolError(f"{where}: column {key!r} must hold integers in [0, {MAX_INT}], got {bad!r:.80}")
        try:
            a = array.array("Q", v)  # unsigned 64-bit: a negative value overflows (a C pass, faster than min)
        except OverflowError:
            a = None
        # then the top: builtin max on a short column, numpy on a long one (max boxes each item: 5x slower there)
        if a is None or (n and (max(a) if n < 32 else int(np.frombuffer(a, np.uint64).max())) > MAX_INT):
            bad = next(x for x in v if not 0 <= x <= MAX_INT)
            raise ProtocolError(f"{where}: column {key!r} must hold integers in [0, {MAX_INT}], got {bad!r:.80}")
    elif typ is float:
        floats = types.count(float)
        if floats != n:
            if floats + types.count(int) != n:
                bad = next(x for x in v if type(x) not in (float, int))
                raise ProtocolError(f"{where}: column {key!r} must hold numbers, got {bad!r:.80}")
            v = [float(x) for x in v]
    elif types.count(typ) != n:
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
    if type(index) is not int or not 0 <= index <= MAX_INT:
        raise ProtocolError(f"{where}: prompt item index must be an integer in [0, {MAX_INT}], got {index!r:.80}")
    if type(prompt) is not str or type(data_source) is not str or type(answers) is not list:
        raise ProtocolError(f"{where}: prompt item {index}: prompt/data_source must be strings, answers a list")
    if type(extra) is not dict:
        raise ProtocolError(f"{where}: prompt item {index}: extra must be a map, got {type(extra).__name__}")
    return PromptItem(index, prompt, answers, data_source, extra)  # freshly decoded: no copies


# ---------------------------------------------------------------- decoded trajectories
class _Source:
    """One received table's trajectory columns and token frames, shared by the trajectories decoded from it
    (each holds only ``(source, index)``; a field is read from here on first access)."""

    __slots__ = ("cols", "bases", "frame", "frame_end", "offs", "n_p", "n_r", "finite")

    def __init__(self, cols: dict, bases: list, frame: list, frame_end: list, offs: list, n_p: list, n_r: list):
        self.cols = cols  # column name -> one value per trajectory (``_COL_NAMES``)
        self.bases = bases  # the received frames (byte memoryviews)
        self.frame = frame  # trajectory -> its frame's index in ``bases``
        self.frame_end = frame_end  # frame -> one past its last trajectory
        self.offs = offs  # trajectory -> the byte offset of its token data in its frame
        self.n_p, self.n_r = n_p, n_r
        self.finite: Optional[list[bool]] = None  # frame -> no NaN/inf float32 in it (``nonfinite_logprobs``)


class _Field:
    """A field of a ``WireTrajectory``, read from its source on first access and kept in the instance's
    ``__dict__`` (which wins over this non-data descriptor from then on)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, t, owner=None):
        if t is None:
            return self
        d = t.__dict__
        s, i = d["_s"], d["_i"]
        name = self.name
        if name in _TOKEN_FIELDS:
            views = _views(s.bases[s.frame[i]], s.offs[i], s.n_p[i], s.n_r[i])
            d["_views"] = views
            for f, a in zip(_TOKEN_FIELDS, views):
                d.setdefault(f, a)
            return d[name]
        if name in _SCALAR_SET:  # all of them at once: a reader reads several (one call here, not one each)
            cols = s.cols
            for f in _SCALAR_NAMES:
                if f not in d:  # a field assigned before keeps its new value
                    d[f] = cols[f][i]
            return d[name]
        if name == "extra":
            k_err = s.cols["tool_errors"][i]
            v = {"tool_errors": k_err} if k_err else {}
        else:
            v = _STAY[name]()
        d[name] = v
        return v


_SCALAR_SET = frozenset(_SCALAR_NAMES)
_STAY = {"weight_versions": lambda: _NO_VERSIONS, "error": str, "timings": dict}


class WireTrajectory(Trajectory):
    """A ``Trajectory`` decoded from the wire: its fields are read from the received table on first access
    (token fields: read-only numpy views of the received frame). Assigning a field marks it changed (the
    hand-off then packs it afresh; an unchanged one travels as slices of the columns and frames it came in).
    Pickling or ``copy.deepcopy`` gives a plain ``Trajectory`` with copies."""

    def __setattr__(self, name: str, value) -> None:
        d = self.__dict__
        d[name] = value
        d["_dirty"] = True

    def __reduce_ex__(self, protocol):
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(Trajectory)}
        for f in (*_TOKEN_FIELDS, "weight_versions"):
            kw[f] = np.array(kw[f])
        return Trajectory, tuple(kw[f.name] for f in dataclasses.fields(Trajectory))


for _f in dataclasses.fields(Trajectory):
    setattr(WireTrajectory, _f.name, _Field(_f.name))


def _views(base, off: int, n_p: int, n_r: int) -> tuple[np.ndarray, ...]:
    o_r = off + 4 * n_p
    o_lp = o_r + 4 * n_r
    return (
        np.frombuffer(base, _I4, n_p, off),
        np.frombuffer(base, _I4, n_r, o_r),
        np.frombuffer(base, _F4, n_r, o_lp),
        np.frombuffer(base, _U1, n_r, o_lp + 4 * n_r),
    )


def _forwardable(d: dict) -> Optional[tuple]:
    """``(base, offset, np, nr)`` when ``d`` is a decoded trajectory's ``__dict__`` whose token fields are
    unchanged."""
    s = d.get("_s")
    if s is None:
        return None
    views = d.get("_views")
    if views is None:
        if not d.keys().isdisjoint(_TOKEN_FIELDS):
            return None
    elif not all(d.get(f) is v for f, v in zip(_TOKEN_FIELDS, views)):
        return None
    i = d["_i"]
    return s.bases[s.frame[i]], s.offs[i], s.n_p[i], s.n_r[i]


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


class _Frames:
    """Frames being built: runs of forwarded slices (one frame per contiguous run of one received frame) and
    of fresh bytes (one frame per run)."""

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

    def slice(self, base, lo: int, hi: int, count: int) -> None:
        """``count`` trajectories whose token data is ``base[lo:hi]``."""
        if self._base is not base or self._hi != lo:
            self._close()
            self.counts.append(0)
            self._base, self._lo = base, lo
        self._hi = hi
        self.counts[-1] += count

    def fresh(self, t: Trajectory) -> tuple[int, int]:
        if self._base is not None or not self.counts:
            self._close()
            self.counts.append(0)
        self.counts[-1] += 1
        return _fresh_pieces(t, self._pieces)

    def done(self) -> tuple[list, list[int]]:
        self._close()
        return self.frames, self.counts


class _Table:
    """The trajectory columns and frames of a table being packed."""

    def __init__(self):
        self.np: list[int] = []
        self.nr: list[int] = []
        self.cols: dict[str, list] = {name: [] for name in _COL_NAMES}
        self.frames = _Frames()

    def run(self, s: _Source, lo: int, hi: int) -> None:
        """Trajectories ``lo:hi`` of a received table, unchanged: slices of its columns and frames."""
        for name, col in self.cols.items():
            col += s.cols[name][lo:hi]
        n_p, n_r, offs, frame = s.n_p, s.n_r, s.offs, s.frame
        self.np += n_p[lo:hi]
        self.nr += n_r[lo:hi]
        i = lo
        while i < hi:  # one slice per received frame the run spans
            k = frame[i]
            j = min(hi, s.frame_end[k])
            end = offs[j - 1] + token_nbytes(n_p[j - 1], n_r[j - 1])
            self.frames.slice(s.bases[k], offs[i], end, j - i)
            i = j

    def one(self, t: Trajectory) -> None:
        """A changed, accessed or fresh trajectory: its columns read one by one."""
        src = _forwardable(t.__dict__)
        if src is not None:
            base, off, a, b = src
            self.frames.slice(base, off, off + token_nbytes(a, b), 1)
        else:
            a, b = self.frames.fresh(t)
        self.np.append(a)
        self.nr.append(b)
        d = t.__dict__
        cols = self.cols
        for name in _SCALAR_NAMES:
            cols[name].append(d[name] if name in d else getattr(t, name))
        ex = t.extra
        cols["tool_errors"].append(int(ex.get("tool_errors", 0)) if ex else 0)


def pack_table(group_columns: dict[str, list], trajectories: Sequence[Optional[Sequence[Trajectory]]]) -> tuple:
    """Group columns (each a list, one value per group) and each group's trajectories (None: none) ->
    ``(table, frames)``. Consecutive unchanged decoded trajectories of one received table travel as slices
    of its columns and frames (no per-trajectory work). Raises ValueError for a trajectory whose arrays do
    not align."""
    tb = _Table()
    sizes = []
    run_s, lo, hi = None, 0, 0
    for trajs in trajectories:
        sizes.append(len(trajs) if trajs else 0)
        for t in trajs or ():
            d = t.__dict__
            s = d.get("_s")
            if s is not None and "_dirty" not in d and "extra" not in d:
                i = d["_i"]
                if s is run_s and i == hi:
                    hi += 1
                    continue
                if run_s is not None:
                    tb.run(run_s, lo, hi)
                run_s, lo, hi = s, i, i + 1
                continue
            if run_s is not None:
                tb.run(run_s, lo, hi)
                run_s = None
            tb.one(t)
    if run_s is not None:
        tb.run(run_s, lo, hi)
    cols = tb.cols
    cols["reward"] = [float(x) for x in cols["reward"]]
    frames, counts = tb.frames.done()
    return {"n": sizes, **group_columns, "traj": {"np": tb.np, "nr": tb.nr, **cols}, "frames": counts}, frames


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
    cols = {name: column(tc, name, typ, n, where) for name, typ in TRAJ_COLUMNS}
    cols["tool_errors"] = column(tc, "tool_errors", int, n, where)
    counts = column(table, "frames", int, _len(table.get("frames")), where)
    if sum(counts) != n or len(counts) != len(frames):
        raise ProtocolError(
            f"{where}: field 'frames' says {sum(counts)} trajectories in {len(counts)} frames; "
            f"the table has {n} trajectories and the message {len(frames)} frames"
        )
    return sizes, _trajectories(frames, counts, n_p, n_r, cols, where)


_MAX_LEN = 1 << 31  # tokens in one trajectory's field (a frame holds far less): the offsets' int64 cannot overflow


def _trajectories(frames: Sequence[Any], counts: list[int], n_p: list, n_r: list, cols: dict, where: str) -> list:
    """One WireTrajectory per row over the frames' token data; the frames must be filled exactly."""
    bases = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in frames]
    n = len(n_p)
    for key, v in (("np", n_p), ("nr", n_r)):
        if n and max(v) > _MAX_LEN:
            raise ProtocolError(f"{where}: column {key!r} holds a length over {_MAX_LEN}: {max(v)}")
    r = np.array(n_r, np.int64)
    size = 4 * np.array(n_p, np.int64) + 9 * r + (-r % 4)
    end = np.cumsum(size)  # each trajectory's end in the frames laid back to back
    frame_end = np.cumsum(counts, dtype=np.int64)  # frame -> one past its last trajectory
    frame_hi = end[frame_end - 1] if n else np.zeros(len(counts), np.int64)  # empty frames end where the last one did
    frame_hi[frame_end == 0] = 0
    frame_lo = np.concatenate(([0], frame_hi[:-1]))
    for base, lo, hi in zip(bases, frame_lo.tolist(), frame_hi.tolist()):
        if hi - lo != base.nbytes:
            raise ProtocolError(f"{where}: a frame of {base.nbytes} bytes holds trajectories of {hi - lo} bytes")
    frame = np.repeat(np.arange(len(counts)), counts)
    offs = (end - size - frame_lo[frame]).tolist()
    s = _Source(cols, bases, frame.tolist(), frame_end.tolist(), offs, n_p, n_r)
    out: list[WireTrajectory] = []
    new = WireTrajectory.__new__
    for i in range(n):
        t = new(WireTrajectory)
        d = t.__dict__
        d["_s"] = s
        d["_i"] = i
        out.append(t)
    return out


def nonfinite_logprobs(trajs: Sequence[Trajectory]) -> Optional[int]:
    """The index in ``trajs`` of the first trajectory whose ``rollout_logprobs`` hold NaN or inf, else None. A
    decoded trajectory's frame is first read whole as float32, once per frame (one vectorised pass: a frame with no
    NaN/inf bit pattern has none in its log-probs); only a frame that has some is checked trajectory by trajectory."""
    for i, t in enumerate(trajs):
        d = t.__dict__
        s = d.get("_s")
        if s is not None and "rollout_logprobs" not in d:  # token data as received: the frame's verdict first
            if s.finite is None:
                s.finite = [bool(np.isfinite(np.frombuffer(b, _F4)).all()) for b in s.bases]
            if s.finite[s.frame[d["_i"]]]:
                continue
        if not np.isfinite(np.asarray(t.rollout_logprobs, np.float32)).all():
            return i
    return None


def _len(v: Any) -> int:
    return len(v) if type(v) is list else -1


def split_groups(sizes: list[int], trajs: list) -> list[list]:
    """The flat trajectory list cut into groups of ``sizes``."""
    out, k = [], 0
    for s in sizes:
        out.append(trajs[k : k + s])
        k += s
    return out
