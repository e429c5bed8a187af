"""The step loop on the actor ranks: get a batch, train, sync weights, log. Async and sync modes.

Contract
- Wires actor rank 0 to the broker, the engines and the metrics writer (its parts:
  ``asyncrl.trainer.leader.LeaderParts``); every actor rank runs the Megatron actor. The step records'
  derived figures and the run's summary are ``asyncrl.trainer.summary``'s; the checkpoints are the
  ``asyncrl.actor.checkpoint.CheckpointManager``'s (every ``runner.checkpoint_interval`` steps and at the end).
- async (``runner.async_mode = true``): the broker keeps issuing while the actor trains; each step
  takes the oldest ``rollout_batch_size`` groups (``time/wait_data`` = how long it waited), trains
  (``time/training``) and, every ``rollout.update_weights_interval`` steps, syncs
  (``time/sync_weights``) while generation goes on.
- sync (``false``): the same parts taking turns: the broker issues exactly one batch when asked,
  the actor waits for all of it (``time/rollout``), trains, syncs.
- Weight version v = number of optimizer steps whose weights the engines carry; the engines start
  at 0 with the actor's initial weights.
- Eval (``asyncrl.eval.backends``): every ``eval.eval_interval`` steps, after the step's sync and
  checkpoint. Shared engines (default): actor rank 0 tells the broker to stop issuing new prompts
  (``hold_issuing``: in-flight groups finish and buffer, nothing is aborted), evaluates greedily,
  releases, and logs ``eval/<name>/accuracy`` etc. in the step's record. External
  (``eval.eval_function_path``): every actor rank takes part in the snapshot export (or the periodic
  ``save_hf`` checkpoint is reused), a background thread on rank 0 evaluates it, and the point is
  logged later at its own step with ``eval/lag_steps``; pending points are waited for at the end.
  Dedicated fleet (``eval.eval_num_gpus``): the same snapshot hand-off, and the background job loads
  it into the fleet's engines (``eval_engine_urls``) and evaluates there; training never pauses.
  ``runner.eval_before_after`` evaluates ``data.test_path`` before the first and after the last step.
- Leader-only phases (``asyncrl.trainer.leader_phases``): what actor rank 0 does alone (set-up, the evals on the
  shared engines, waiting for a batch, the end of the run) runs in ``phases.run``; the other actor ranks
  wait for it on the store, so ``cluster.actor_collective_timeout_s`` bounds real collectives only.
- The before/after eval is logged as ``eval/test/*`` at step 0 and at the last step (its own record).
- Logging: Miles' custom hooks (``asyncrl.trainer.log_hooks``) see every step and eval record first; returning
  True leaves their ``rollout/*`` / ``eval/*`` keys out of the record.
- Invariant: a step's staleness (reported by the broker) never exceeds the buffer limit's bound
  ``max_buffered_groups / rollout_batch_size + 1`` unless a cap drops it first.
- Engine restarts (``asyncrl.sync.recovery``): every sync re-joins restarted engines and is retried
  when an engine dies under it; while the leader waits for a batch it asks for it in slices of
  ``_BATCH_SLICE_S`` and, when a restarted engine waits for its weights, all actor ranks run a
  catch-up sync first (``_next_batch``); ``rollout/engine_restarts`` counts the restarts.
- The broker is watched by ``asyncrl.cluster.process.fail_fast_on_exit`` (set up in ``roles``): its
  death fails the rank at once; here it is only marked as stopping before the deliberate shutdown.
- Bad numbers (``asyncrl.trainer.guards``): a step with a non-finite loss, grad norm or reward counts in
  ``train/nonfinite_steps``; ``runner.max_nonfinite_steps`` of them in a row raise ``NonFiniteError`` on
  every actor rank (the step is logged first): the job exits non-zero.
- Preemption (``asyncrl.trainer.guards``): SIGUSR1 or SIGTERM on any actor rank is checked between steps and right
  after training, on actor rank 0 also while it waits for a batch (the step's sync and eval are skipped; a sync that fails because
  the engines stopped is abandoned); then every actor rank writes the checkpoint of the last trained step and
  raises ``Preempted`` (the rank exits 75).
- Resume (``asyncrl.trainer.resume``, ``CheckpointManager.pick``): only this run's checkpoints (run id + config
  hash, ``run.json`` in the run dir and in each checkpoint) or ``runner.resume_from``; resumed steps are purged
  from the metrics.

    rc = run_training(ctx, broker_address=..., engine_urls=[...], broker_child=child, actor_rank=0)
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from asyncrl.actor.checkpoint import CheckpointManager
from asyncrl.actor.megatron_actor import Actor
from asyncrl.broker.serve import freeze_setup_objects
from asyncrl.eval.backends import EngineEvaluator, PeriodicEval, engine_eval_metrics, select_backend
from asyncrl.eval.fleet import FleetEval
from asyncrl.sync.recovery import SyncAbandoned, sync_weights
from asyncrl.trainer.guards import PREEMPT_SIGNAL, NonFiniteError, NonFiniteGuard, Preempted, Preemption
from asyncrl.trainer.leader import LeaderParts
from asyncrl.trainer.resume import establish_identity
from asyncrl.trainer.summary import broker_accounting, new_summary, print_summary, record_step, wait_split

log = logging.getLogger("asyncrl.runner")

# The leader's batch wait is cut into slices this long, so a restarted engine waiting for its catch-up
# sync is served within about this many seconds (it cannot produce data before).
_BATCH_SLICE_S = 2.0
_PREEMPT = "preempt"  # what the leader's batch wait returns when a preemption signal arrived


def _bcast_obj(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _gather_obj(obj) -> list:
    """``obj`` of every actor rank, on every actor rank (collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rollout_metrics(groups) -> dict[str, float]:
    """reward/mean, response length, turns and tool calls per trajectory of the trained batch (token fields
    are the broker's arrays: counted with numpy, never element by element)."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    n = len(trajs)
    bad = sum(not math.isfinite(t.reward) for t in trajs)
    gen_lens = [int(np.count_nonzero(t.loss_mask)) for t in trajs]
    return {
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


def evaluate_on_engines(cfg, engine_urls: list[str], *, tokenizer_path: str, broker=None, evaluator=None) -> dict:
    """Greedy held-out accuracy (``data.test_path``) on the shared engines; with ``broker``, no new prompt
    is issued meanwhile (``hold_issuing``; in-flight groups finish) and issuing resumes after."""
    if not cfg.data.test_path:
        return {}
    evaluator = evaluator or EngineEvaluator(cfg, engine_urls, tokenizer_path=tokenizer_path)
    if broker is not None:
        broker.hold_issuing()
    try:
        return evaluator.evaluate({"test": cfg.data.test_path})["test"]
    finally:
        if broker is not None:
            broker.release_issuing()


def _leader_batch(parts: LeaderParts, cfg, step: int, actor_version: int, t0: float, preempt=None):
    """The step's groups (after the sample filter) and their metrics; None as soon as a restarted engine
    waits for its catch-up sync (``_next_batch`` runs it, then asks again); ``_PREEMPT`` on preemption."""
    if cfg.rollout_buffer.max_inflight_groups == "auto":
        parts.report_engine_figures()
    batch = _wait_batch(parts.broker, parts.recovery, step, actor_version, batch_timeout_s(cfg), t0, preempt)
    if batch is None or batch is _PREEMPT:
        return batch
    m: dict[str, float] = {}
    groups = parts.batch_filter(batch.groups)
    kept = {g.group_id for g in groups}
    removed = [g.group_id for g in batch.groups if g.group_id not in kept]
    if removed:
        parts.broker.batch_filtered(removed)
    m["rollout/sample_filter/kept_groups"] = float(len(groups))
    m["rollout/sample_filter/removed_groups"] = float(len(removed))
    m.update(wait_split(batch.metrics, batch.wait_s, async_mode=cfg.runner.async_mode))
    m.update(rollout_metrics(groups))
    parts.last_groups = groups
    return groups, m


def batch_timeout_s(cfg) -> float:
    """How long actor rank 0 waits for one batch from the broker."""
    return cfg.rollout.request_timeout_s * 4


def before_after_eval(cfg, parts: LeaderParts, evaluator, engine_urls: list[str], *, step: int, release: bool) -> dict:
    """The held-out eval before the first / after the last step: its summary, also logged at ``step`` as
    ``eval/test/*`` (TensorBoard and metrics.jsonl). ``release=False`` leaves issuing held (the run ends)."""
    t0 = time.perf_counter()
    if release:
        result = evaluate_on_engines(
            cfg, engine_urls, tokenizer_path=cfg.rollout.model_path, broker=parts.broker, evaluator=evaluator
        )
    else:
        parts.broker.hold_issuing()
        result = evaluate_on_engines(cfg, engine_urls, tokenizer_path=cfg.rollout.model_path, evaluator=evaluator)
    if result:
        m = engine_eval_metrics({"test": result})
        m["eval/time_seconds"] = time.perf_counter() - t0
        parts.writer.log(parts.hooks.eval(step, m), step)
    log.info("held-out accuracy %s training: %s", "before" if release else "after", json.dumps(result))
    return result


def run_training(
    ctx,
    *,
    broker_address: str | None,
    engine_urls: list[str],
    broker_child,
    actor_rank: int,
    eval_engine_urls: list[str] | None = None,
    phases,
    discovery=None,
) -> int:
    """The step loop on every actor rank (``Trainer``); 0 when every step ran."""
    trainer = Trainer(
        ctx,
        broker_address=broker_address,
        engine_urls=engine_urls,
        broker_child=broker_child,
        actor_rank=actor_rank,
        eval_engine_urls=eval_engine_urls,
        phases=phases,
        discovery=discovery,
    )
    return trainer.run()


class Trainer:
    """One actor rank's run, built in one place: the Megatron actor on every rank; on actor rank 0 also the
    leader's parts (``LeaderParts``: broker client, weight-sync group, metrics writer, engine scraper, hooks,
    engine recovery) and the evaluator. ``phases`` (``asyncrl.trainer.leader_phases.LeaderPhases``) runs what actor rank
    0 does alone (set-up, evals, waiting for a batch, the end) while the others wait outside any collective;
    ``discovery`` carries the engines' restart counts (``asyncrl.sync.recovery``). What only the leader does is
    decided here, in the small methods below, so ``_step`` reads the same on every rank."""

    def __init__(
        self, ctx, *, broker_address, engine_urls, broker_child, actor_rank, eval_engine_urls, phases, discovery
    ):
        cfg = self.cfg = ctx.cfg
        self.ctx, self.phases, self.engine_urls, self.broker_child = ctx, phases, engine_urls, broker_child
        self.is_leader = actor_rank == 0
        self.actor = Actor(cfg)
        self.ckpts = CheckpointManager(cfg.actor.checkpoint_dir or ctx.run_dir / "checkpoints")
        plan = _resume_plan(cfg, ctx.run_dir, self.ckpts) if self.is_leader else None
        self.ident, self.latest, purge_step = _bcast_obj(plan)
        self.parts = phases.run(
            "set up the weight sync and the metrics",
            lambda: LeaderParts(cfg, ctx.run_dir, broker_address, engine_urls, discovery, purge_step=purge_step),
        )
        self.broker = self.parts.broker if self.is_leader else None
        self.recovery = self.parts.recovery if self.is_leader else None
        built = phases.run(
            "build the evaluator (checks the tool URLs)",
            lambda: _make_evaluation(
                cfg,
                self.actor,
                True,
                self.broker,
                engine_urls,
                self.ckpts,
                eval_engine_urls=eval_engine_urls,
                phases=phases,
            ),
        )
        if not self.is_leader:
            built = _make_evaluation(cfg, self.actor, False, None, engine_urls, self.ckpts, phases=phases)
        self.periodic, self.evaluator = built
        self.summary = new_summary()
        self.nonfinite = NonFiniteGuard(cfg.runner.max_nonfinite_steps)
        self.preempt = Preemption()

    def run(self) -> int:
        cfg = self.cfg
        start_step = self._resume()
        if cfg.runner.eval_before_after and start_step == 0:
            self.summary["eval_before"] = self.phases.run(
                "eval before training",
                lambda: before_after_eval(cfg, self.parts, self.evaluator, self.engine_urls, step=0, release=True),
            )
        self.preempt.install()
        if self.recovery is not None:  # a sync that fails once a preemption signal arrived is abandoned
            self.recovery.abandon = lambda: self.preempt.requested
        freeze_setup_objects()  # full collections then skip the set-up heap (torch, Megatron, the model)
        try:
            for step in range(start_step + 1, cfg.runner.max_steps + 1):
                self._step(step)
        finally:
            self.preempt.restore()
        self.phases.run(
            "finish the run",
            lambda: _finish(
                self.ctx, self.parts, self.periodic, self.summary, self.evaluator, self.engine_urls, self.broker_child
            ),
        )
        dist.barrier()
        return 0

    def _resume(self) -> int:
        """Load the checkpoint picked by ``_resume_plan`` (the broker's state with it) and bring the engines to
        its weights (they started from the HF checkpoint); the step to go on from."""
        if not self.latest:
            return 0
        meta, broker_state = self.ckpts.load(self.actor, self.latest)
        if self.is_leader:
            if broker_state is not None:
                self.broker.set_state(broker_state)
            log.info(
                "resumed from %s at step %d (weight version %d)", self.latest, int(meta["step"]), self.actor.version
            )
        self._sync()
        return int(meta["step"])

    def _step(self, step: int) -> None:
        """One step. A preemption signal on any actor rank seen before the batch (or by the leader while it waits
        for it) checkpoints the previous step; seen after training (or failing the step's sync) it skips the
        step's sync and eval, logs and checkpoints the step. Either way ``Preempted`` is raised on every rank."""
        cfg, t_step = self.cfg, time.perf_counter()
        got = None if any(_gather_obj(self.preempt.requested)) else self._batch(step)
        if got is None:
            self._preempted(step - 1)
        groups, m = got
        t0 = time.perf_counter()
        m.update(self.actor.train_step(groups))
        m["time/training"] = time.perf_counter() - t0
        # the leader alone sees the rewards; a preemption signal on any actor rank counts
        seen = _gather_obj((self.nonfinite.update(m) if self.is_leader else None, self.preempt.requested))
        verdict, stop = seen[0][0], any(flag for _, flag in seen)
        if verdict:
            self._log(m, step, t_step)
            raise NonFiniteError(verdict)
        m["time/sync_weights"] = 0.0
        if not stop and step % cfg.rollout.update_weights_interval == 0:
            try:
                res = self._sync()
            except SyncAbandoned as e:  # the engines stopped under a preemption: the checkpoint has the weights
                log.warning("%s", e)
                stop = True
            else:
                if res is not None:
                    m.update(res.metrics())
        if stop:  # preempted: no sync (or a broken one), no eval; this step is logged and checkpointed
            self._log(m, step, t_step)
            self._preempted(step)
        r = cfg.runner
        if (r.checkpoint_interval and step % r.checkpoint_interval == 0) or (r.save_at_end and step == r.max_steps):
            self._save(step)
        m.update(self.periodic.after_step(step))  # after the sync and the checkpoint: the snapshot is this step's
        self._log(m, step, t_step)

    def _batch(self, step: int):
        return _next_batch(
            self.actor, self.parts if self.is_leader else None, self.cfg, step, self.phases, self.preempt
        )

    def _sync(self):
        return _sync(self.actor, self.parts.syncer if self.is_leader else None, self.cfg, self.is_leader, self.recovery)

    def _log(self, m: dict, step: int, t_step: float) -> None:
        if self.is_leader:
            _log_step(self.cfg, self.parts, self.periodic, self.summary, m, step, t_step, self.actor.version)

    def _save(self, step: int) -> None:
        """The checkpoint of ``step`` (collective); the leader adds the broker's state and the run identity."""
        self.ckpts.save(
            self.actor, step, broker_state=self.broker.get_state if self.is_leader else None, ident=self.ident
        )

    def _preempted(self, step: int) -> None:
        """Every actor rank: the checkpoint of the last finished ``step`` (unless written already), then raise
        ``Preempted`` naming the signal (the first actor rank's that got one)."""
        signame = next((n for n in _gather_obj(self.preempt.signame) if n), PREEMPT_SIGNAL.name)
        d = self.ckpts.step_dir(step)
        if step > 0 and not self.ckpts.is_complete(d):
            log.warning("preemption signal (%s): writing the checkpoint of step %d before exiting", signame, step)
            t0 = time.perf_counter()
            self._save(step)
            log.warning("checkpoint of step %d written in %.1f s", step, time.perf_counter() - t0)
        dist.barrier()
        raise Preempted(step, str(d) if step > 0 else None, signame)


def _log_step(
    cfg, parts: LeaderParts, periodic, summary: dict, m: dict, step: int, t_step: float, version: int
) -> None:
    m["time/step"] = time.perf_counter() - t_step
    m.update(parts.scraper.latest())
    m.update(broker_accounting(parts.broker.status()))
    m["actor/weight_version"] = float(version)
    m["rollout/engine_restarts"] = float(parts.recovery.total_restarts())
    parts.writer.log(parts.hooks.step(step, parts.last_groups, m), step)
    for eval_step, em in periodic.late_points(step):  # external/fleet evals: each at its own step
        parts.writer.log(parts.hooks.eval(eval_step, em), eval_step)
    record_step(summary, m)


def _finish(ctx, parts: LeaderParts, periodic, summary: dict, evaluator, engine_urls: list[str], broker_child) -> None:
    """Actor rank 0 at the end: pending external evals, the after-training eval, the summary, shutdown."""
    cfg = ctx.cfg
    for eval_step, em in periodic.finish(cfg.runner.max_steps):  # pending external evals (bounded wait)
        parts.writer.log(parts.hooks.eval(eval_step, em), eval_step)
    if cfg.runner.eval_before_after:  # no new prompts from here on: the run ends after this eval
        summary["eval_after"] = before_after_eval(
            cfg, parts, evaluator, engine_urls, step=cfg.runner.max_steps, release=False
        )
    summary["wall_s"] = time.time() - ctx.started_at
    summary["prepare_s"] = ctx.timings.get("prepare", 0.0)
    print_summary(cfg, summary, ctx.run_dir)
    parts.scraper.close()
    parts.group.destroy()  # while the engines are up: the broker's shutdown stops the workers and their engines
    if broker_child is not None:
        broker_child.stopping = True  # its exit from here on is asked for (see fail_fast_on_exit)
    parts.broker.shutdown()
    parts.broker.close()
    parts.writer.close()


def _make_evaluation(
    cfg,
    actor,
    is_leader: bool,
    broker,
    engine_urls: list[str],
    checkpoints: CheckpointManager,
    *,
    eval_engine_urls: list[str] | None = None,
    phases=None,
):
    """The periodic eval (``eval.*``) and, on the leader, the shared-engine evaluator (built once; it checks
    the tool URLs it will call)."""
    evaluator = None
    if is_leader and (cfg.runner.eval_before_after and cfg.data.test_path or select_backend(cfg) == "shared"):
        evaluator = EngineEvaluator(cfg, engine_urls, tokenizer_path=cfg.rollout.model_path)
    fleet = None
    if is_leader and select_backend(cfg) == "fleet":
        fleet = FleetEval(
            cfg, list(eval_engine_urls or []), tokenizer_path=cfg.rollout.model_path or cfg.actor.model_path
        )
    periodic = PeriodicEval(
        cfg,
        actor=actor,
        is_leader=is_leader,
        broker=broker,
        engine_evaluator=evaluator,
        checkpoints=checkpoints,
        bcast=_bcast_obj,
        fleet_eval=fleet,
        leader_phase=phases.run if phases is not None else None,
    )
    return periodic, evaluator


def _sync(actor, syncer, cfg, is_leader, recovery=None):
    """A weight sync at the actor's version (collective), surviving engine restarts (``sync.recovery``)."""
    return sync_weights(
        actor, syncer, recovery, bucket_bytes=cfg.sync.bucket_bytes, is_leader=is_leader, bcast=_bcast_obj
    )


def _next_batch(actor, parts, cfg, step: int, phases, preempt=None):
    """The step's ``(groups, metrics)`` on the leader (``(None, {})`` elsewhere); None on every rank when a
    preemption signal reached the leader meanwhile. The wait is a leader phase; when a restarted engine waits
    for its weights the leader ends the phase early and all actor ranks run a catch-up sync (collective), then
    the leader waits again (see module contract)."""
    t0 = time.monotonic()
    while True:
        got = phases.run(
            f"wait for the batch of step {step}",
            lambda: _leader_batch(parts, cfg, step, actor.version, t0, preempt),
            timeout_s=batch_timeout_s(cfg) + cfg.rollout.control_timeout_s,
        )
        verdict = _bcast_obj(
            None if parts is None else "preempt" if got is _PREEMPT else "sync" if got is None else None
        )
        if verdict == "preempt":
            return None
        if verdict is None:
            return got if parts is not None else (None, {})
        log.info("step %d: catch-up weight sync for restarted engine(s) while waiting for data", step)
        try:
            _sync(
                actor,
                parts.syncer if parts is not None else None,
                cfg,
                parts is not None,
                parts.recovery if parts is not None else None,
            )
        except SyncAbandoned as e:  # a preemption signal arrived and the sync failed: stop as preempted
            log.warning("%s", e)
            return None


def _wait_batch(broker, recovery, step: int, version: int, timeout_s: float, t0: float, preempt=None):
    """Ask the broker in slices; None as soon as a restarted engine waits for its catch-up sync, ``_PREEMPT`` as
    soon as a preemption signal arrived."""
    while True:
        if preempt is not None and preempt.requested:
            return _PREEMPT
        if recovery is not None and recovery.pending():
            return None
        left = timeout_s - (time.monotonic() - t0)
        if left <= 0:
            raise TimeoutError(
                f"no batch for step {step} from the broker within {timeout_s:.0f}s (rollout.request_timeout_s x 4)"
            )
        try:
            batch = broker.get_batch(step, timeout_s=min(_BATCH_SLICE_S, left), actor_version=version)
        except TimeoutError:
            continue
        batch.wait_s = time.monotonic() - t0
        return batch


def _resume_plan(cfg, run_dir: Path, ckpts: CheckpointManager) -> tuple[dict, str | None, int | None]:
    """Actor rank 0: this run's identity (``asyncrl.trainer.resume``), the checkpoint to resume from and the first
    step whose old metrics are purged (None when not resuming)."""
    ident = establish_identity(cfg, run_dir)
    ckpt = ckpts.pick(ident, resume=cfg.runner.resume, resume_from=cfg.runner.resume_from)
    if not (cfg.runner.resume or cfg.runner.resume_from):
        return ident, None, None
    start = ckpts.step_of(ckpt) if ckpt is not None else 0
    return ident, (str(ckpt) if ckpt is not None else None), start + 1
