"""Property-based fuzzing of the broker's decoder and handlers over real ZeroMQ sockets (issue 15).

Thousands of frames -- non-finite numbers and floats in integer fields, wrong types, huge and empty frames,
valid messages with one field corrupted -- are sent to a broker. The properties, checked after every frame:
- the broker never dies (in process: ``serve_once`` never raises; as a process: it keeps answering);
- a rejected frame (counted ``malformed`` or answered ``error``) leaves the core's counters unchanged;
- afterwards the broker still answers a valid request (status, and a whole group trained end to end).

Plus one test per defect of issue 15: ``inf``/``NaN`` in each integer field, a non-string ``worker_id``, and a
NaN/inf reward (counted as ``nonfinite_rewards``, never trained on).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.broker import protocol as P
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.server import BrokerServer
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.runner.broker_process import start_broker

GROUP_SIZE = 2
RECV_TIMEOUT_S = 10.0

# ---------------------------------------------------------------- strategies
NASTY_NUMBERS = [
    math.inf,
    -math.inf,
    math.nan,
    1e300,
    -0.0,
    0.5,
    1.0,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    -1,
    0,
    1,
    3,
    True,
    False,
]
scalars = st.one_of(
    st.sampled_from(NASTY_NUMBERS),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.text(max_size=8),
    st.binary(max_size=8),
)
nasty = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "group_id",
    "index",
    "step",
    "version",
    "timeout_s",
    "actor_version",
    "worker_id",
    "capacity",
    "group_ids",
    "done",
    "groups",
    "mode",
    "state",
    "aborted",
    "error",
]
# every type but ``shutdown`` (a valid one stops the broker, as it should) and ``status`` (it has no fields, and
# its answer is the probe the checks read)
TYPES = sorted((P.WORKER_TYPES | P.ACTOR_TYPES) - {P.SHUTDOWN, P.STATUS}) + ["welcome", "nope", ""]
TABLE_KEYS = ["n", "group_id", "aborted", "error", "frames", "traj"]
TRAJ_KEYS = ["np", "nr", "reward", "min_version", "max_version", "num_turns", "truncated", "aborted", "tool_errors"]
column = st.lists(st.one_of(nasty, st.integers(0, 8)), max_size=3) | nasty
table = st.fixed_dictionaries(
    {},
    optional={
        **{k: column for k in TABLE_KEYS[:-1]},
        "traj": st.dictionaries(st.sampled_from(TRAJ_KEYS), column, max_size=9) | nasty,
    },
)
blob = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\0" * (1 << 20)]))


@st.composite
def random_header(draw) -> tuple[dict, list]:
    v = P.PROTOCOL_VERSION
    body = {"v": draw(st.sampled_from([v, v, v, v + 1, str(v), None, float(v)])), "t": draw(st.sampled_from(TYPES))}
    for k in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        if k == "groups":
            body[k] = draw(table | nasty)
        elif k == "done":
            body[k] = draw(st.lists(st.lists(st.one_of(st.integers(0, 8), nasty), max_size=3), max_size=3) | nasty)
        else:
            body[k] = draw(nasty)
    return body, []


def _valid_groups_body(gid: int) -> tuple[dict, list]:
    frames = P.finished_groups_frames([(gid, [_traj(1.0), _traj(0.0)], False, "")])
    return msgpack.unpackb(frames[0], raw=False), frames[1:]


def _traj(reward: float) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        loss_mask=[1, 1, 1],
        rollout_logprobs=[-0.5] * 3,
        reward=reward,
        weight_versions=[0, 0, 0],
    )


V = P.PROTOCOL_VERSION
VALID = {
    "done": lambda: ({"v": V, "t": P.GROUPS, "done": [[0, 0]]}, []),
    P.GROUPS: lambda: _valid_groups_body(0),
    P.GET_BATCH: lambda: ({"v": V, "t": P.GET_BATCH, "step": 0, "timeout_s": 0.0, "actor_version": None}, []),
    P.SYNC_END: lambda: ({"v": V, "t": P.SYNC_END, "version": 0}, []),
    P.BATCH_FILTERED: lambda: ({"v": V, "t": P.BATCH_FILTERED, "group_ids": []}, []),
    P.HELLO: lambda: ({"v": V, "t": P.HELLO, "worker_id": "fuzz", "capacity": 4}, []),
}


@st.composite
def corrupted_valid(draw) -> tuple[dict, list]:
    """A valid message of one type with one field (or one value of a ``groups`` table's column) replaced."""
    header, blobs = VALID[draw(st.sampled_from(sorted(VALID)))]()
    keys = [k for k in header if k not in ("v", "t")]
    bad = draw(st.sampled_from(NASTY_NUMBERS) | nasty)
    if "groups" in header and draw(st.booleans()):
        t = header["groups"]
        cols = [(t, k) for k in TABLE_KEYS[:-1]] + [(t["traj"], k) for k in t["traj"]]
        where, key = draw(st.sampled_from(cols))
        col = where[key]
        if col and draw(st.booleans()):
            col[draw(st.integers(0, len(col) - 1))] = bad
        else:
            where[key] = bad
    else:
        header[draw(st.sampled_from(keys))] = bad
    return header, blobs


@st.composite
def fuzz_message(draw) -> list[bytes]:
    kind = draw(st.sampled_from(["raw", "header", "header", "corrupt", "corrupt"]))
    if kind == "raw":
        frames = draw(st.lists(blob, min_size=1, max_size=3))
    else:
        header, blobs = draw(random_header()) if kind == "header" else draw(corrupted_valid())
        frames = [msgpack.packb(header, use_bin_type=True), *[bytes(b) for b in blobs]]
        frames += draw(st.lists(blob, max_size=2))
    return frames


# ---------------------------------------------------------------- the two brokers: in this process, and a process
def _prompts(n: int = 12) -> list[PromptItem]:
    return [PromptItem(i, f"question {i}", [f"answer {i}"]) for i in range(n)]


def _settings() -> CoreSettings:
    return CoreSettings(
        rollout_batch_size=2,
        group_size=GROUP_SIZE,
        max_inflight_groups=4,
        max_buffered_groups=8,
        max_dropped_groups_per_step=10**9,
        worker_heartbeat_timeout_s=3600,
        no_data_warning_s=3600,
    )


class Peer:
    """One DEALER connection (identity ``fuzz``) that sends the fuzz frames and, after them, a ``status`` request
    on the same connection: ZeroMQ keeps a connection's order, so the status answer describes the broker after
    the frames were handled. ``_pump`` lets an in-process broker run meanwhile."""

    def __init__(self, address: str, ctx: zmq.Context, identity: bytes = b"fuzz"):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def _pump(self, timeout_s: float) -> None:
        self.sock.poll(int(timeout_s * 1000))

    def exchange(self, *messages: list) -> tuple[list[P.Message], dict]:
        """-> (the replies before the status answer, the status)."""
        for frames in messages:
            self.sock.send_multipart(frames)
        self.sock.send_multipart(P.encode(P.STATUS))
        replies, deadline = [], time.monotonic() + RECV_TIMEOUT_S
        while True:
            while self.sock.poll(0):
                msg = P.decode(self.sock.recv_multipart())
                if msg.type == P.STATUS:
                    return replies, msg.body
                replies.append(msg)
            assert time.monotonic() < deadline, "the broker stopped answering"
            self._pump(0.05)


class InProcessPeer(Peer):
    """A ``BrokerServer`` in this process over real TCP sockets, run one ``serve_once`` round at a time (an
    exception out of it is what would have killed the broker process)."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.core = BrokerCore(_prompts(), settings=_settings(), clock=time.monotonic)
        self.server = BrokerServer(self.core, tick_s=3600.0, context=self.ctx)
        self.poller = zmq.Poller()
        self.poller.register(self.server.sock, zmq.POLLIN)
        super().__init__(self.server.address, self.ctx)

    def _pump(self, timeout_s: float) -> None:
        self.server.serve_once(self.poller, timeout_s=0.002)
        self.sock.poll(2)

    def close(self) -> None:
        self.sock.close(0)
        self.server.sock.close(0)
        self.ctx.term()


def _hello(worker_id: str = "fuzz") -> list:
    return P.encode(P.HELLO, {"worker_id": worker_id, "capacity": 4})


def _rejected(s0: dict, s1: dict) -> bool:
    a, b = s0["stats"], s1["stats"]
    return b.get("malformed", 0) > a.get("malformed", 0) or b.get("actor_errors", 0) > a.get("actor_errors", 0)


def check_frame(peer: Peer, frames: list) -> bool:
    """Send one fuzz message; a rejected one must leave the counters unchanged. -> whether it was rejected."""
    _, s0 = peer.exchange()
    if "fuzz" not in s0["workers"]:
        _, s0 = peer.exchange(_hello())
    replies, s1 = peer.exchange(frames)
    assert s1["failure"] is None or s0["failure"] is not None
    if _rejected(s0, s1):
        assert s1["counters"] == s0["counters"], f"a rejected frame moved the counters: {frames!r:.300}"
        return True
    return False


def train_one_batch(peer: Peer) -> None:
    """The broker still works after the fuzzing: whatever state the valid frames left (held issuing, a drain
    sync, a raised version, a pending request), a fresh worker's two groups are trained as one batch."""
    _, s = peer.exchange()
    # valid fuzz hellos may have registered more worker ids on this connection: every one says bye
    _, s = peer.exchange(*[P.encode(P.BYE, {"worker_id": w}) for w in s["workers"]], P.encode(P.RELEASE_ISSUING))
    assert s["workers"] == {} and s["num_inflight_groups"] == 0, s
    # the status answer is a barrier: the hello's issues come before it, also when one round handled both
    replies, s = peer.exchange(P.encode(P.SYNC_END, {"version": s["version"]}), _hello())
    gids = [r[0] for m in replies if m.type == P.ISSUE for r in m.body["rows"]]
    assert len(gids) >= 2, (replies, {k: v for k, v in s.items() if k != "stats"})
    trained = s["counters"].get("trained", 0)
    done = [P.finished_groups_frames([(gid, [_traj(1.0), _traj(0.0)], False, "")]) for gid in gids[:2]]
    replies, s = peer.exchange(
        *done, P.encode(P.GET_BATCH, {"step": 7, "timeout_s": 5.0, "actor_version": s["version"]})
    )
    assert [m.type for m in replies if m.type in (P.BATCH, P.ERROR, P.TIMEOUT)] == [P.BATCH], replies
    assert s["counters"]["trained"] >= trained + 2


@pytest.mark.slow
def test_fuzz_in_process_never_fatal_counters_unchanged():
    """1000 fuzz messages against one long-lived in-process broker (state accumulates, as in a run)."""
    peer = InProcessPeer()
    outcome = []

    @settings(
        max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
    )
    @given(frames=fuzz_message())
    def one(frames):
        outcome.append(check_frame(peer, frames))

    try:
        one()
        assert len(outcome) >= 1000 and sum(outcome) > 500, (len(outcome), sum(outcome))
        train_one_batch(peer)
    finally:
        peer.close()


@pytest.fixture
def broker():
    b = InProcessPeer()
    b.exchange(_hello())
    yield b
    b.close()


def _send(b: InProcessPeer, *messages: list) -> list[P.Message]:
    return b.exchange(*messages)[0]


# ---------------------------------------------------------------- one test per defect (in process)
INT_FIELDS = [
    (P.GET_BATCH, "step"),
    (P.GET_BATCH, "actor_version"),
    (P.SYNC_END, "version"),
    (P.GET_BATCH, "timeout_s"),
]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1.0])
@pytest.mark.parametrize("msg_type,key", INT_FIELDS)
def test_non_integer_in_an_integer_field_is_rejected_naming_it(broker, msg_type, key, value):
    if key == "timeout_s" and value == 1.0:
        pytest.skip("1.0 is a valid timeout")
    header, blobs = VALID[msg_type]()
    header[key] = value
    counters = dict(broker.core.counters)
    errors = [m for m in _send(broker, [msgpack.packb(header), *blobs]) if m.type == P.ERROR]
    assert broker.server.stats["malformed"] == 1
    assert dict(broker.core.counters) == counters
    assert len(errors) == 1 and f"'{key}'" in errors[0].body["message"] and msg_type in errors[0].body["message"]


@pytest.mark.parametrize("where", ["group_id", "group_ids", "min_version", "frames", "done"])
def test_inf_in_nested_integer_fields_is_rejected(broker, where):
    gid = broker.core.inflight_group_ids()[0]
    if where == "group_ids":
        header, blobs = {"v": V, "t": P.BATCH_FILTERED, "group_ids": [math.inf]}, []
    else:
        header, blobs = _valid_groups_body(gid)
        header["done"] = [[gid, 0]]  # a valid notice: the bad column must stop it too
        if where in ("group_id", "frames"):
            header["groups"][where][0] = math.inf
        elif where == "done":
            header["done"][0][1] = math.inf
        else:
            header["groups"]["traj"][where][0] = math.inf
    counters = dict(broker.core.counters)
    errors = [m for m in _send(broker, [msgpack.packb(header), *blobs]) if m.type == P.ERROR]
    assert broker.server.stats["malformed"] == 1 and dict(broker.core.counters) == counters
    assert broker.core.num_inflight_samples == GROUP_SIZE * broker.core.num_inflight_groups  # no slot freed
    assert len(errors) == 1 and where in errors[0].body["message"]


def test_inf_prompt_index_is_a_protocol_error():
    """What a worker decodes from an issue (and the broker from a checkpoint)."""
    with pytest.raises(P.ProtocolError, match="index"):
        P.item_from_row([math.inf, "q", [], "", {}])


@pytest.mark.parametrize("worker_id", [7, 1.5, math.inf, ["w"], {"a": 1}, b"w", True, "", "x" * 1000])
def test_non_string_worker_id_is_rejected_and_trains_nothing(broker, worker_id):
    gids = broker.core.inflight_group_ids()
    counters = dict(broker.core.counters)
    rogue = [P.encode(P.HELLO, {"worker_id": worker_id, "capacity": 4})]
    for gid in gids:  # and reports every in-flight group under that id
        header, blobs = _valid_groups_body(gid)
        rogue.append([msgpack.packb({**header, "worker_id": worker_id}), *blobs])
    replies = _send(broker, *rogue)
    assert broker.server.stats["malformed"] == 1 + len(gids)
    assert dict(broker.core.counters) == counters and broker.core.num_buffered_groups == 0
    assert sorted(broker.core.inflight_group_ids()) == sorted(gids) and list(broker.core.workers()) == ["fuzz"]
    errors = [m for m in replies if m.type == P.ERROR]
    assert len(errors) == len(rogue) and all("worker_id" in m.body["message"] for m in errors)


def test_report_of_another_workers_group_is_ignored(broker):
    """A second (well-formed) worker reports the first one's in-flight groups: ignored and counted, nothing is
    finished or trained, and the owner's own report still counts."""
    other = Peer(broker.server.address, broker.ctx, identity=b"rogue")
    other._pump = broker._pump  # the in-process broker runs while this peer waits
    other.exchange(_hello("rogue"))
    mine = [g for g in broker.core.inflight_group_ids() if broker.core.owner(g) == "fuzz"]
    counters = dict(broker.core.counters)
    other.exchange(
        *[P.finished_groups_frames([(g, [_traj(1.0), _traj(0.0)], False, "")]) for g in mine],
        P.finished_groups_frames([], done=[(mine[0], 0)]),
        P.finished_groups_frames([(mine[0], None, True, "x")]),
    )
    assert broker.server.stats["foreign_reports"] == len(mine) + 2
    assert dict(broker.core.counters) == counters and broker.core.num_buffered_groups == 0
    _send(broker, P.finished_groups_frames([(mine[0], [_traj(1.0), _traj(0.0)], False, "")]))
    assert broker.core.counters["finished"] == counters.get("finished", 0) + 1
    other.sock.close(0)


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_nonfinite_reward_is_counted_and_never_trained(broker, reward):
    gid = broker.core.inflight_group_ids()[0]
    _send(broker, P.finished_groups_frames([(gid, [_traj(reward), _traj(0.0)], False, "")]))
    assert broker.core.counters["nonfinite_rewards"] == 1
    assert broker.core.counters["dropped"] == 1 and broker.core.num_buffered_groups == 0
    assert broker.core.counters["trained"] == 0


def test_string_reward_is_malformed(broker):
    header, blobs = _valid_groups_body(broker.core.inflight_group_ids()[0])
    header["groups"]["traj"]["reward"][0] = "nan"
    _send(broker, [msgpack.packb(header), *blobs])
    assert broker.server.stats["malformed"] == 1 and broker.core.num_buffered_groups == 0


# ---------------------------------------------------------------- the real broker process
def _write_inputs(tmp: Path) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(12):
            f.write(json.dumps({"question": f"question {i}", "golden_answers": [f"answer {i}"]}) + "\n")
    cfg = tmp / "broker.toml"
    cfg.write_text(
        "[runner]\nasync_mode = true\n[data]\nrollout_batch_size = 2\n[algorithm]\ngroup_size = 2\n"
        '[rollout_buffer]\nsubmission_granularity = "group"\nmax_inflight_groups = 4\nmax_buffered_groups = 8\n'
        "worker_heartbeat_timeout_s = 3600.0\nno_data_warning_s = 3600.0\nmax_dropped_groups_per_step = 100000\n"
    )
    return str(cfg), str(prompts)


class ProcessPeer(Peer):
    def __init__(self, address: str, proc):
        self.proc = proc
        self.ctx = zmq.Context()
        super().__init__(address, self.ctx)

    def _pump(self, timeout_s: float) -> None:
        assert self.proc.poll() is None, f"the broker died (exit code {self.proc.returncode})"
        super()._pump(timeout_s)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.slow
def test_fuzz_real_broker_process(tmp_path):
    """1000 fuzz messages against the broker process (``python -m asyncrl.runner.broker_process``) over TCP: it never dies, rejected frames never
    move its counters, and afterwards it still trains a batch."""
    cfg, prompts = _write_inputs(tmp_path)
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"), timeout_s=30)
    peer = ProcessPeer(broker.address, broker.proc)
    outcome = []

    @settings(
        max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
    )
    @given(frames=fuzz_message())
    def one(frames):
        outcome.append(check_frame(peer, frames))

    try:
        one()
        assert len(outcome) >= 1000 and sum(outcome) > 500, (len(outcome), sum(outcome))
        train_one_batch(peer)
    finally:
        peer.close()
        code = broker.stop()
    assert code == 0, (tmp_path / "broker.log").read_text()[-3000:]
