"""The broker process's body: build the core from the config, serve until shutdown (``run_broker``), and the
process's life: its frame cap, its garbage collector, its signals and its supervising parent.

- Signals (``Supervision``): SIGINT stops the broker; SIGTERM too, except in a broker with a supervising parent
  (actor rank 0), which defers it while the parent lives and stops on ``shutdown``, SIGINT or the parent's death:
  the parent's preemption checkpoint needs the broker's state. The parent is watched at every tick of the
  server's loop.

run_broker(cfg, prompts, bind="tcp://0.0.0.0:0", address_file="run/broker.addr", parent_pid=os.getppid())
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from typing import Any, Optional

from asyncrl.broker import wire
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.server import BrokerServer
from asyncrl.broker.worker_client import MAX_GROUPS_PER_MESSAGE
from asyncrl.models.spec import ModelSpec

log = logging.getLogger("asyncrl.broker")

HEADER_ALLOWANCE_BYTES = 16 << 20
"""Room on top of the token data for a message's header frame (its columns: ~100 bytes a trajectory, a worker's
error texts) and slack: a worker message of 256 groups x 64 trajectories has a ~2 MB header."""


def max_message_bytes(cfg) -> int:
    """The largest frame a legitimate peer sends the broker (its ROUTER's ``zmq.MAXMSGSIZE``), from the resolved
    ``Config``. Token data is the bulk, and ONE frame may hold all of a message's (a run of fresh trajectories is
    packed back to back): a worker's ``groups`` message carries at most ``MAX_GROUPS_PER_MESSAGE`` groups, an
    actor's ``set_state`` the buffered ones (fewer than ``rollout_buffer.max_buffered_groups``), each of
    ``algorithm.group_size`` trajectories of at most max(``agentloop.max_total_tokens``, ``data.max_prompt_tokens``)
    tokens (9 bytes a response token, 4 a prompt token; with ``actor.moe_routing_replay`` each position's routed
    experts too, 4 bytes per layer and top-k expert of the actor's model, read from its config.json). Doubled (a state's header holds each group's prompt text,
    less than its token data; a prompt a little longer in the worker's count), plus ``HEADER_ALLOWANCE_BYTES``.
    ``configs/searchr1.toml`` (1,024 buffered groups of 4 x 4,096 tokens): 319 MB; ``configs/tiny.toml``: 92 MB."""
    groups = max(MAX_GROUPS_PER_MESSAGE, cfg.rollout_buffer.max_buffered_groups)
    tokens = max(cfg.agentloop.max_total_tokens, cfg.data.max_prompt_tokens)
    widths = ()
    if cfg.actor.moe_routing_replay:
        spec = ModelSpec.from_pretrained(cfg.actor.model_path)
        widths = (spec.num_layers * spec.num_experts_per_tok,)
    return 2 * groups * cfg.algorithm.group_size * wire.token_nbytes(0, tokens, widths) + HEADER_ALLOWANCE_BYTES


def freeze_setup_objects() -> None:
    """For a long-running process once it is set up (the actor after its imports, model, optimizer and first
    eval): the objects alive now leave the collector's view, so a full collection walks only what later work
    made. Measured in the actor's batch fetch (``benchmarks/broker_bench.py``, 512 x 5 x 2,000 tokens): a full
    collection over the set-up heap (torch, Megatron) landing in a fetch took it from ~25 ms to 150-350 ms.
    The thresholds stay the interpreter's."""
    gc.collect()
    gc.freeze()


def tune_gc() -> None:
    """For a process that moves many short-lived, acyclic objects (groups, trajectories, message maps): the
    objects alive now (modules, prompts) leave the collector's view and young collections run 50x less often
    (each one walks every tracked young object). Reference counting still frees all acyclic garbage at once."""
    freeze_setup_objects()
    gc.set_threshold(35_000, 20, 20)


class Supervision:
    """The broker process's signals and, when it is a supervised child, the watch on its parent.

    SIGINT stops the broker (after the server's round; workers are told ``shutdown``). So does SIGTERM, unless the
    broker is a supervised child (``parent_pid``: actor rank 0): then a SIGTERM is deferred while that parent lives,
    since under Slurm a preemption's SIGTERM reaches every process of the step at once and the parent still needs
    the broker to checkpoint its buffered groups; the parent stops it with ``shutdown`` or SIGINT
    (``asyncrl.cluster.process.stop_child``), and the broker stops by itself once the parent is gone."""

    def __init__(self, server: BrokerServer, *, parent_pid: Optional[int] = None):
        self.server = server
        self.parent_pid = parent_pid
        """The supervising parent; None: a broker on its own."""
        self._sigterm_deferred = False
        self._sigterm_reported = False

    def install(self) -> None:
        """Take SIGINT and SIGTERM, and watch the parent at every tick of the server's loop."""
        signal.signal(signal.SIGINT, self.server.stop)
        signal.signal(signal.SIGTERM, self.server.stop if self.parent_pid is None else self._defer_sigterm)
        self.server.on_tick = self.watch_parent

    def _defer_sigterm(self, *_: Any) -> None:
        self._sigterm_deferred = True  # logged by the loop (no logging inside a signal handler)

    def watch_parent(self) -> None:
        """With a supervising parent: stop once it is gone; report a deferred SIGTERM once."""
        if self.parent_pid is None:
            return
        if os.getppid() != self.parent_pid:
            log.warning("the parent (pid %d) is gone; stopping", self.parent_pid)
            self.server.stop()
        elif self._sigterm_deferred and not self._sigterm_reported:
            self._sigterm_reported = True
            log.warning(
                "SIGTERM deferred while the parent (pid %d, actor rank 0) lives: it checkpoints the "
                "buffered groups first, then stops the broker",
                self.parent_pid,
            )


def run_broker(
    cfg,
    prompts: list,
    *,
    source: str = "",
    bind: str = "tcp://127.0.0.1:0",
    address_file: Optional[str] = None,
    num_skipped_long_prompts: int = 0,
    parent_pid: Optional[int] = None,
) -> None:
    """Build the core from a resolved ``Config`` and the ``prompts`` (``PromptItem``s, loaded by the caller from
    ``source``; ``num_skipped_long_prompts`` of them were left out by ``data.max_prompt_tokens``), serve until
    shutdown. Publishes the endpoint. ``parent_pid``: the supervising parent (see ``Supervision``)."""
    if parent_pid is not None and os.getppid() != parent_pid:
        raise RuntimeError(f"broker: its parent (pid {parent_pid}) is already gone")
    core = BrokerCore(prompts, settings=CoreSettings.from_config(cfg), clock=time.monotonic)
    core.num_skipped_long_prompts = num_skipped_long_prompts
    server = BrokerServer(
        core,
        bind=bind,
        heartbeat_interval_s=cfg.agentloop.heartbeat_interval_s,
        max_message_bytes=max_message_bytes(cfg),
    )
    Supervision(server, parent_pid=parent_pid).install()
    tune_gc()
    if address_file:
        tmp = f"{address_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(server.address)
        os.replace(tmp, address_file)
    print(f"ASYNCRL_BROKER_ADDRESS={server.address}", flush=True)
    log.info(
        "broker: %d prompts from %s, limits inflight=%d buffered=%d batch=%d group_size=%d (%s, %s mode)",
        len(prompts),
        source,
        core.s.max_inflight_groups,
        core.s.max_buffered_groups,
        core.s.rollout_batch_size,
        core.s.group_size,
        core.s.submission_granularity,
        "sync" if core.s.sync_mode else "async",
    )
    server.serve_forever()
    sys.stdout.flush()
