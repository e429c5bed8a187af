"""A ``rollout_buffer.custom_data_buffer_path`` plug-in for tests, written to Miles' DataBuffer contract.

``Fifo`` is Miles' DefaultDataBuffer in its default ``fifo`` order with eviction on overflow (the stalest group
first), written against ``asyncrl.broker.miles_buffer``. Every put, get and eviction is appended as a JSON line to the file named by
``ASYNCRL_TEST_MILES_BUFFER_LOG`` (with the process id, so a resumed run's events tell apart), which the tests read.
"""

from __future__ import annotations

import asyncio
import json
import os

from asyncrl.broker.miles_buffer import DataBuffer, DataBufferConstructorInput, DataBufferInput, Sample


def _log(event: str, entry: DataBufferInput) -> None:
    path = os.environ.get("ASYNCRL_TEST_MILES_BUFFER_LOG")
    if not path:
        return
    rec = {
        "pid": os.getpid(),
        "event": event,
        "prompt": entry.prompt_group[0].index,
        "oldest_version": min(s.oldest_weight_version for s in entry.group),
        "samples": len(entry.group),
        "typed": all(isinstance(s, Sample) for s in entry.group),
        "weight_version": entry.weight_version,
    }
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


class Fifo(DataBuffer):
    def __init__(self, input: DataBufferConstructorInput):
        args = input.args
        self.capacity = int(args.async_data_buffer_capacity_factor * args.rollout_batch_size)
        self.on_evict = input.on_evict
        self.entries: list[DataBufferInput] = []
        self.cond = asyncio.Condition()
        self.evicted = 0

    async def put(self, input: DataBufferInput) -> None:
        async with self.cond:
            _log("put", input)
            self.entries.append(input)
            while len(self.entries) > self.capacity:  # the stalest goes first
                stalest = min(self.entries, key=lambda e: min(s.oldest_weight_version for s in e.group))
                self.entries.remove(stalest)
                self.evicted += 1
                _log("evict", stalest)
                self.on_evict(stalest.prompt_group)
            self.cond.notify_all()

    async def get(self) -> DataBufferInput:
        async with self.cond:
            while not self.entries:
                await self.cond.wait()
            out = self.entries.pop(0)
            _log("get", out)
            return out

    def get_metrics(self) -> dict[str, float]:
        out = {"rollout/fully_async/queue_size": float(len(self.entries)), "custom/evicted": float(self.evicted)}
        self.evicted = 0
        return out
