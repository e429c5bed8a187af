"""The one wire shape of trajectories: a table of typed columns in the header, token data in raw frames.

The record's fields, their types and the frame layout are declared once, in ``asyncrl.broker.record``; this
module derives the encoding and decoding from that declaration (and holds no field of its own). Every message
that carries trajectories (a worker's ``groups``, the broker's ``batch``, the broker state of a checkpoint)
holds ONE table, ``pack_table``'s output, and its frames:

    {"n":      [trajectories per group],          # then the message's group columns, e.g.
     "group_id": [...], "aborted": [...], ...     # (``protocol`` names and types them per message)
     "traj":   {"np": [...], "nr": [...],         # prompt and response tokens per trajectory, the POSITION
                "routed_experts_width": [...],    # fields' row widths, then one column
                "reward": [...], ...},            # per ``SCALAR`` field of the record, in its order
     "frames": [trajectories per frame]}

A frame holds its trajectories' token data back to back, each one laid out as the record's token fields in
their order (today ``prompt_ids int32[np] | response_ids int32[nr] | routed_experts int32[np + nr, w] |
rollout_logprobs float32[nr] | weight_versions int32[nr] | loss_mask uint8[nr]``, little-endian; ``w`` the trajectory's
``routed_experts_width`` column, 0 when it has none) and zero-padded to a multiple of ``record.ALIGN`` bytes, so
every view is aligned; the sizes must fill each frame exactly. Decoding is columnar and lazy: a decoded
trajectory holds only its table and its row; each field is read from the table's columns on first access (token
fields: read-only ``np.frombuffer`` views of the received frame), so a broker that only forwards a trajectory
never builds them. Consecutive unchanged decoded trajectories of one table are re-sent as slices of its columns and of the
frame they came in (one slice per run); one with an assigned field, or whose ``extra`` was read, is packed
field by field (its token data still forwarded when unchanged).

What travels is the record (what is read after the worker): the token fields (per-token ``weight_versions``
among them), the reward and versions (buffer, staleness), ``aborted`` (buffer), and the per-step rollout metrics'
fields (turns, tool calls, retractions, truncation, finish reason, the record's ``extra`` fields). ``timings``,
``error`` (the group carries its first error) and the rest of ``extra`` stay in the worker: a decoded trajectory
has empty ones.

Every column is checked at this edge: a list of the table's length holding its type only (an integer column
takes msgpack integers in [0, ``MAX_INT``], never a float, a bool, ``inf`` or ``NaN``); a wrong one raises
``ProtocolError`` naming the message type and the column. A non-finite reward decodes (the core counts and drops
its group); so do non-finite log-probs (``nonfinite_logprobs`` finds them; the broker drops their group).
"""

from __future__ import annotations

import array
import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from asyncrl.broker.record import (
    ALIGN,
    POSITION,
    POSITION_FIELDS,
    PROMPT_BYTES,
    RECORD,
    RESPONSE,
    RESPONSE_BYTES,
    SCALAR_FIELDS,
    SCALAR_TYPES,
    TOKEN_FIELDS,
    token_nbytes,
    width_column,
)
from asyncrl.broker.types import PromptItem, Trajectory


class ProtocolError(ValueError):
    """A malformed message, a message of another protocol version, or an unknown type."""


MAX_INT = 2**63 - 1
"""The largest integer a field or column may hold: a signed 64-bit int, what every reader of a value the broker
echoes back (a version, a step, a group id) can hold (numpy, torch, msgpack's int64), and the seeds' range
(``runner.seed``). Counters that grow by one never come near it; a larger value is a corrupt or hostile peer."""

# What the encoder and decoder read of the record, computed once (the hot paths loop over these tuples).
_TOKEN_NAMES = tuple(f.name for f in TOKEN_FIELDS)  # in their order in a frame
_TOKEN_DTYPES = tuple(f.dtype for f in TOKEN_FIELDS)
# a token field's length is (np, nr)[part]; part 2: a POSITION field, (np + nr) rows of its width
_PART = tuple(2 if f.per == POSITION else int(f.per == RESPONSE) for f in TOKEN_FIELDS)
_TOKEN_LAYOUT = tuple(zip(_TOKEN_DTYPES, _PART, (d.itemsize for d in _TOKEN_DTYPES)))  # what ``_views`` reads
_COLUMNS = tuple((f.name, SCALAR_TYPES[f.dtype.kind]) for f in SCALAR_FIELDS)  # the ``traj`` columns as they travel
_WIDTHS = tuple(width_column(f) for f in POSITION_FIELDS)  # the POSITION fields' row widths (columns, before those)
_NO_WIDTHS = (0,) * len(_WIDTHS)
_WIDTH_ITEMSIZES = np.array([f.dtype.itemsize for f in POSITION_FIELDS], np.int64)
_MAX_WIDTH = 1 << 16  # values in one row of a POSITION field (a model's layers x top-k is far less)
_SCALAR_NAMES = tuple(f.name for f in SCALAR_FIELDS if not f.extra)  # the columns held as attributes
# the columns held in ``extra``: (name, type, the value of an absent one)
_EXTRA_COLUMNS = tuple((name, typ, typ()) for (name, typ), f in zip(_COLUMNS, SCALAR_FIELDS) if f.extra)
_FLOAT_COLUMNS = tuple(name for name, typ in _COLUMNS if typ is float)  # sent as floats, ints widened
# the log-probs' dtype: ``nonfinite_logprobs`` reads whole frames as it (a frame is a multiple of ``ALIGN`` bytes)
_LOGPROBS = next(f.dtype for f in RECORD if f.name == "rollout_logprobs")


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

    __slots__ = ("cols", "bases", "frame", "frame_end", "offs", "n_p", "n_r", "widths", "finite")

    def __init__(
        self, cols: dict, bases: list, frame: list, frame_end: list, offs: list, n_p: list, n_r: list, widths: list
    ):
        self.cols = cols  # column name -> one value per trajectory (``_WIDTHS``, then ``_COLUMNS``)
        self.bases = bases  # the received frames (byte memoryviews)
        self.frame = frame  # trajectory -> its frame's index in ``bases``
        self.frame_end = frame_end  # frame -> one past its last trajectory
        self.offs = offs  # trajectory -> the byte offset of its token data in its frame
        self.n_p, self.n_r = n_p, n_r
        self.widths = widths  # trajectory -> its POSITION fields' row widths
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
        if name in _TOKEN_SET:
            views = _views(s.bases[s.frame[i]], s.offs[i], s.n_p[i], s.n_r[i], widths=s.widths[i])
            d["_views"] = views
            for f, a in zip(_TOKEN_NAMES, views):
                d.setdefault(f, a)
            return d[name]
        if name in _SCALAR_SET:  # all of them at once: a reader reads several (one call here, not one each)
            cols = s.cols
            for f in _SCALAR_NAMES:
                if f not in d:  # a field assigned before keeps its new value
                    d[f] = cols[f][i]
            return d[name]
        if name == "extra":  # the record's fields kept there, those that are set (not their type's zero)
            cols = s.cols
            v = {k: cols[k][i] for k, _, _ in _EXTRA_COLUMNS if cols[k][i]}
        else:
            v = _STAY[name]()
        d[name] = v
        return v


_TOKEN_SET = frozenset(_TOKEN_NAMES)
_SCALAR_SET = frozenset(_SCALAR_NAMES)
_STAY = {"error": str, "timings": dict}


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
        for f in _TOKEN_NAMES:
            kw[f] = None if kw[f] is None else np.array(kw[f])
        return Trajectory, tuple(kw[f.name] for f in dataclasses.fields(Trajectory))


for _f in dataclasses.fields(Trajectory):
    setattr(WireTrajectory, _f.name, _Field(_f.name))


def _views(base, off: int, n_p: int, n_r: int, *, widths: tuple) -> list[Optional[np.ndarray]]:
    """The token fields of the trajectory at ``off`` in ``base``, in the record's order: read-only views (a
    ``POSITION`` field ``[np + nr, width]``, None where its width is 0)."""
    lens = (n_p, n_r)
    out: list[Optional[np.ndarray]] = []
    w = iter(widths)
    for dtype, part, itemsize in _TOKEN_LAYOUT:
        if part == 2:
            width = next(w)
            n = (n_p + n_r) * width
            out.append(np.frombuffer(base, dtype, n, off).reshape(n_p + n_r, width) if width else None)
        else:
            n = lens[part]
            out.append(np.frombuffer(base, dtype, n, off))
        off += itemsize * n
    return out


def _forwardable(d: dict) -> Optional[tuple]:
    """``(base, offset, np, nr, widths)`` when ``d`` is a decoded trajectory's ``__dict__`` whose token fields are
    unchanged."""
    s = d.get("_s")
    if s is None:
        return None
    views = d.get("_views")
    if views is None:
        if not d.keys().isdisjoint(_TOKEN_NAMES):
            return None
    elif not all(d.get(f) is v for f, v in zip(_TOKEN_NAMES, views)):
        return None
    i = d["_i"]
    return s.bases[s.frame[i]], s.offs[i], s.n_p[i], s.n_r[i], s.widths[i]


# ---------------------------------------------------------------- encoding
_TOKEN_VALUES = operator.attrgetter(*_TOKEN_NAMES)  # a trajectory's token fields, in the record's order (one C call)
_FIRST_PROMPT, _FIRST_RESPONSE = _PART.index(0), _PART.index(1)  # the fields whose lengths are (np, nr)


def _fresh_pieces(t: Trajectory, pieces: list) -> tuple[int, int, tuple]:
    """Appends ``t``'s token data (its fields in the record's order, then the padding); its ``(np, nr, widths)``.
    Raises ValueError before appending anything when a field's length is not its part's (a ``POSITION`` field: a
    ``[np + nr, width]`` array of 1 to ``_MAX_WIDTH`` columns, or None: width 0)."""
    arrays = [v if v is None else np.ascontiguousarray(v, d) for v, d in zip(_TOKEN_VALUES(t), _TOKEN_DTYPES)]
    n_p, n_r = len(arrays[_FIRST_PROMPT]), len(arrays[_FIRST_RESPONSE])
    lens, widths = (n_p, n_r, n_p + n_r), []
    for a, part, name in zip(arrays, _PART, _TOKEN_NAMES):  # a loop: this runs once per trajectory a worker sends
        if part == 2 and a is not None and (a.ndim != 2 or not 0 < a.shape[1] <= _MAX_WIDTH):
            raise ValueError(f"trajectory field {name!r} must be [positions, 1..{_MAX_WIDTH}], got {a.shape}")
        if part == 2:
            widths.append(0 if a is None else a.shape[1])
        if a is not None and len(a) != lens[part]:
            got = ", ".join(f"{0 if x is None else len(x)} {n}" for n, x in zip(_TOKEN_NAMES, arrays))
            raise ValueError(f"trajectory arrays do not align (one entry per token, one row per position): {got}")
    size = 0
    for a in arrays:
        if a is not None:
            pieces.append(a.tobytes())
            size += a.nbytes
    pieces.append(b"\0" * (-size % ALIGN))
    return n_p, n_r, tuple(widths)


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

    def fresh(self, t: Trajectory) -> tuple[int, int, tuple]:
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
        self.cols: dict[str, list] = {name: [] for name in (*_WIDTHS, *(name for name, _ in _COLUMNS))}
        self.frames = _Frames()

    def run(self, s: _Source, lo: int, hi: int) -> None:
        """Trajectories ``lo:hi`` of a received table, unchanged: slices of its columns and frames."""
        for name, col in self.cols.items():
            col += s.cols[name][lo:hi]
        n_p, n_r, widths, offs, frame = s.n_p, s.n_r, s.widths, s.offs, s.frame
        self.np += n_p[lo:hi]
        self.nr += n_r[lo:hi]
        i = lo
        while i < hi:  # one slice per received frame the run spans
            k = frame[i]
            j = min(hi, s.frame_end[k])
            end = offs[j - 1] + token_nbytes(n_p[j - 1], n_r[j - 1], widths[j - 1])
            self.frames.slice(s.bases[k], offs[i], end, j - i)
            i = j

    def one(self, t: Trajectory) -> None:
        """A changed, accessed or fresh trajectory: its columns read one by one."""
        src = _forwardable(t.__dict__)
        if src is not None:
            base, off, a, b, widths = src
            self.frames.slice(base, off, off + token_nbytes(a, b, widths), 1)
        else:
            a, b, widths = self.frames.fresh(t)
        self.np.append(a)
        self.nr.append(b)
        d = t.__dict__
        cols = self.cols
        for name, w in zip(_WIDTHS, widths):
            cols[name].append(w)
        for name in _SCALAR_NAMES:
            cols[name].append(d[name] if name in d else getattr(t, name))
        ex = t.extra
        for name, typ, absent in _EXTRA_COLUMNS:
            cols[name].append(typ(ex.get(name, absent)) if ex else absent)


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
    for name in _FLOAT_COLUMNS:
        cols[name] = [float(x) for x in cols[name]]
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
    cols = {name: column(tc, name, int, n, where) for name in _WIDTHS}
    cols.update({name: column(tc, name, typ, n, where) for name, typ in _COLUMNS})
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
    for key, v, most in (("np", n_p, _MAX_LEN), ("nr", n_r, _MAX_LEN), *((w, cols[w], _MAX_WIDTH) for w in _WIDTHS)):
        if n and max(v) > most:
            raise ProtocolError(f"{where}: column {key!r} holds a length or width over {most}: {max(v)}")
    size = PROMPT_BYTES * np.array(n_p, np.int64) + RESPONSE_BYTES * np.array(n_r, np.int64)
    widths = np.array([cols[name] for name in _WIDTHS], np.int64).reshape(len(_WIDTHS), n)  # [fields, n]
    size += (np.array(n_p, np.int64) + np.array(n_r, np.int64)) * (_WIDTH_ITEMSIZES @ widths)
    size += -size % ALIGN  # ``token_nbytes`` of every row at once
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
    s = _Source(cols, bases, frame.tolist(), frame_end.tolist(), offs, n_p, n_r, list(zip(*widths.tolist())))
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
                s.finite = [bool(np.isfinite(np.frombuffer(b, _LOGPROBS)).all()) for b in s.bases]
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
