"""The leader: what actor rank 0 alone does in a run, as one object; ``NullLeader``, its twin on the other actor ranks.

Contract
- ``Leader(cfg, run_dir, broker_address, engine_urls, discovery=, purge_step=, run_id=)`` holds the broker client, the
  metrics writer (with ``logging.wandb``, a wandb run of id ``run_id``), the weight-sync group (joined at
  construction, ``WeightSyncGroup.init``) and its syncer, the engine recovery, the engine scraper (its thread
  started), the sample filter, Miles' log hooks, the non-finite guard and the run's summary;
  ``build_evaluators(eval_engine_urls)`` adds the shared-engine evaluator (it checks the tool URLs it will call) and
  the eval fleet.
- The step loop (``asyncrl.trainer.step_loop.Trainer``) calls the same methods on every actor rank and holds no
  ``if leader`` of its own: ``NullLeader`` answers each with nothing (no batch, no verdict, no broker state) and
  its parts are None. What needs the other ranks (collectives, leader phases) stays in the step loop.
- ``next_batch`` is the leader's batch wait (in slices of ``BATCH_SLICE_S``, so a restarted engine waiting for
  its catch-up sync is seen within seconds): the step's ``Batch`` (groups after the sample filter, and their
  metrics), None when a restarted engine waits for its weights, ``PREEMPT`` when a preemption signal arrived.
- ``log_step(step, batch, m, ...)``: the step's record, the batch's groups handed to Miles' hooks with it;
  external and fleet eval points that finished meanwhile are logged at their own steps.
- ``make_recovery``: actor rank 0's view of engine restarts through the discovery keys the rollout ranks publish.
- ``make_batch_filter``: Miles' sample filter on the assembled batch.

    leader = Leader(cfg, run_dir, broker_address, engine_urls, discovery=disc, purge_step=None)   # actor rank 0
    leader = NullLeader()                                                                     # the others
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from asyncrl.agent.trajectory import trajectory_metrics
from asyncrl.broker.client import BrokerClient
from asyncrl.cluster.discovery import read_count, restarts_key, synced_key
from asyncrl.config.loader import to_dict
from asyncrl.config.validate import resolve_hook as import_path
from asyncrl.eval.backends import EngineEvaluator, engine_eval_metrics, select_backend
from asyncrl.eval.fleet import FleetEval
from asyncrl.sync.catchup import Puller
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.recovery import EngineRecovery
from asyncrl.sync.weight_store import WeightStore
from asyncrl.sync.weight_sync import SyncHooks, WeightSyncer
from asyncrl.trainer.engine_scraper import EngineScraper
from asyncrl.trainer.guards import NonFiniteGuard
from asyncrl.trainer.log_hooks import LogHooks
from asyncrl.trainer.summary import broker_accounting, new_summary, print_summary, record_step, wait_split
from asyncrl.trainer.writers import MetricsWriter

log = logging.getLogger("asyncrl.trainer")

# The leader's batch wait is cut into slices this long, so a restarted engine waiting for its catch-up
# sync is served within about this many seconds (it cannot produce data before).
BATCH_SLICE_S = 2.0
PREEMPT = "preempt"  # what the leader's batch wait returns when a preemption signal arrived
CATCH_UP = "sync"  # its verdict when a restarted engine waits for a catch-up sync


@dataclass
class Batch:
    """One step's batch on the leader: the groups to train (after the sample filter) and the step's metrics so far;
    on the other actor ranks no groups (each gets its share in the actor's scatter)."""

    groups: list | None
    metrics: dict[str, float] = field(default_factory=dict)


def batch_timeout_s(cfg) -> float:
    """How long actor rank 0 waits for one batch from the broker."""
    return cfg.rollout.request_timeout_s * 4


class Leader:
    """What actor rank 0 alone holds and does: the broker client, the metrics writer, the weight sync, the scraper,
    the evaluators, the summary."""

    is_leader = True

    def __init__(
        self,
        cfg,
        run_dir: Path,
        broker_address: str,
        engine_urls: list[str],
        *,
        discovery=None,
        purge_step: int | None = None,
        run_id: str | None = None,
    ):
        self.cfg, self.engine_urls = cfg, engine_urls
        self.broker = BrokerClient(broker_address, timeout_s=cfg.rollout.control_timeout_s)
        self.writer = MetricsWriter(
            run_dir,
            tensorboard=cfg.logging.tensorboard,
            jsonl=cfg.logging.jsonl,
            console=cfg.logging.console,
            max_steps=cfg.runner.max_steps,
            purge_step=purge_step,
            wandb=cfg.logging.wandb,
            config=to_dict(cfg),
            run_id=run_id,
        )
        self.group = WeightSyncGroup(
            [EngineEndpoint(u, tp_size=cfg.rollout.tensor_parallel_size) for u in engine_urls], cfg.sync
        )
        if cfg.sync.topology == "broadcast":  # the sharded groups form on every actor rank (Trainer, sync.sharded)
            self.group.init()
        self.syncer = WeightSyncer(
            self.group,
            pause_mode=cfg.rollout.pause_mode,
            sync_cfg=cfg.sync,
            hooks=SyncHooks(sync_begin=self.broker.sync_begin, sync_end=self.broker.sync_end),
        )
        self.recovery = make_recovery(cfg, self.group, discovery, run_dir=run_dir)
        if self.recovery.puller is not None and self.syncer.delta is not None:
            self.recovery.puller.on_pull = self.syncer.delta.forget  # a disk load leaves the delta loader no base
        self.scraper = EngineScraper(engine_urls, interval_s=cfg.logging.engine_metrics_interval_s)
        self.batch_filter = make_batch_filter(cfg.rollout_buffer.sample_filter_path)
        self.hooks = LogHooks(cfg)  # Miles' custom logging hooks
        self.nonfinite = NonFiniteGuard(cfg.runner.max_nonfinite_steps)
        self.summary = new_summary()
        self.evaluator: EngineEvaluator | None = None
        self.fleet: FleetEval | None = None
        self.num_catchup_syncs = 0
        """Catch-up syncs (a full push for restarted engines, outside a step's sync) so far."""

    def build_evaluators(self, eval_engine_urls: list[str] | None) -> None:
        """The shared-engine evaluator (built once; it checks the tool URLs it will call) and the eval fleet."""
        cfg, backend = self.cfg, select_backend(self.cfg)
        if cfg.runner.eval_before_after and cfg.data.test_path or backend == "shared":
            self.evaluator = EngineEvaluator(cfg, self.engine_urls, tokenizer_path=cfg.rollout.model_path)
        if backend == "fleet":
            path = cfg.rollout.model_path or cfg.actor.model_path
            self.fleet = FleetEval(cfg, list(eval_engine_urls or []), tokenizer_path=path)

    # ------------------------------------------------------------------------------------------------ resume, save
    @property
    def broker_state(self):
        """The broker's state for a checkpoint (called when the checkpoint is written)."""
        return self.broker.get_state

    def resumed(self, broker_state, step: int, version: int, checkpoint: str) -> None:
        if broker_state is not None:
            self.broker.set_state(broker_state)
        log.info("resumed from %s at step %d (weight version %d)", checkpoint, step, version)

    def abandon_syncs_when(self, requested) -> None:
        """A sync that fails once ``requested()`` is true is abandoned (a preemption signal arrived)."""
        self.recovery.abandon = requested

    # ----------------------------------------------------------------------------------------------------- a step
    def next_batch(self, step: int, version: int, t0: float, preempt=None):
        """The step's ``Batch``; None as soon as a restarted engine waits for its catch-up sync (the step loop runs
        it, then asks again); ``PREEMPT`` on preemption."""
        cfg = self.cfg
        if cfg.rollout_buffer.max_inflight_groups == "auto":
            self.report_engine_figures()
        got = wait_batch(
            self.broker,
            self.recovery,
            step=step,
            version=version,
            timeout_s=batch_timeout_s(cfg),
            t0=t0,
            preempt=preempt,
        )
        if got is None:
            self.num_catchup_syncs += 1  # the step loop runs a full sync for the restarted engine(s) next
        if got is None or got is PREEMPT:
            return got
        groups = self.batch_filter(got.groups)
        kept = {g.group_id for g in groups}
        removed = [g.group_id for g in got.groups if g.group_id not in kept]
        if removed:
            self.broker.batch_filtered(removed)
        m = {
            "rollout/sample_filter/kept_groups": float(len(groups)),
            "rollout/sample_filter/removed_groups": float(len(removed)),
        }
        m.update(wait_split(got.metrics, got.wait_s, async_mode=cfg.runner.async_mode))
        m.update(rollout_metrics(groups))
        return Batch(groups, m)

    @staticmethod
    def batch_verdict(got) -> str | None:
        """What every actor rank does after the leader's batch wait: None = train on it, or ``PREEMPT``, ``CATCH_UP``."""
        return PREEMPT if got is PREEMPT else CATCH_UP if got is None else None

    def report_engine_figures(self) -> None:
        """The engines' figures (summed over engines, averaged over the scrapes since the last report) to the
        broker's in-flight autotuner."""
        figures = self.scraper.autotune_figures()
        if figures is None:
            return
        self.broker.engine_figures(**figures)

    def nonfinite_verdict(self, m: dict) -> str | None:
        """The step's bad-numbers verdict (the leader alone sees the rewards): a reason once the limit is reached."""
        return self.nonfinite.update(m)

    def log_step(self, step: int, batch: Batch | None, m: dict, *, t_step: float, version: int, periodic) -> None:
        """The step's record (``time/step`` from ``t_step``), the batch's groups handed to Miles' hooks with it; then
        the external and fleet eval points that finished meanwhile, each at its own step."""
        m["time/step"] = time.perf_counter() - t_step
        m.update(self.scraper.latest())
        m.update(broker_accounting(self.broker.status()))
        m["actor/weight_version"] = float(version)
        m["rollout/engine_restarts"] = float(self.recovery.total_restarts())
        m["sync/catchup_pushes"] = float(self.num_catchup_syncs)
        if self.recovery.puller is not None:
            m.update(self.recovery.puller.take_metrics())
        self.writer.log(self.hooks.step(step, batch.groups if batch is not None else [], m), step)
        for eval_step, em in periodic.late_points(step):
            self.writer.log(self.hooks.eval(eval_step, em), eval_step)
        record_step(self.summary, m)

    # ------------------------------------------------------------------------------------------ the run's two ends
    def held_out_eval(self, *, step: int, release: bool) -> dict:
        """The held-out eval (``data.test_path``, greedy, on the shared engines) before the first / after the last
        step: the broker issues no new prompt meanwhile (in-flight groups finish); ``release=False`` leaves issuing
        held (the run ends). Logged at ``step`` as ``eval/test/*``; its summary is returned and kept in the run's
        summary as ``eval_before`` / ``eval_after``."""
        t0, test = time.perf_counter(), self.cfg.data.test_path
        held = bool(test) or not release  # at the end issuing stays held, with or without a test set
        if held:
            self.broker.hold_issuing()
        try:
            result = self.evaluator.evaluate({"test": test})["test"] if test else {}
        finally:
            if held and release:
                self.broker.release_issuing()
        if result:
            m = engine_eval_metrics({"test": result})
            m["eval/time_seconds"] = time.perf_counter() - t0
            self.writer.log(self.hooks.eval(step, m), step)
        name = result.get("reward_name", "score").replace("_", " ")
        log.info("held-out %s %s training: %s", name, "before" if release else "after", json.dumps(result))
        self.summary["eval_before" if release else "eval_after"] = result
        return result

    def finish(self, ctx, periodic, broker_child) -> None:
        """At the end: pending external evals, the after-training eval, the summary, shutdown."""
        cfg = ctx.cfg
        for eval_step, em in periodic.finish(cfg.runner.max_steps):  # pending external evals (bounded wait)
            self.writer.log(self.hooks.eval(eval_step, em), eval_step)
        if cfg.runner.eval_before_after:  # no new prompts from here on: the run ends after this eval
            self.held_out_eval(step=cfg.runner.max_steps, release=False)
        self.summary["wall_s"] = time.time() - ctx.started_at
        self.summary["prepare_s"] = ctx.timings.get("prepare", 0.0)
        print_summary(cfg, self.summary, ctx.run_dir)
        self.scraper.close()
        if self.cfg.sync.topology == "broadcast":  # (the sharded groups are dropped by the Trainer, every rank)
            self.group.destroy()  # while the engines are up: the broker's shutdown stops the workers and their engines
        if broker_child is not None:
            broker_child.stopping = True  # its exit from here on is asked for (see fail_fast_on_exit)
        self.broker.shutdown()
        self.broker.close()
        self.writer.close()


class NullLeader:
    """The leader's twin on the other actor ranks: the same calls, answered with nothing."""

    is_leader = False
    broker = syncer = recovery = evaluator = fleet = broker_state = None

    def build_evaluators(self, eval_engine_urls) -> None:
        pass

    def resumed(self, broker_state, step: int, version: int, checkpoint: str) -> None:
        pass

    def abandon_syncs_when(self, requested) -> None:
        pass

    def nonfinite_verdict(self, m: dict) -> None:
        return None

    @staticmethod
    def batch_verdict(got) -> None:
        return None  # the leader's verdict is broadcast; this rank's own is never read

    def log_step(self, step: int, batch, m: dict, *, t_step: float, version: int, periodic) -> None:
        pass


def wait_batch(broker, recovery, *, step: int, version: int, timeout_s: float, t0: float, preempt=None):
    """Ask the broker in slices (``BATCH_SLICE_S``); None as soon as a restarted engine waits for its catch-up sync,
    ``PREEMPT`` as soon as a preemption signal arrived. The broker's batch carries ``wait_s`` (since ``t0``)."""
    while True:
        if preempt is not None and preempt.requested:
            return PREEMPT
        if recovery is not None and recovery.pending() and not recovery.catch_up():
            return None  # no store to pull from, or a pull failed: the step loop's catch-up sync pushes
        left = timeout_s - (time.monotonic() - t0)
        if left <= 0:
            raise TimeoutError(
                f"no batch for step {step} from the broker within {timeout_s:.0f}s (rollout.request_timeout_s x 4)"
            )
        try:
            batch = broker.get_batch(step, timeout_s=min(BATCH_SLICE_S, left), actor_version=version)
        except TimeoutError:
            continue
        batch.wait_s = time.monotonic() - t0
        return batch


def rollout_metrics(groups) -> dict[str, float]:
    """reward/mean, response length, turns and tool calls per trajectory of the trained batch (token fields
    are the broker's arrays: counted with numpy, never element by element); each tool's ``tool/<name>/calls`` and
    ``tool/<name>/errors`` summed over the batch (``tool/errors``: all of them, and failed retrieval attempts), and
    the environment's ``env/<name>`` metrics averaged over the trajectories that report them."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    n = len(trajs)
    bad = sum(not math.isfinite(t.reward) for t in trajs)
    gen_lens = [int(np.count_nonzero(t.loss_mask)) for t in trajs]
    out = {
        "reward/mean": sum(t.reward for t in trajs) / n,
        "rollout/response_length/mean": sum(len(t.response_ids) for t in trajs) / n,
        "rollout/generated_tokens/mean": sum(gen_lens) / n,
        "rollout/turns/mean": sum(t.num_turns for t in trajs) / n,
        "rollout/tool_calls/mean": sum(t.num_tool_calls for t in trajs) / n,
        "rollout/truncated_ratio": sum(t.truncated for t in trajs) / n,
        "rollout/retractions/mean": sum(t.num_retractions for t in trajs) / n,
        "rollout/num_trajectories": float(n),
        "rollout/nonfinite_rewards": float(bad),
        "tool/errors": float(sum(t.extra.get("tool_errors", 0) for t in trajs)),
    }
    sums: dict[str, float] = {}
    env: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in trajectory_metrics(t).items():
            if k.startswith("env/"):
                env.setdefault(k, []).append(v)
            else:
                sums[k] = sums.get(k, 0.0) + v
    out["tool/errors"] += sum(v for k, v in sums.items() if k.endswith("/errors"))
    out.update(sums)
    out.update((k, sum(v) / len(v)) for k, v in env.items())
    return out


def make_recovery(cfg, group, discovery, *, run_dir: Path):
    """Actor rank 0's view of engine restarts through the discovery keys the rollout ranks publish; under
    ``sync.catchup = "pull"`` with the weight store (``sync.store_dir``, default ``<run_dir>/weight_store``) and its
    puller."""
    r, n = cfg.rollout, len(group.engines)
    if discovery is None:
        read, publish = (lambda i: 0), (lambda i, k: None)
    else:
        read = lambda i: read_count(discovery, restarts_key(i))  # noqa: E731
        publish = lambda i, k: discovery.publish(synced_key(i), str(k))  # noqa: E731
    # long enough for the rollout rank to call a hang, restart the engine and see it answer
    wait_s = r.unhealthy_after_s + r.health_check_interval_s + r.health_check_timeout_s + r.start_timeout_s
    rec = EngineRecovery(
        group, read_restarts=read, publish_synced=publish, wait_s=wait_s, max_failures=2 * r.max_restarts * n + 1
    )
    if cfg.sync.catchup == "pull":
        s = cfg.sync
        store = WeightStore(  # absolute: the engine resolves model_path in its own working directory
            (Path(s.store_dir) if s.store_dir else Path(run_dir) / "weight_store").resolve(),
            base_interval=s.store_base_interval,
            keep_bases=s.store_keep_bases,
        )
        rec.puller = Puller(store, initial_path=str(Path(r.model_path).resolve()), timeout_s=s.step_timeout_s)
    return rec


def make_batch_filter(path: str | None):
    """Miles' ``--rollout-sample-filter-path`` as ``rollout_buffer.sample_filter_path``: once the
    trainer holds a full batch, the groups are sorted by prompt index and ``module:function(groups)
    -> groups`` runs on the assembled batch. Returns the step's transform (identity sort when unset)."""
    fn = None
    if path:
        fn = import_path(path, "rollout_buffer.sample_filter_path")
        if not callable(fn):
            raise ValueError(f"rollout_buffer.sample_filter_path: {path!r} is not callable")

    def apply(groups: list) -> list:
        ordered = sorted(groups, key=lambda g: (g.item.index, g.group_id))
        if fn is None:
            return ordered
        out = fn(ordered)
        if not isinstance(out, list):
            raise ValueError(
                f"rollout_buffer.sample_filter_path: {path!r} returned {type(out).__name__}, expected a list of groups"
            )
        return out

    return apply
