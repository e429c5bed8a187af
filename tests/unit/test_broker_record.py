"""One declaration of the trajectory record (``asyncrl.broker.record``) drives both of its encodings: the wire
(worker -> broker -> actor, ``asyncrl.broker.wire``) and the actor's per-rank scatter (``asyncrl.actor.scatter``).

The round trip below builds its trajectories from the declaration and checks every declared field, so a field
added there is covered here with no edit; the last test adds fields in a fresh process and sees them travel."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch

from asyncrl.actor import scatter
from asyncrl.actor.batch import SAMPLE_FIELDS, Sample, groups_to_samples, split_balanced
from asyncrl.broker import protocol as P
from asyncrl.broker import record, wire
from asyncrl.broker.record import POSITION, PROMPT, RECORD, SCALAR, SCALAR_TYPES
from asyncrl.broker.types import Group, PromptItem, Trajectory


def _value(rng: random.Random, f: record.Field, n_p: int, n_r: int):
    """A value of field ``f`` that is not its type's default (a dropped field cannot pass for a carried one)."""
    if f.per == POSITION:  # rows of the trajectory's width, -1 among the values (unknown)
        return np.asarray([[rng.randrange(-1, 8) for _ in range(6)] for _ in range(n_p + n_r)], f.dtype)
    if f.per != SCALAR:
        n = n_p if f.per == PROMPT else n_r
        if f.dtype.kind in "ub":
            vals = [1] + [rng.randrange(2) for _ in range(n - 1)]
        else:
            vals = [rng.randrange(1, 999) if f.dtype.kind == "i" else -rng.random() for _ in range(n)]
        return np.asarray(vals, f.dtype).tolist()  # as the agent loop builds them: lists (values the dtype holds)
    return {int: rng.randrange(1, 99), float: rng.random() + 0.5, bool: True, str: f"s{rng.randrange(99)}"}[
        SCALAR_TYPES[f.dtype.kind]
    ]


def _trajectory(rng: random.Random) -> Trajectory:
    n_p, n_r = rng.randint(1, 7), rng.randint(1, 9)
    vals = {f.name: _value(rng, f, n_p, n_r) for f in RECORD}
    extra = {f.name: vals.pop(f.name) for f in RECORD if f.extra}
    return Trajectory(**vals, extra={**extra, "stays": "in the worker"})


def _held(t: Trajectory, f: record.Field):
    return t.extra.get(f.name, SCALAR_TYPES[f.dtype.kind]()) if f.extra else getattr(t, f.name)


def test_the_wire_and_the_scatter_are_the_declarations_fields():
    t = _trajectory(random.Random(0))
    head, frame = P.finished_groups_frames([(1, [t], False, "")])
    traj = msgpack.unpackb(head, raw=False)["groups"]["traj"]
    widths = [record.width_column(f) for f in RECORD if f.per == POSITION]
    assert list(traj) == ["np", "nr", *widths, *(f.name for f in RECORD if f.per == SCALAR)]  # the columns, in order
    assert [traj[w] for w in widths] == [[6]]
    # the frame: each token field in its declared dtype, in the declared order, padded to the declared alignment
    data = b"".join(np.asarray(getattr(t, f.name), f.dtype).tobytes() for f in RECORD if f.per != SCALAR)
    assert bytes(frame) == data + b"\0" * (-len(data) % record.ALIGN)
    assert (
        len(frame)
        == wire.token_nbytes(len(t.prompt_ids), len(t.response_ids), (6,))
        == record.token_nbytes(len(t.prompt_ids), len(t.response_ids), (6,))
    )
    # the scatter sends the Sample's fields: the record's trained ones (in their Sample dtype), then the derived
    trained = [(f.name, f.per, f.sample) for f in RECORD if f.sample is not None]
    assert trained and [(f.name, f.per, f.dtype) for f in SAMPLE_FIELDS[: len(trained)]] == trained
    assert [name for name, *_ in scatter._LAYOUT] == [f.name for f in SAMPLE_FIELDS]
    assert {f.name for f in dataclasses.fields(Sample)} == {"tokens", "prompt_len", *(f.name for f in SAMPLE_FIELDS)}
    # every Trajectory field is declared, stays in the worker, or is ``extra`` (which holds the extra=True ones)
    attrs = {f.name for f in RECORD if not f.extra}
    assert attrs <= {f.name for f in dataclasses.fields(Trajectory)}
    assert {f.name for f in dataclasses.fields(Trajectory)} == attrs | set(wire._STAY) | {"extra"}


def test_worker_to_broker_to_actor_to_dp_ranks_keeps_every_declared_field():
    rng = random.Random(7)
    sent = [[_trajectory(rng) for _ in range(3)] for _ in range(4)]
    sent[1][2].aborted = False  # one kept trajectory; the others' aborted=True must travel too
    for g in sent:
        for t in g[:2]:
            t.aborted = False
    msg = P.decode(P.finished_groups_frames([(k, g, False, "") for k, g in enumerate(sent)]), allowed=P.WORKER_TYPES)
    _, got = P.unpack_finished_groups(msg)  # the broker's view
    batch = [Group(k, PromptItem(k, "q"), 0, trajs, 0, 1) for k, trajs, _, _ in got]
    table, frames = P.pack_groups(batch)
    msg = P.decode(P.encode(P.BATCH, {"groups": table}, frames), allowed=P.TO_ACTOR_TYPES)
    actor = P.unpack_groups(msg.body["groups"], msg.blobs)  # the actor's view
    for want, g in zip(sent, actor):
        for t, u in zip(want, g.trajectories):
            for f in RECORD:
                a, b = _held(t, f), _held(u, f)
                if f.per == SCALAR:
                    assert type(b) is SCALAR_TYPES[f.dtype.kind] and b == a, f.name
                else:
                    assert b.dtype == f.dtype and b.tolist() == np.asarray(a, f.dtype).tolist(), f.name
            assert "stays" not in u.extra
    samples = groups_to_samples(actor, normalize_adv_by_std=True, loss_agg_mode="token_mean")
    kept = [t for g in sent for t in g if not t.aborted]
    assert len(samples) == len(kept) == 9
    for part in split_balanced([s.num_tokens for s in samples], 2):  # each DP rank's share, as it receives it
        mine = scatter.unflatten(*scatter.flatten([samples[i] for i in part]))
        assert len(mine) == len(part) > 0
        for i, s in zip(part, mine):
            t = kept[i]
            assert s.tokens.tolist() == [*t.prompt_ids, *t.response_ids] and s.prompt_len == len(t.prompt_ids)
            for f in SAMPLE_FIELDS:
                v = getattr(s, f.name)
                if f.per == SCALAR:
                    assert type(v) is SCALAR_TYPES[f.dtype.kind] and v == getattr(samples[i], f.name), f.name
                else:
                    assert v.dtype == torch.from_numpy(np.empty(0, f.dtype)).dtype, f.name
                    assert torch.equal(v, getattr(samples[i], f.name)), f.name
            for f in record.sample_fields():  # the record's values themselves, in the Sample's dtype
                want, v = np.asarray(_held(t, f), f.dtype), getattr(s, f.name)
                assert (v == want.item()) if f.per == SCALAR else v.numpy().tolist() == want.tolist(), f.name


def test_a_misordered_declaration_is_refused(monkeypatch):
    fields = list(RECORD)
    fields.insert(0, fields.pop(next(k for k, f in enumerate(fields) if f.name == "loss_mask")))  # uint8 first
    monkeypatch.setattr(record, "RECORD", tuple(fields))
    monkeypatch.setattr(record, "TOKEN_FIELDS", tuple(f for f in fields if f.per != SCALAR))
    with pytest.raises(ValueError, match="non-increasing item size"):
        record._check()


# A new field: one line in the declaration (and the attribute of the types that hold it: the worker's
# Trajectory, the actor's Sample when it trains on it). Nothing in the wire, the scatter or groups_to_samples
# changes. A fresh process builds those modules from their sources with these lines added, then imports the rest.
NEW_FIELDS = {
    "asyncrl.broker.record": [
        (
            '    Field("rollout_logprobs", RESPONSE, _F4, sample=np.dtype(np.float32)),  # the behaviour policy',
            '    Field("ref_logprobs", RESPONSE, _F4, sample=np.dtype(np.float32)),',
        ),
        (
            '    Field("aborted", SCALAR, _BOOL),  # the buffer drops the group',
            '    Field("search_calls", SCALAR, _INT, extra=True),',
        ),
        (
            '    Field("tool_errors", SCALAR, _INT, extra=True),',
            '    Field("difficulty", SCALAR, _FLOAT, sample=_FLOAT),',
        ),
    ],
    "asyncrl.broker.types": [
        ('    """``generate_s``, ``tool_s``, ``total_s``."""', "    ref_logprobs: list = field(default_factory=list)"),
        ('    """``generate_s``, ``tool_s``, ``total_s``."""', "    difficulty: float = 0.0"),
    ],
    "asyncrl.actor.batch": [
        ("    reward: float = 0.0", "    ref_logprobs: torch.Tensor = None"),
        ("    reward: float = 0.0", "    difficulty: float = 0.0"),
    ],
}

CHILD = textwrap.dedent(
    """
    import importlib.util, sys, types

    for name, edits in NEW_FIELDS.items():  # in import order: each one's imports are the patched ones
        path = importlib.util.find_spec(name).origin
        src = open(path).read()
        for after, line in edits:
            assert src.count(after + "\\n") == 1, after
            src = src.replace(after + "\\n", after + "\\n" + line + "\\n")
        mod = sys.modules[name] = types.ModuleType(name)
        mod.__file__ = path
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)
        exec(compile(src, path, "exec"), mod.__dict__)

    import numpy as np
    from asyncrl.actor.batch import groups_to_samples
    from asyncrl.actor.scatter import flatten, unflatten
    from asyncrl.broker import protocol as P, wire
    from asyncrl.broker.types import Group, PromptItem, Trajectory

    t = Trajectory([5, 6], [7, 8, 9], [1, 0, 1], [-0.5, 0.0, -0.25], reward=1.0, ref_logprobs=[-1.0, -2.0, -3.0],
                   difficulty=0.75, extra={"search_calls": 4})
    u = Trajectory([5], [7], [1], [-0.5], reward=0.0, ref_logprobs=[-4.0], difficulty=0.5)
    head, frame = P.finished_groups_frames([(1, [t, u], False, "")])
    assert len(frame) == wire.token_nbytes(2, 3) + wire.token_nbytes(1, 1) == (8 + 3 * 17 + 1) + (4 + 17 + 3)
    _, ((_, got, _, _),) = P.unpack_finished_groups(P.decode([head, frame], allowed=P.WORKER_TYPES))
    (g,) = P.unpack_groups(*P.pack_groups([Group(1, PromptItem(1, "q"), 0, got)]))
    w = g.trajectories[0]
    assert w.ref_logprobs.tolist() == [-1.0, -2.0, -3.0] and w.ref_logprobs.dtype == np.float32
    assert w.difficulty == 0.75 and w.extra == {"search_calls": 4} and w.loss_mask.tolist() == [1, 0, 1]
    s, r = unflatten(*flatten(groups_to_samples([g], normalize_adv_by_std=False, loss_agg_mode="token_mean")))
    assert s.ref_logprobs.tolist() == [-1.0, -2.0, -3.0] and s.difficulty == 0.75 and r.difficulty == 0.5
    assert s.rollout_logprobs.tolist() == [-0.5, 0.0, -0.25] and s.tokens.tolist() == [5, 6, 7, 8, 9]
    print("carried")
    """
)


def test_a_field_added_to_the_declaration_travels_the_wire_and_the_scatter():
    code = f"NEW_FIELDS = {NEW_FIELDS!r}\n{CHILD}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "carried", out.stderr[-3000:]
