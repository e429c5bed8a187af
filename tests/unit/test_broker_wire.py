"""The one wire shape of trajectories (``asyncrl.broker.wire``) through every message that carries them:
a worker's ``groups`` (with ``done`` notices), the actor's ``batch`` and the checkpoint's broker state."""

from __future__ import annotations

import copy
import pickle

import msgpack
import numpy as np
import pytest

from asyncrl.broker import protocol as P
from asyncrl.broker.types import Group, PromptItem, Trajectory


def traj(vmin=0, n=3, reward=1.0, **kw) -> Trajectory:
    return Trajectory(
        list(range(4)), list(range(n)), [1] * n, [-0.5] * n, reward=reward, min_version=vmin, max_version=vmin, **kw
    )


RICH = dict(
    weight_versions=[3, -1],
    min_version=3,
    max_version=4,
    num_turns=2,
    num_tool_calls=1,
    num_retractions=1,
    truncated=True,
    finish_reason="answer",
    error="",
    timings={"total_s": 1.5},
    extra={"tool_errors": 2, "unread": "x"},
)


def rich() -> Trajectory:
    return Trajectory([1, 2, 3], [4, 5], [1, 0], [-0.25, 0.0], reward=2.0, **RICH)


def worker_message(entries, done=()):
    return P.decode(P.finished_groups_frames(entries, done), allowed=P.WORKER_TYPES)


def batch_message(groups):
    table, frames = P.pack_groups(groups)
    return P.decode(P.encode(P.BATCH, {"groups": table}, frames), allowed=P.TO_ACTOR_TYPES)


def test_what_travels_and_what_stays_in_the_worker():
    done, got = P.unpack_finished_groups(worker_message([(10, [rich(), traj(vmin=1)], False, "")]))
    t = got[0][1][0]
    assert (t.reward, t.min_version, t.max_version, t.num_turns, t.num_tool_calls, t.num_retractions) == (
        2.0,
        3,
        4,
        2,
        1,
        1,
    )
    assert t.truncated and t.finish_reason == "answer" and t.extra == {"tool_errors": 2}  # the runner's metrics
    assert t.response_ids.tolist() == [4, 5] and t.loss_mask.tolist() == [1, 0]
    assert t.rollout_logprobs.tolist() == [-0.25, 0.0] and t.prompt_ids.tolist() == [1, 2, 3]
    assert t.weight_versions.tolist() == [3, -1]  # per-token versions travel (the loss's token staleness)
    assert got[0][1][1].weight_versions.tolist() == [1, 1, 1]  # built without them: min_version per generated token
    # timings and unread extra stay in the worker
    assert t.timings == {} and done == []


def test_batch_roundtrip_and_malformed_frames():
    g = Group(
        7, PromptItem(2, "q", ["a"]), epoch=1, trajectories=[rich(), rich()], issued_version=2, finished_version=3
    )
    msg = batch_message([g])
    (g2,) = P.unpack_groups(msg.body["groups"], msg.blobs)
    t2 = g2.trajectories[1]
    assert isinstance(t2.response_ids, np.ndarray) and t2.response_ids.dtype == np.int32
    assert t2.response_ids.tolist() == [4, 5] and t2.rollout_logprobs.dtype == np.float32
    assert (g2.group_id, g2.epoch, g2.item.answers, g2.issued_version, g2.finished_version, g2.min_version) == (
        7,
        1,
        ["a"],
        2,
        3,
        3,
    )
    for bad in (
        [b"\xc1"],
        [msgpack.packb({"v": 99, "t": "hello"})],
        [msgpack.packb({"v": P.PROTOCOL_VERSION, "t": "nope"})],
        [msgpack.packb([1, 2])],
    ):
        with pytest.raises(P.ProtocolError):
            P.decode(bad, allowed=P.WORKER_TYPES)
    with pytest.raises(P.ProtocolError, match="frame of 3 bytes"):
        P.unpack_groups(msg.body["groups"], [b"\x00" * 3])
    with pytest.raises(P.ProtocolError, match="'frames'"):
        P.unpack_groups(msg.body["groups"], [])


def test_token_frames_are_aligned_and_padded():
    msg = worker_message([(1, [traj(n=1), traj(n=2), traj(n=5)], False, "")])
    (frame,) = msg.blobs
    assert len(frame) == sum(4 * 4 + 13 * n + (-n % 4) for n in (1, 2, 5))  # ids, logprobs, versions, mask
    _, ((_, ts, _, _),) = P.unpack_finished_groups(msg)
    for t in ts:
        assert t.prompt_ids.ctypes.data % 4 == 0 and t.rollout_logprobs.ctypes.data % 4 == 0


def test_forwarded_groups_are_slices_of_the_received_frame():
    """Worker message -> broker (decode) -> batch (consecutive unchanged trajectories: ONE zero-copy slice)."""
    entries = [(10, [rich(), traj(vmin=1)], False, ""), (11, [traj(n=1), traj(n=2)], False, ""), (12, None, True, "x")]
    msg = worker_message(entries)
    assert len(msg.blobs) == 1
    _, got = P.unpack_finished_groups(msg)
    assert [(g, a, e) for g, _, a, e in got] == [(10, False, ""), (11, False, ""), (12, True, "x")]
    assert got[2][1] is None and "response_ids" not in got[0][1][0].__dict__  # nothing materialized
    groups = [Group(gid, PromptItem(gid, f"q{gid}"), 1, trajs, 1, 4) for gid, trajs, _, _ in got[:2]]
    table, frames = P.pack_groups(groups)
    assert len(frames) == 1 and memoryview(frames[0]).obj is memoryview(msg.blobs[0]).obj
    back = P.unpack_groups(table, [bytes(f) for f in frames])
    assert [[t.response_ids.tolist() for t in g.trajectories] for g in back] == [[[4, 5], [0, 1, 2]], [[0], [0, 1]]]
    assert back[0].trajectories[0].extra == {"tool_errors": 2} and back[1].finished_version == 4
    # a changed trajectory is packed afresh with its new values; the others are still forwarded
    t = got[1][1][0]
    t.response_ids, t.loss_mask, t.rollout_logprobs = np.array([9, 9], np.int32), [1, 1], [0.0, 0.0]
    t.weight_versions = [0, 0]
    got[0][1][1].reward = -1.0
    table, frames = P.pack_groups(groups)
    back = P.unpack_groups(table, frames)
    assert len(frames) == 3 and back[1].trajectories[0].response_ids.tolist() == [9, 9]
    assert back[0].trajectories[1].reward == -1.0 and back[1].trajectories[1].response_ids.tolist() == [0, 1]


def test_forwarded_columns_follow_changes_and_reads_of_extra():
    """Unchanged decoded trajectories travel as slices of the columns they came in; one whose field was
    assigned, or whose ``extra`` was read (and may have been changed in place), is read field by field."""
    _, ((_, ts, _, _),) = P.unpack_finished_groups(
        worker_message([(1, [rich(), traj(vmin=1), traj(vmin=2)], False, "")])
    )
    ts[1].num_turns = 7
    ts[2].extra["tool_errors"] = 5
    (g,) = P.unpack_groups(*P.pack_groups([Group(1, PromptItem(1, "q"), 0, ts)]))
    got = [(t.num_turns, t.min_version, t.extra, t.response_ids.tolist()) for t in g.trajectories]
    assert got == [(2, 3, {"tool_errors": 2}, [4, 5]), (7, 1, {}, [0, 1, 2]), (0, 2, {"tool_errors": 5}, [0, 1, 2])]
    # groups taken out of order, and from two received tables, keep each trajectory's own data
    _, ((_, us, _, _),) = P.unpack_finished_groups(worker_message([(2, [traj(vmin=8, n=1)], False, "")]))
    back = P.unpack_groups(
        *P.pack_groups([Group(2, PromptItem(2, "q"), 0, [us[0], ts[0]]), Group(1, PromptItem(1, "q"), 0, ts[::-1])])
    )
    assert [[(t.min_version, len(t.response_ids)) for t in b.trajectories] for b in back] == [
        [(8, 1), (3, 2)],
        [(2, 3), (1, 3), (3, 2)],
    ]
    # a decoded table of several frames (a checkpoint's buffer) is re-sent as one zero-copy slice per frame
    table, frames = P.pack_groups(back)
    again = P.unpack_groups(table, frames)
    table2, frames2 = P.pack_groups(again)
    assert len(frames2) == len(frames) > 1 and [memoryview(f).obj for f in frames2] == [
        memoryview(f).obj for f in frames
    ]
    assert [
        [(t.min_version, t.response_ids.tolist()) for t in g.trajectories] for g in P.unpack_groups(table2, frames2)
    ] == [[(t.min_version, t.response_ids.tolist()) for t in g.trajectories] for g in back]


def test_wire_trajectory_is_lazy_and_copies_to_a_plain_trajectory():
    _, ((_, (t,), _, _),) = P.unpack_finished_groups(worker_message([(1, [traj(vmin=4)], False, "")]))
    assert "response_ids" not in t.__dict__ and t.min_version == 4 and t.reward == 1.0
    assert t.response_ids.tolist() == [0, 1, 2] and not t.response_ids.flags.writeable
    for c in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(c) is Trajectory and c.loss_mask.tolist() == [1, 1, 1] and c.min_version == 4
        assert c.response_ids.flags.writeable


def test_done_notices_travel_before_the_groups():
    done, got = P.unpack_finished_groups(worker_message([(3, [traj()], False, "")], done=[(5, 0), (5, 1)]))
    assert done == [(5, 0), (5, 1)] and [g for g, *_ in got] == [3]
    assert P.unpack_finished_groups(worker_message([], done=[(6, 1)])) == ([(6, 1)], [])


def test_broker_state_roundtrip():
    g = Group(4, PromptItem(1, "q", ["a"], "src", {"k": 1}), 2, [rich(), traj()], 1, 2)
    state = {
        "version": 3,
        "next_group_id": 5,
        "dataloader": {"epoch": 0, "position": 2, "seed": 0, "num_prompts": 4},
        "queued": [(PromptItem(2, "r"), 0)],
        "inflight": [],
        "buffered": [g],
        "counters": {"finished": 1},
    }
    body, frames = P.pack_state(state)
    back = P.unpack_state(*P.state_from_bytes(P.state_to_bytes(body, frames)))
    (g2,) = back["buffered"]
    assert (g2.group_id, g2.item, g2.epoch, g2.issued_version) == (4, g.item, 2, 1)
    assert [t.response_ids.tolist() for t in g2.trajectories] == [[4, 5], [0, 1, 2]]
    assert back["queued"][0][0].index == 2 and back["counters"] == {"finished": 1}
    old = msgpack.packb({"v": 1, "state": body, "blobs": []})
    with pytest.raises(P.ProtocolError, match="protocol version 1"):
        P.state_from_bytes(old)


def _worker_table():
    header = msgpack.unpackb(P.finished_groups_frames([(1, [traj(), traj(n=2)], False, "")])[0], raw=False)
    return header


@pytest.mark.parametrize(
    "where,value,names",
    [
        (("groups", "group_id"), ["x"], "group_id"),  # not a group id
        (("groups", "group_id"), [1, 2], "group_id"),  # one more than groups
        (("groups", "aborted"), [1], "aborted"),  # not a bool
        (("groups", "n"), [3], "np"),  # more trajectories than the columns hold
        (("groups", "traj", "min_version"), ["0", 0], "min_version"),  # a version that is not an integer
        (("groups", "traj", "max_version"), [float("inf"), 0], "max_version"),
        (("groups", "traj", "num_turns"), [-1, 0], "num_turns"),
        (("groups", "traj", "num_tool_calls"), [0, True], "num_tool_calls"),  # a bool is no count
        (("groups", "traj", "num_retractions"), [1.0, 0], "num_retractions"),  # nor is a float
        (("groups", "group_id"), [-3], "group_id"),  # a negative group id
        (("groups", "traj", "truncated"), [False, 0], "truncated"),  # an int is no bool
        (("groups", "traj", "finish_reason"), ["stop", None], "finish_reason"),
        (("groups", "traj", "reward"), ["1", 0.0], "reward"),
        (("groups", "traj", "nr"), [30, 2], "frame"),  # past the end of the frame
        (("groups", "traj", "routed_experts_width"), [2, 0], "frame"),  # rows the frame does not hold
        (("groups", "traj", "routed_experts_width"), [-1, 0], "routed_experts_width"),
        (("groups", "traj", "routed_experts_width"), [1.0, 0], "routed_experts_width"),  # a float is no width
        (("groups", "traj", "routed_experts_width"), [2**40, 0], "routed_experts_width"),  # past any model's
        (("groups", "traj", "routed_experts_width"), None, "routed_experts_width"),
        (("groups", "traj", "np"), None, "np"),
        (("groups", "traj", "np"), [2**63, 4], "np"),  # a length past int64: refused before any offset is computed
        (("groups", "frames"), [0, 2], "frames"),  # an empty frame that is not there
        (("groups", "traj"), "nope", "traj"),
        (("groups",), "nope", "map"),
        (("done",), [[1]], "done"),
        (("done",), [[1, -1]], "done"),
    ],
)
def test_malformed_groups_message_is_a_protocol_error_naming_the_field(where, value, names):
    header = _worker_table()
    d = header
    for k in where[:-1]:
        d = d[k]
    d[where[-1]] = value
    frames = P.finished_groups_frames([(1, [traj(), traj(n=2)], False, "")])[1:]
    msg = P.decode([msgpack.packb(header), *frames], allowed=P.WORKER_TYPES)
    with pytest.raises(P.ProtocolError, match=names) as e:
        P.unpack_finished_groups(msg)
    assert "groups" in str(e.value)


def test_nonfinite_reward_decodes():
    _, ((_, ts, _, _),) = P.unpack_finished_groups(
        worker_message([(1, [traj(reward=float("nan")), traj(reward=float("inf"))], False, "")])
    )
    assert np.isnan(ts[0].reward) and ts[1].reward == float("inf")


def test_misaligned_trajectory_is_refused_by_the_sender():
    bad = traj()
    bad.loss_mask = [1]
    with pytest.raises(ValueError, match="do not align"):
        P.finished_groups_frames([(1, [bad], False, "")])
    short = traj(routed_experts=np.zeros((6, 4), np.int32))  # 7 positions (4 prompt + 3 response), 6 rows
    with pytest.raises(ValueError, match="do not align"):
        P.finished_groups_frames([(1, [short], False, "")])
    for shape in ((7,), (7, 0)):  # one row per position, of at least one value
        with pytest.raises(ValueError, match=r"'routed_experts' must be \[positions, 1\.\."):
            P.finished_groups_frames([(1, [traj(routed_experts=np.zeros(shape, np.int32))], False, "")])


def test_routed_experts_travel_only_where_given():
    rows = np.arange(7 * 4, dtype=np.int32).reshape(7, 4) - 1  # -1 (unknown) among them
    sent = [traj(routed_experts=rows), traj(n=2), traj(n=1, routed_experts=rows[:5, :2].copy())]
    _, ((_, got, _, _),) = P.unpack_finished_groups(worker_message([(1, sent, False, "")]))
    assert got[0].routed_experts.dtype == np.int32 and got[0].routed_experts.tolist() == rows.tolist()
    assert got[1].routed_experts is None and got[2].routed_experts.tolist() == rows[:5, :2].tolist()
    assert got[0].loss_mask.tolist() == [1, 1, 1] and got[2].rollout_logprobs.tolist() == [-0.5]  # after the rows
    # forwarded as received (slices of the frame), a changed one packed afresh; pickled: a plain Trajectory
    got[1].routed_experts = rows[:6].copy()
    msg = batch_message([Group(1, PromptItem(1, "q"), 0, got)])
    (g,) = P.unpack_groups(msg.body["groups"], msg.blobs)
    assert [t.routed_experts.tolist() for t in g.trajectories] == [
        rows.tolist(),
        rows[:6].tolist(),
        rows[:5, :2].tolist(),
    ]
    plain = pickle.loads(pickle.dumps(g.trajectories[0]))
    assert type(plain) is Trajectory and plain.routed_experts.tolist() == rows.tolist()
    assert pickle.loads(pickle.dumps(got[1])).routed_experts.tolist() == rows[:6].tolist()
