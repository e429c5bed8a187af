"""Miles' DataBuffer contract (async put/get, ``DataBufferConstructorInput(args, on_evict)``) in the broker core:
groups, evictions, a waiting producer, checkpoints, and the contract check (issue 42, item 1)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.broker import miles_buffer as M
from asyncrl.broker.buffer import BufferSettings
from asyncrl.broker.buffer_plugin import buffer_interface, check_custom_buffer, make_data_buffer
from asyncrl.broker.core import BrokerCore, BrokerError, CoreSettings
from asyncrl.broker.miles_buffer import DataBuffer, DataBufferConstructorInput, DataBufferInput
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.config import ConfigError, load_config

HERE = __name__


class StalestEvicting(DataBuffer):
    """Written as Miles writes one: a Condition, FIFO gets, the stalest group evicted past capacity."""

    def __init__(self, input: DataBufferConstructorInput):
        self.capacity = int(input.args.async_data_buffer_capacity_factor * input.args.rollout_batch_size) - 1
        self.on_evict = input.on_evict
        self.entries: list[DataBufferInput] = []
        self.cond = asyncio.Condition()
        self.puts = 0

    async def put(self, input: DataBufferInput) -> None:
        async with self.cond:
            self.entries.append(input)
            self.puts += 1
            if len(self.entries) > self.capacity:
                stalest = min(self.entries, key=lambda e: M.group_oldest_weight_version(e.group))
                self.entries.remove(stalest)
                self.on_evict(stalest.prompt_group)
            self.cond.notify_all()

    async def get(self) -> DataBufferInput:
        async with self.cond:
            while not self.entries:
                await self.cond.wait()
            return self.entries.pop(0)

    def get_metrics(self) -> dict[str, float]:
        return {"custom/puts": self.puts, "custom/queue_size": len(self.entries)}


class BlocksItsProducer(StalestEvicting):
    """Miles' DefaultDataBuffer with eviction off: put waits while the buffer is full."""

    async def put(self, input: DataBufferInput) -> None:
        async with self.cond:
            while len(self.entries) >= 1:
                await self.cond.wait()
            self.entries.append(input)
            self.cond.notify_all()

    async def get(self) -> DataBufferInput:
        async with self.cond:
            while not self.entries:
                await self.cond.wait()
            out = self.entries.pop(0)
            self.cond.notify_all()
            return out


class LosesGroups(StalestEvicting):
    """Breaks the contract: drops every second group without on_evict."""

    async def put(self, input: DataBufferInput) -> None:
        self.puts += 1
        if self.puts % 2 == 0:
            self.entries.append(input)

    def __len__(self) -> int:
        return len(self.entries)


class LosesGroupsQuietly(LosesGroups):
    __len__ = None  # no way to tell: only get() finds out


class RaisesInPut(StalestEvicting):
    async def put(self, input: DataBufferInput) -> None:
        raise RuntimeError("disk full")


class SyncMethods:
    """Miles' old-looking shape without async: its coroutines were once handed back as groups."""

    def __init__(self, input):
        pass

    def put(self, group):
        pass

    def get(self):
        pass

    def get_metrics(self):
        return {}


class NoConstructorArgument:
    async def put(self, input):
        pass

    async def get(self):
        pass

    def get_metrics(self):
        return {}


class HalfDone(DataBuffer):
    async def put(self, input):
        pass


def traj(v=0):
    return Trajectory([0, 1], [2, 3], [1, 1], [-0.5, -0.5], reward=1.0, min_version=v, max_version=v)


def make(buf: str, **kw) -> BrokerCore:
    base = dict(rollout_batch_size=2, group_size=2, max_inflight_groups=3, max_buffered_groups=6)
    base |= dict(max_dropped_groups_per_step=100, seed=1, shuffle=False, custom_data_buffer_path=f"{HERE}:{buf}")
    base |= kw
    prompts = [PromptItem(i, f"q{i}") for i in range(20)]
    return BrokerCore(prompts, settings=CoreSettings(**base), clock=lambda: 0.0)


def finish_all(core: BrokerCore, v=0) -> list[int]:
    ids = [i.group_id for i in core.take_issues()]
    for gid in ids:
        core.group_finished(gid, [traj(v), traj(v)])
    return ids


def test_a_miles_buffer_hands_over_groups_not_coroutines():
    """The probe of issue 42: ``get`` returned a coroutine, handed to training as a group. Now the adapter awaits it;
    the batch is the groups put, in the buffer's order, with the buffer's own metrics."""
    core = make("StalestEvicting")
    core.add_worker("w", capacity=16)
    ids = finish_all(core)
    core.request_batch(0)
    batch = core.take_batch()
    assert [g.group_id for g in batch.groups] == ids[:2]
    assert all(type(t).__name__ == "Trajectory" for g in batch.groups for t in g.trajectories)
    assert batch.metrics["custom/puts"] == 3.0 and batch.metrics["custom/queue_size"] == 1.0
    assert isinstance(core.buffer.inner, StalestEvicting) and core.num_buffered_groups == 1


@pytest.mark.parametrize("unused", ["drop", "retry"])
def test_a_group_the_buffer_evicts_is_dropped_or_retried_and_accounted(unused):
    """on_evict: capacity 2 x 2 - 1 = 3 groups; the 4th put evicts the stalest (version 0) and the broker counts it
    dropped (reason ``evicted``), re-queued under ``retry``: issued == trained + dropped + held + reissued."""
    core = make("StalestEvicting", max_inflight_groups=1, max_buffered_groups=4, unused_groups=unused)
    core.sync_end(3)
    core.add_worker("w", capacity=16)
    versions = [0, 3, 2, 1]
    for v in versions:
        finish_all(core, v)
    (drop,) = core.take_drops()
    assert (drop.reason, drop.retried) == ("evicted", unused == "retry")
    c = core.counters
    held = core.num_inflight_groups + core.num_buffered_groups
    assert c["dropped"] == 1 and c["issued"] == c["trained"] + c["dropped"] + held + c["reissued"]
    assert [g.min_version for g in core.buffer.groups()] == [3, 2, 1]


def test_checkpoint_keeps_a_miles_buffers_groups_and_resume_puts_them_back():
    """Its groups were lost at every checkpoint (``groups()`` returned []); now the state holds them, a fresh core
    puts them back in arrival order and trains on exactly those."""
    core = make("StalestEvicting")
    core.add_worker("w", capacity=16)
    ids = finish_all(core)
    state = core.state_dict()
    assert [g.group_id for g in state["buffered"]] == ids
    fresh = make("StalestEvicting")
    fresh.load_state_dict(state)
    assert fresh.num_buffered_groups == 3 and fresh.buffer.inner.puts == 3
    fresh.request_batch(0)
    assert [g.group_id for g in fresh.take_batch().groups] == ids[:2]


def test_a_put_that_waits_for_room_finishes_once_a_batch_is_taken():
    """A buffer that blocks its producer when full (1 group): the second put waits without blocking the broker, its
    group counts as buffered, and the put completes once a batch made room."""
    core = make("BlocksItsProducer", rollout_batch_size=1, max_inflight_groups=2, max_buffered_groups=4)
    core.add_worker("w", capacity=16)
    a, b = finish_all(core)
    assert core.num_buffered_groups == 2 and len(core.buffer.inner.entries) == 1
    core.request_batch(0)
    assert [g.group_id for g in core.take_batch().groups] == [a]
    assert [e.group[0].group_id for e in core.buffer.inner.entries] == [b]
    core.request_batch(1)
    assert [g.group_id for g in core.take_batch().groups] == [b]


def test_a_buffer_that_loses_groups_is_refused_a_checkpoint():
    """It says it holds fewer groups than were put and not evicted: what it holds cannot be checkpointed."""
    core = make("LosesGroups")
    core.add_worker("w", capacity=16)
    finish_all(core)
    with pytest.raises(BrokerError, match=r"holds 1 groups, but 3 were put .* cannot be checkpointed"):
        core.state_dict()


def test_a_get_that_never_returns_names_the_buffer_and_on_evict(monkeypatch):
    monkeypatch.setattr(M, "GET_DEADLINE_S", 0.2)
    core = make("LosesGroupsQuietly", max_inflight_groups=2)
    core.add_worker("w", capacity=16)
    finish_all(core)
    with pytest.raises(BrokerError, match=r"LosesGroupsQuietly: get\(\) did not return .* must call on_evict"):
        core.request_batch(0)


def test_a_failing_put_names_the_buffer_and_the_method():
    core = make("RaisesInPut")
    core.add_worker("w", capacity=16)
    with pytest.raises(BrokerError, match=r"RaisesInPut: put\(\) raised RuntimeError: disk full"):
        finish_all(core)


def test_args_carry_miles_names_and_name_what_is_not_passed():
    buf = make_data_buffer(
        BufferSettings(max_staleness=2, capacity=8, rollout_batch_size=4, group_size=3, unused_groups="retry"),
        f"{HERE}:StalestEvicting",
    )
    args = vars(M.miles_args(buf.settings))
    assert args == dict(
        rollout_batch_size=4,
        n_samples_per_prompt=3,
        max_weight_staleness=2,
        async_unused_samples_handler="retry",
        async_data_buffer_capacity_factor=2.0,
    )
    with pytest.raises(AttributeError, match="args.async_data_buffer_order: not a Miles argument asyncrl passes"):
        M.miles_args(buf.settings).async_data_buffer_order  # noqa: B018


@pytest.mark.parametrize(
    "cls, missing",
    [
        (SyncMethods, "put() is not 'async def'; get() is not 'async def'"),
        (NoConstructorArgument, "the constructor does not take the one argument DataBufferConstructorInput"),
        (HalfDone, "['get', 'get_metrics'] left abstract"),
        (42, "not a class"),
    ],
)
def test_a_class_meeting_neither_contract_is_refused_naming_what_is_missing(cls, missing):
    with pytest.raises(ValueError) as e:
        buffer_interface(cls)
    assert missing in str(e.value), str(e.value)
    assert buffer_interface(StalestEvicting) == "miles"


def test_the_config_check_refuses_a_buffer_of_neither_contract_naming_the_key():
    """``check_custom_buffer`` (the launcher's, dry run or not) checks the contract, not only the import."""
    cfg = load_config(None, [f'rollout_buffer.custom_data_buffer_path="{HERE}:SyncMethods"'])
    with pytest.raises(ConfigError, match=r"rollout_buffer.custom_data_buffer_path: .*SyncMethods.* not 'async def'"):
        check_custom_buffer(cfg)
    ok = check_custom_buffer(load_config(None, [f'rollout_buffer.custom_data_buffer_path="{HERE}:StalestEvicting"']))
    assert len(ok) == 1 and "Miles' DataBuffer contract" in ok[0]
    assert check_custom_buffer(load_config(None, [])) == []


def reject_odd_prompts(group):
    return "odd" if group.item.index % 2 else None


def test_the_dynamic_sampling_filter_stays_in_front_of_a_miles_buffer():
    """A configured put-time filter is not silently ignored when the buffer is Miles': its rejects never reach put()
    and are counted as with the built-in buffer."""
    core = make("StalestEvicting", dynamic_sampling_filter_path=f"{HERE}:reject_odd_prompts", max_inflight_groups=4)
    core.add_worker("w", capacity=16)
    finish_all(core)
    assert [e.group[0].group_id for e in core.buffer.inner.entries] == [0, 2]
    assert sorted(d.reason for d in core.take_drops()) == ["odd", "odd"]
    core.request_batch(0)
    assert core.take_batch().metrics["rollout/dynamic_filter/drop_odd"] == 2.0
