"""Discovery through the store torchrun already runs (MASTER_ADDR/MASTER_PORT).

Each use has its own key prefix under one run prefix, so two jobs on one store never mix:
``asyncrl/<run_id>/<restart>/broker/address``, ``.../engine/<i>/url``, ``.../shutdown``.

    d = Discovery.from_env(timeout_s=300)
    d.publish("broker/address", "tcp://10.0.0.1:5555")
    d.lookup("broker/address")          # blocks until set, or TimeoutError naming the key
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

_POLL_S = 0.1  # discovery keys appear once per run; polling costs nothing and keeps signals prompt


class Discovery:
    def __init__(self, store, prefix: str, *, timeout_s: float):
        self.raw_store = store
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.store = dist.PrefixStore(prefix, store)

    @classmethod
    def from_env(cls, *, timeout_s: float) -> Discovery:
        addr = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise RuntimeError(
                "MASTER_ADDR/MASTER_PORT are not set: launch with torchrun "
                "(e.g. torchrun --nproc_per_node 2 launch/train.py configs/tiny.toml)"
            )
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(store, f"asyncrl/{run_id}/{restart}/", timeout_s=timeout_s)

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value.encode())

    def lookup(self, key: str, timeout_s: float | None = None) -> str:
        """Block until ``key`` is set. Polls (no blocking C++ wait), so SIGTERM/Ctrl-C are handled at once."""
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no value for discovery key {self.prefix}{key!r} after {t:.0f}s: "
                    f"the rank that publishes it did not start or failed"
                )
            time.sleep(_POLL_S)
        return self.store.get(key).decode()

    def is_set(self, key: str) -> bool:
        return self.store.check([key])

    def sub(self, prefix: str) -> Discovery:
        return Discovery(self.raw_store, self.prefix + prefix, timeout_s=self.timeout_s)


# ------------------------------------------------------------------------------------------- the job's keys
SHUTDOWN_KEY = "shutdown"
"""Published by actor rank 0 when the run ends; every waiting rank returns."""


def restarts_key(engine: int) -> str:
    """Discovery key: how many times engine ``engine`` was restarted (published by its rollout rank)."""
    return f"engine/{engine}/restarts"


def synced_key(engine: int) -> str:
    """Discovery key: the restart count of engine ``engine`` that actor rank 0 last synced."""
    return f"engine/{engine}/synced"


def read_count(disc: Discovery, key: str) -> int:
    """A counter key's value, 0 while unset (never blocks)."""
    return int(disc.store.get(key).decode()) if disc.is_set(key) else 0
