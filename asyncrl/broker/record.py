"""The trajectory record: the one declaration of the fields that leave the worker (pure: no I/O).

``RECORD`` lists every field that travels worker -> broker -> actor, one ``Field`` a line. Both encodings
of the record are derived from it:

- the wire (``asyncrl.broker.wire``): every ``PROMPT``/``RESPONSE``/``POSITION`` field is an array laid into the
  token frames in the declared order, in its ``dtype`` (little-endian), decoded zero-copy; every ``SCALAR`` field is
  a column of the ``traj`` table whose msgpack type follows its ``dtype``'s kind (``SCALAR_TYPES``);
- the actor (``asyncrl.actor.batch`` and ``asyncrl.actor.scatter``): every field with a ``sample`` dtype is the
  field of that name in the actor's ``Sample`` (that dtype there), and so reaches every data-parallel rank.

So a new field is one line here; nothing in the wire, ``groups_to_samples`` or the scatter changes. The types
that hold it name it as ever: the ``Trajectory`` attribute the worker fills (none for an ``extra=True`` field)
and, when the actor trains on it, the ``Sample`` attribute its loss reads.

Two rules hold the layout (``_check`` enforces them at import):
- the token ids fix the lengths: every ``PROMPT`` field holds one value per prompt token, every ``RESPONSE`` one
  per response token, every ``POSITION`` field one row per token position (prompt then response) of a width the
  trajectory gives (``width_column``: a column of the table; 0 = the field is absent, None); the ids themselves
  become the ``Sample``'s ``tokens`` and ``prompt_len``, not a field of it;
- token fields come in non-increasing item size and a trajectory's token data is padded to the first one's
  (``ALIGN``), so every field of every trajectory starts aligned in its frame, whatever the lengths.

``Trajectory``'s other fields (timings, error, the rest of ``extra``) stay in the worker; ``extra=True`` marks a
field kept in ``Trajectory.extra`` under its name (absent: the type's zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

PROMPT, RESPONSE, POSITION, SCALAR = "prompt", "response", "position", "scalar"
"""What a field holds: one value per prompt token, one per response token, an optional ``[prompt + response,
width]`` array (one row per token position), or one value per trajectory."""


@dataclass(frozen=True)
class Field:
    """One field of the record (also the shape of the actor's ``SAMPLE_FIELDS``, where ``dtype`` is the Sample's)."""

    name: str
    """The ``Trajectory`` attribute (or ``extra`` key) and the ``Sample`` attribute of the same name."""
    per: str
    """``PROMPT``, ``RESPONSE``, ``POSITION`` or ``SCALAR``."""
    dtype: np.dtype
    """The values' type: a token field's element type in the frames; a scalar's kind picks its column's type."""
    sample: Optional[np.dtype] = None
    """The actor trains on it: the dtype of its ``Sample`` field (None: the actor does not read it)."""
    extra: bool = False
    """Kept in ``Trajectory.extra[name]`` rather than as an attribute."""


_I4, _F4, _U1 = np.dtype("<i4"), np.dtype("<f4"), np.dtype(np.uint8)
_INT, _FLOAT, _BOOL, _STR = np.dtype("<i8"), np.dtype("<f8"), np.dtype(np.bool_), np.dtype(np.str_)

RECORD: tuple[Field, ...] = (
    # token fields, in their order in a frame (non-increasing item size: every view is aligned)
    Field("prompt_ids", PROMPT, _I4),
    Field("response_ids", RESPONSE, _I4),
    # routing replay: each position's experts in every layer (layer-major, -1 unknown); absent unless asked
    Field("routed_experts", POSITION, _I4, sample=np.dtype(np.int32)),
    Field("rollout_logprobs", RESPONSE, _F4, sample=np.dtype(np.float32)),  # the behaviour policy
    # each generated token's weight version (-1: a tool token): the per-token staleness the loss may use
    Field("weight_versions", RESPONSE, _I4, sample=np.dtype(np.int32)),
    Field("loss_mask", RESPONSE, _U1, sample=_BOOL),
    # one value per trajectory, in their order in the table
    Field("reward", SCALAR, _FLOAT, sample=_FLOAT),
    Field("min_version", SCALAR, _INT),  # the buffer's staleness
    Field("max_version", SCALAR, _INT),
    Field("num_turns", SCALAR, _INT),  # the per-step rollout metrics
    Field("num_tool_calls", SCALAR, _INT),
    Field("num_retractions", SCALAR, _INT),
    Field("truncated", SCALAR, _BOOL),
    Field("aborted", SCALAR, _BOOL),  # the buffer drops the group
    Field("finish_reason", SCALAR, _STR),
    Field("tool_errors", SCALAR, _INT, extra=True),
    Field("metrics", SCALAR, _STR, extra=True),  # JSON {name: number}: tool/<name>/{calls,errors}, env/<name>
)

SCALAR_TYPES: dict[str, type] = {"i": int, "u": int, "f": float, "b": bool, "U": str}
"""A scalar field's Python (and msgpack) type, by its dtype's kind."""

TOKEN_FIELDS = tuple(f for f in RECORD if f.per != SCALAR)
SCALAR_FIELDS = tuple(f for f in RECORD if f.per == SCALAR)
POSITION_FIELDS = tuple(f for f in RECORD if f.per == POSITION)
ALIGN = TOKEN_FIELDS[0].dtype.itemsize
PROMPT_BYTES = sum(f.dtype.itemsize for f in TOKEN_FIELDS if f.per == PROMPT)
"""Bytes per prompt token in a frame, all prompt fields together (``POSITION`` fields aside)."""
RESPONSE_BYTES = sum(f.dtype.itemsize for f in TOKEN_FIELDS if f.per == RESPONSE)
"""Bytes per response token in a frame (``POSITION`` fields aside)."""


def width_column(f: Field) -> str:
    """The table column of a ``POSITION`` field's row width, one value per trajectory (0: the field is absent)."""
    return f"{f.name}_width"


def token_nbytes(n_prompt: int, n_resp: int, widths: tuple[int, ...] = ()) -> int:
    """Bytes of one trajectory's token data in a frame (padded to ``ALIGN``); ``widths``: its ``POSITION`` fields'
    row widths, in their order (none given: all absent)."""
    n = PROMPT_BYTES * n_prompt + RESPONSE_BYTES * n_resp
    n += (n_prompt + n_resp) * sum(f.dtype.itemsize * w for f, w in zip(POSITION_FIELDS, widths))
    return n + (-n % ALIGN)


def sample_fields() -> tuple[Field, ...]:
    """The fields the actor trains on, as its ``Sample`` holds them (``dtype``: the ``Sample``'s)."""
    return tuple(Field(f.name, f.per, f.sample) for f in RECORD if f.sample is not None)


def _check() -> None:
    """The layout rules of the module docstring, and one name per field."""
    names = [f.name for f in RECORD]
    if len(set(names)) != len(names):
        raise ValueError(f"record: a field name is declared twice: {names}")
    if not any(f.per == PROMPT for f in RECORD) or not any(f.per == RESPONSE for f in RECORD):
        raise ValueError("record: the token ids (a PROMPT and a RESPONSE field) fix the lengths")
    for f in RECORD:
        if f.per not in (PROMPT, RESPONSE, POSITION, SCALAR):
            raise ValueError(
                f"record: field {f.name!r}: per must be PROMPT, RESPONSE, POSITION or SCALAR, got {f.per!r}"
            )
        if f.per == SCALAR and f.dtype.kind not in SCALAR_TYPES:
            raise ValueError(f"record: scalar field {f.name!r}: no column type for dtype {f.dtype}")
        if f.per != SCALAR and (f.dtype.kind not in "iufb" or f.extra):
            raise ValueError(f"record: token field {f.name!r} must be a numeric array attribute, got {f.dtype}")
        if f.sample is not None and f.sample.kind not in "iufb":
            raise ValueError(f"record: field {f.name!r}: a Sample holds numbers (tensors), got {f.sample}")
    sizes = [f.dtype.itemsize for f in TOKEN_FIELDS]
    if sizes != sorted(sizes, reverse=True):
        raise ValueError(f"record: token fields must come in non-increasing item size (aligned views): {sizes}")


_check()
