"""Miles' DataBuffer contract, as Miles defines it, and the adapter that runs such a buffer in the broker core.

Miles (``miles/rollout/fully_async_data_buffer.py``) defines a custom buffer as a class with
``async def put(input: DataBufferInput) -> None``, ``async def get() -> DataBufferInput`` (one group, waiting
until one is available) and ``def get_metrics() -> dict``, constructed as
``Class(DataBufferConstructorInput(args, on_evict))``. This module gives those names their asyncrl types, so a
Miles buffer ports by changing one import (``from asyncrl.broker.miles_buffer import DataBuffer,
DataBufferInput, DataBufferConstructorInput``), and ``MilesBufferAdapter`` runs it behind the broker core's
batched interface (``asyncrl.broker.buffer.DataBuffer``).

Contract
- ``DataBufferInput(prompt_group, group, weight_version)``: ``group`` is a list of ``Sample`` (one per
  trajectory: ``sample.oldest_weight_version``, ``sample.reward`` and every other ``Trajectory`` field read
  through); ``prompt_group`` is the prompt once per trajectory (what ``on_evict`` takes back);
  ``weight_version`` is the engines' version when the group finished.
- ``DataBufferConstructorInput.args``: Miles' argument names for what asyncrl maps (``rollout_batch_size``,
  ``n_samples_per_prompt``, ``max_weight_staleness``, ``async_unused_samples_handler``,
  ``async_data_buffer_capacity_factor``); reading any other attribute raises naming it.
  ``on_evict(prompt_group)``: the buffer gives a group up (overflow, staleness, its own rule); the broker counts
  it dropped (reason ``evicted``) and ``rollout_buffer.unused_groups`` decides: ``retry`` re-issues the prompt
  at once (Miles' recycling), ``drop`` brings it back next epoch.
- The adapter owns a private event loop and runs the buffer's coroutines on it, so the synchronous core never
  blocks on the buffer: ``put`` runs until it returns or waits (a waiting put, e.g. a full buffer that blocks
  its producer, finishes on a later call, once ``get`` made room; its group counts as buffered meanwhile);
  ``get`` is called only for groups the adapter knows are held, and must return within ``GET_DEADLINE_S``.
- What the buffer holds is known exactly: put, minus evicted through ``on_evict``, minus taken by ``get``;
  ``groups()`` returns it in arrival order, so a checkpoint keeps a Miles buffer's groups and a resume puts
  them back in that order. A buffer that drops a group without ``on_evict`` breaks this: its ``get`` never
  returns (a ``BrokerError`` naming the class), and when the class defines ``__len__`` a checkpoint is refused
  while ``len`` disagrees with what the adapter counts.
- The put-time filters of the built-in buffer stay in front of it: an aborted group (or one with a non-finite
  reward) never reaches it (``handler="unused"``), nor one ``rollout_buffer.dynamic_sampling_filter_path``
  rejects (always dropped, ``rollout/dynamic_filter/drop_<reason>``).

    class Newest(DataBuffer):                        # Miles' contract, asyncrl's import
        def __init__(self, input: DataBufferConstructorInput): self.q = []
        async def put(self, input: DataBufferInput) -> None: self.q.append(input)
        async def get(self) -> DataBufferInput: return self.q.pop()
        def get_metrics(self): return {"queue_size": len(self.q)}
"""

from __future__ import annotations

import abc
import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from asyncrl.broker import buffer as B
from asyncrl.broker.core_types import BrokerError
from asyncrl.broker.types import Group, PromptItem, Trajectory

GET_DEADLINE_S = 30.0  # a get() of a group known to be held returns at once; this long means the buffer lost it
SETTLE_ROUNDS = 32  # event-loop rounds a put may take before it counts as waiting (a Condition hand-off takes ~3)


class Sample:
    """One trajectory as Miles' code reads a sample: ``oldest_weight_version`` and the trajectory's fields."""

    __slots__ = ("trajectory", "group_id", "index")

    def __init__(self, trajectory: Trajectory, *, group_id: int, index: int):
        self.trajectory = trajectory
        self.group_id = group_id
        self.index = index

    @property
    def oldest_weight_version(self) -> int:
        return self.trajectory.min_version

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trajectory, name)


@dataclass(frozen=True)
class DataBufferConstructorInput:
    args: argparse.Namespace
    on_evict: Callable[[list[PromptItem]], None]
    """Give a held group up: pass its ``DataBufferInput.prompt_group``."""


@dataclass
class DataBufferInput:
    prompt_group: list[PromptItem]
    """The prompt, once per trajectory: what ``on_evict`` takes back."""
    group: list[Sample]
    """The finished trajectories."""
    weight_version: Optional[int]
    """The engines' weight version when the group finished."""


def group_oldest_weight_version(group: list[Sample]) -> Optional[int]:
    """The oldest weight version of any trajectory of ``group`` (Miles' helper of the same name)."""
    return min((s.oldest_weight_version for s in group), default=None)


class DataBuffer(abc.ABC):
    """Miles' DataBuffer: subclass it (or write any class with the same three methods)."""

    @abc.abstractmethod
    async def put(self, input: DataBufferInput) -> None: ...

    @abc.abstractmethod
    async def get(self) -> DataBufferInput: ...

    @abc.abstractmethod
    def get_metrics(self) -> dict[str, float]: ...


class MilesArgs(argparse.Namespace):
    """``args`` of ``DataBufferConstructorInput``: reading an argument asyncrl does not map names it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        known = sorted(k for k in vars(self))
        raise AttributeError(
            f"args.{name}: not a Miles argument asyncrl passes to a custom data buffer (it passes {known}); "
            f"read your own settings from the environment or a file"
        )


def miles_args(settings: B.BufferSettings) -> MilesArgs:
    """Miles' names for the settings asyncrl maps (docs/seed_mapping.md)."""
    bsz = settings.rollout_batch_size
    return MilesArgs(
        rollout_batch_size=bsz,
        n_samples_per_prompt=settings.group_size,
        max_weight_staleness=settings.max_staleness,
        async_unused_samples_handler=settings.unused_groups,
        async_data_buffer_capacity_factor=settings.capacity / bsz if bsz else None,
    )


@dataclass(eq=False)
class _Entry:
    group: Group
    input: DataBufferInput
    put_task: Optional[asyncio.Task] = None


class _Book:
    """What the adapter knows the buffer holds, in arrival order, and how to find an entry again (the entries
    keep their input and prompt_group alive, so the ids stay unique while held)."""

    def __init__(self):
        self.by_input: dict[int, _Entry] = {}  # id(DataBufferInput) -> entry, arrival order
        self.by_prompts: dict[int, _Entry] = {}  # id(DataBufferInput.prompt_group) -> entry

    def add(self, e: _Entry) -> None:
        self.by_input[id(e.input)] = e
        self.by_prompts[id(e.input.prompt_group)] = e

    def remove(self, e: _Entry) -> None:
        del self.by_input[id(e.input)], self.by_prompts[id(e.input.prompt_group)]

    def live(self) -> list[_Entry]:
        return list(self.by_input.values())


class MilesBufferAdapter(B.DataBuffer):
    """A Miles-contract buffer (``cls``) behind the batched interface; see the module's contract."""

    def __init__(self, settings: B.BufferSettings, cls: type, *, name: str = ""):
        super().__init__(settings)
        self.name = name or f"{cls.__module__}:{cls.__qualname__}"
        self._loop = asyncio.new_event_loop()
        self._book = _Book()
        self._putting: dict[int, _Entry] = {}  # id(input) -> entry whose put() has not returned yet
        self._held = 0  # entries in the book whose put() returned: what get() may hand out
        self._evicted: list[B.Rejection] = []
        self._aborted = 0
        self._filter_drops: dict[str, int] = {}
        self.inner = cls(DataBufferConstructorInput(miles_args(settings), self._on_evict))

    # ------------------------------------------------------------- the batched interface
    def put(self, group: Group) -> Optional[B.Rejection]:
        if group.aborted or any(t.aborted for t in group.trajectories):
            self._aborted += 1
            return B.Rejection(group, "aborted", "unused")
        flt = self.settings.dynamic_filter
        reason = None if flt is None else flt(group)
        if reason is not None:
            self._filter_drops[str(reason)] = self._filter_drops.get(str(reason), 0) + 1
            return B.Rejection(group, str(reason), "drop")
        samples = [Sample(t, group_id=group.group_id, index=i) for i, t in enumerate(group.trajectories)]
        entry = _Entry(group, DataBufferInput([group.item] * len(samples), samples, group.finished_version))
        self._book.add(entry)
        self._putting[id(entry.input)] = entry
        entry.put_task = self._loop.create_task(self.inner.put(entry.input))
        self._settle()
        return None

    def take_evicted(self) -> list[B.Rejection]:
        out, self._evicted = self._evicted, []
        return out

    def get(self, num_groups: int, *, engine_version: int) -> tuple[Optional[list[Group]], list[B.Rejection]]:
        self._settle()
        if self._held < num_groups:
            return None, []
        return [self._get_one() for _ in range(num_groups)], []

    def get_metrics(self) -> dict[str, float]:
        m = {str(k): float(v) for k, v in (self.inner.get_metrics() or {}).items()}
        m["rollout/fully_async/aborted_groups_filtered"] = float(self._aborted)
        for reason, n in sorted(self._filter_drops.items()):
            m[f"rollout/dynamic_filter/drop_{reason}"] = float(n)
        self._aborted, self._filter_drops = 0, {}
        return m

    def __len__(self) -> int:
        """Groups put (or being put) and not evicted or taken: what admission counts as buffered."""
        return len(self._book.by_input)

    def groups(self) -> list[Group]:
        """What the buffer holds, arrival order; refused (``BrokerError``) when the class's ``__len__`` disagrees."""
        self._settle()
        if hasattr(type(self.inner), "__len__") and len(self.inner) != self._held:
            raise BrokerError(
                f"rollout_buffer.custom_data_buffer_path {self.name}: the buffer says it holds {len(self.inner)} "
                f"groups, but {self._held} were put and neither evicted (on_evict) nor taken (get): it dropped or "
                f"invented groups, so what it holds cannot be checkpointed; evict through on_evict"
            )
        return [e.group for e in self._book.live()]

    def restore(self, groups: list[Group]) -> None:
        """Take everything the buffer holds out (``get``), then put ``groups`` in order."""
        while self._book.by_input:
            if self._held == 0:  # only waiting puts: nothing was taken to make them room
                raise BrokerError(f"{self.name}: put() waits with the buffer empty; cannot restore it")
            self._get_one()
        for g in groups:
            rej = self.put(g)
            if rej is not None:
                self._evicted.append(rej)

    # ------------------------------------------------------------- internals
    def _on_evict(self, prompt_group: list[PromptItem]) -> None:
        e = self._book.by_prompts.get(id(prompt_group))
        if e is None:
            raise ValueError(
                f"{self.name}: on_evict got a prompt_group that is not one the buffer holds (pass the "
                f"DataBufferInput.prompt_group it was given, once)"
            )
        self._book.remove(e)
        if id(e.input) in self._putting:  # evicted by (or while) its own put: never counted held
            del self._putting[id(e.input)]
        else:
            self._held -= 1
        self._evicted.append(B.Rejection(e.group, "evicted", "unused"))

    def _get_one(self) -> Group:
        task = self._loop.create_task(self.inner.get())
        done, _ = self._loop.run_until_complete(asyncio.wait({task}, timeout=GET_DEADLINE_S))
        if task not in done:
            task.cancel()
            self._settle()
            raise BrokerError(
                f"rollout_buffer.custom_data_buffer_path {self.name}: get() did not return within {GET_DEADLINE_S:g}s "
                f"although {self._held} groups were put and neither evicted (on_evict) nor taken: a buffer "
                f"that gives a group up must call on_evict"
            )
        out = self._result(task, "get")
        e = self._book.by_input.get(id(out)) if isinstance(out, DataBufferInput) else None
        if e is None and isinstance(out, DataBufferInput):
            e = self._book.by_prompts.get(id(out.prompt_group))
        if e is None:
            raise BrokerError(
                f"rollout_buffer.custom_data_buffer_path {self.name}: get() returned {type(out).__name__}, not a "
                f"DataBufferInput the buffer holds (put and neither evicted nor taken)"
            )
        self._book.remove(e)
        if id(e.input) in self._putting:  # handed out before its put() returned (a buffer may do so)
            del self._putting[id(e.input)]
        else:
            self._held -= 1
        self._settle()  # a put waiting for room may finish now
        return e.group

    def _settle(self) -> None:
        """Run the loop while puts are waiting (at most ``SETTLE_ROUNDS`` rounds): finished puts count as held,
        failed ones raise."""
        putting = self._putting

        async def rounds():
            for _ in range(SETTLE_ROUNDS):
                await asyncio.sleep(0)
                if all(e.put_task.done() for e in putting.values()):
                    return

        self._loop.run_until_complete(rounds())
        for key, e in list(putting.items()):
            if e.put_task.done():
                del putting[key]
                self._result(e.put_task, "put")
                self._held += 1

    def _result(self, task: asyncio.Task, method: str) -> Any:
        if task.cancelled():
            raise BrokerError(f"rollout_buffer.custom_data_buffer_path {self.name}: {method}() was cancelled")
        exc = task.exception()
        if exc is not None:
            raise BrokerError(
                f"rollout_buffer.custom_data_buffer_path {self.name}: {method}() raised {type(exc).__name__}: {exc}"
            ) from exc
        return task.result()

    def close(self) -> None:
        """Cancel what the buffer still runs (a waiting put) and close the private loop; idempotent."""
        if self._loop.is_closed():
            return
        tasks = asyncio.all_tasks(self._loop)
        for t in tasks:
            t.cancel()
        if tasks:
            self._loop.run_until_complete(asyncio.wait(tasks))
        self._loop.close()

    def __del__(self) -> None:
        if not self._loop.is_running():
            self.close()
