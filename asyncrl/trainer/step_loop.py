"""The step loop on the actor ranks: get a batch, train, sync weights, log. Async and sync modes.

Contract
- Every actor rank runs the Megatron actor; what actor rank 0 alone does (the broker, the engines, the metrics
  writer, the evaluators, the summary) is one object, ``asyncrl.trainer.leader.Leader``, and ``NullLeader`` on the
  other ranks, so the step reads the same on every rank with no ``if leader`` in it. The step records'
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
  ``leader.BATCH_SLICE_S`` and, when a restarted engine waits for its weights, all actor ranks run a
  catch-up sync first (``Trainer._batch``); ``rollout/engine_restarts`` counts the restarts.
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
  hash, ``run.json`` in the run dir and in each checkpoint), the newest intact one (checked against its manifest), or
  ``runner.resume_from``; resumed steps are purged from the metrics. A run never writes into another run's
  checkpoints or metrics (``resume.check_run_dir``). Retention: ``actor.keep_checkpoints``, held while an
  external eval reads a checkpoint's ``hf_export``.

    rc = run_training(ctx, broker_address=..., engine_urls=[...], broker_child=child, actor_rank=0)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist

from asyncrl.actor.checkpoint import CheckpointManager
from asyncrl.actor.megatron_actor import Actor
from asyncrl.actor.shard_source import ShardSource, param_metas
from asyncrl.broker.serve import freeze_setup_objects
from asyncrl.eval.backends import PeriodicEval
from asyncrl.sync.recovery import SyncAbandoned, sync_weights
from asyncrl.sync.sharded import ShardedSync, funnel_bytes, sync_weights_sharded, with_bytes
from asyncrl.trainer.guards import PREEMPT_SIGNAL, NonFiniteError, Preempted, Preemption
from asyncrl.trainer.leader import PREEMPT, Batch, Leader, NullLeader, batch_timeout_s
from asyncrl.trainer.resume import establish_identity

log = logging.getLogger("asyncrl.trainer")


def _bcast_obj(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _gather_obj(obj) -> list:
    """``obj`` of every actor rank, on every actor rank (collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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
    """One actor rank's run, built in one place: the Megatron actor on every rank, the leader (``Leader`` on actor
    rank 0: broker client, weight sync, metrics writer, engine scraper, hooks, engine recovery, evaluators;
    ``NullLeader`` elsewhere) and the periodic eval. ``phases`` (``asyncrl.trainer.leader_phases.LeaderPhases``) runs
    what actor rank 0 does alone (set-up, evals, waiting for a batch, the end) while the others wait outside any
    collective; ``discovery`` carries the engines' restart counts (``asyncrl.sync.recovery``)."""

    def __init__(
        self, ctx, *, broker_address, engine_urls, broker_child, actor_rank, eval_engine_urls, phases, discovery
    ):
        cfg = self.cfg = ctx.cfg
        self.ctx, self.phases, self.broker_child = ctx, phases, broker_child
        self.actor = Actor(cfg)
        self.ckpts = CheckpointManager(
            cfg.actor.checkpoint_dir or ctx.run_dir / "checkpoints", keep=cfg.actor.keep_checkpoints
        )
        plan = _resume_plan(cfg, ctx.run_dir, self.ckpts) if actor_rank == 0 else None
        self.ident, self.latest, purge_step = _bcast_obj(plan)
        leader = phases.run(
            "set up the weight sync and the metrics",
            lambda: Leader(
                cfg,
                ctx.run_dir,
                broker_address,
                engine_urls,
                discovery=discovery,
                purge_step=purge_step,
                run_id=self.ident["run_id"],
            ),
        )
        self.leader = leader if actor_rank == 0 else NullLeader()
        self._metas = None  # the model's parameters as the sync plans them (the broadcast topology's byte figures)
        self.sharded = None  # sync.topology = "sharded": every actor rank's part, its groups formed here (collective)
        if cfg.sync.topology == "sharded":
            self.sharded = ShardedSync(ShardSource(self.actor), cfg.sync, bcast=_bcast_obj, syncer=self.leader.syncer)
            self.sharded.form()
        built = phases.run("build the evaluator (checks the tool URLs)", lambda: self._evaluation(eval_engine_urls))
        self.periodic = built if self.leader.is_leader else self._evaluation(None)
        self.preempt = Preemption()

    def _evaluation(self, eval_engine_urls: list[str] | None) -> PeriodicEval:
        """The leader's evaluators (``Leader.build_evaluators``) and the periodic eval (``eval.*``) on this rank."""
        self.leader.build_evaluators(eval_engine_urls)
        return PeriodicEval(
            self.cfg,
            actor=self.actor,
            is_leader=self.leader.is_leader,
            broker=self.leader.broker,
            engine_evaluator=self.leader.evaluator,
            checkpoints=self.ckpts,
            bcast=_bcast_obj,
            fleet_eval=self.leader.fleet,
            leader_phase=self.phases.run,
        )

    def run(self) -> int:
        cfg = self.cfg
        start_step = self._resume()
        if cfg.runner.eval_before_after and start_step == 0:
            self.phases.run("eval before training", lambda: self.leader.held_out_eval(step=0, release=True))
        self.preempt.install()
        self.leader.abandon_syncs_when(lambda: self.preempt.requested)
        freeze_setup_objects()  # full collections then skip the set-up heap (torch, Megatron, the model)
        try:
            for step in range(start_step + 1, cfg.runner.max_steps + 1):
                self._step(step)
        finally:
            self.preempt.restore()
        if self.sharded is not None:  # while the engines are up (the leader's finish stops them)
            self.sharded.destroy()
        self.phases.run("finish the run", lambda: self.leader.finish(self.ctx, self.periodic, self.broker_child))
        dist.barrier()
        return 0

    def _resume(self) -> int:
        """Load the checkpoint picked by ``_resume_plan`` (the broker's state with it) and bring the engines to
        its weights (they started from the HF checkpoint); the step to go on from."""
        if not self.latest:
            return 0
        meta, broker_state = self.ckpts.load(self.actor, self.latest)
        step = int(meta["step"])
        self.leader.resumed(broker_state, step, self.actor.version, self.latest)
        self._sync()
        return step

    def _step(self, step: int) -> None:
        """One step. A preemption signal on any actor rank seen before the batch (or by the leader while it waits
        for it) checkpoints the previous step; seen after training (or failing the step's sync) it skips the
        step's sync and eval, logs and checkpoints the step. Either way ``Preempted`` is raised on every rank."""
        cfg, t_step = self.cfg, time.perf_counter()
        batch = None if any(_gather_obj(self.preempt.requested)) else self._batch(step)
        if batch is None:
            self._preempted(step - 1)
        groups, m = batch.groups, batch.metrics
        t0 = time.perf_counter()
        m.update(self.actor.train_step(groups))
        m["time/training"] = time.perf_counter() - t0
        # the leader alone sees the rewards; a preemption signal on any actor rank counts
        seen = _gather_obj((self.leader.nonfinite_verdict(m), self.preempt.requested))
        verdict, stop = seen[0][0], any(flag for _, flag in seen)
        if verdict:
            self._log(step, batch, m, t_step)
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
            self._log(step, batch, m, t_step)
            self._preempted(step)
        r = cfg.runner
        if (r.checkpoint_interval and step % r.checkpoint_interval == 0) or (r.save_at_end and step == r.max_steps):
            self._save(step)
        m.update(self.periodic.after_step(step))  # after the sync and the checkpoint: the snapshot is this step's
        self._log(step, batch, m, t_step)

    def _batch(self, step: int):
        """The step's ``Batch`` on the leader (an empty one elsewhere); None on every rank when a preemption signal
        reached the leader meanwhile. The wait is a leader phase; when a restarted engine waits for its weights the
        leader ends the phase early and all actor ranks run a catch-up sync (collective), then the leader waits
        again (see module contract)."""
        cfg, t0 = self.cfg, time.monotonic()
        while True:
            got = self.phases.run(
                f"wait for the batch of step {step}",
                lambda: self.leader.next_batch(step, self.actor.version, t0, self.preempt),
                timeout_s=batch_timeout_s(cfg) + cfg.rollout.control_timeout_s,
            )
            verdict = _bcast_obj(self.leader.batch_verdict(got))
            if verdict == PREEMPT:
                return None
            if verdict is None:
                return got if self.leader.is_leader else Batch(None)  # its share comes in the actor's scatter
            log.info("step %d: catch-up weight sync for restarted engine(s) while waiting for data", step)
            try:
                self._sync()
            except SyncAbandoned as e:  # a preemption signal arrived and the sync failed: stop as preempted
                log.warning("%s", e)
                return None

    def _sync(self):
        """A weight sync at the actor's version (collective), surviving engine restarts (``sync.recovery``), with the
        bytes through actor rank 0 and the busiest rank (``sync/rank0_bytes``, ``sync/bytes_max_rank``)."""
        if self.sharded is not None:
            return sync_weights_sharded(self.sharded, self.leader.recovery, bcast=_bcast_obj)
        res = sync_weights(
            self.actor,
            self.leader.syncer,
            self.leader.recovery,
            bucket_bytes=self.cfg.sync.bucket_bytes,
            is_leader=self.leader.is_leader,
            bcast=_bcast_obj,
        )
        if res is None:
            return None
        if self._metas is None:
            self._metas = param_metas(self.actor.model, self.actor.spec, tp=self.actor.tp)
        return with_bytes(res, *funnel_bytes(self._metas, tp=self.actor.tp, num_bytes=res.num_bytes))

    def _log(self, step: int, batch, m: dict, t_step: float) -> None:
        self.leader.log_step(step, batch, m, t_step=t_step, version=self.actor.version, periodic=self.periodic)

    def _save(self, step: int) -> None:
        """The checkpoint of ``step`` (collective); the leader adds the broker's state and the run identity."""
        disp = self.periodic.dispatcher  # an external eval still reading a checkpoint's hf_export holds the retention
        reading = disp is not None and not self.cfg.eval.eval_hf_dir and disp.num_pending > 0
        self.ckpts.save(self.actor, step, broker_state=self.leader.broker_state, ident=self.ident, prune=not reading)

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


def _resume_plan(cfg, run_dir: Path, ckpts: CheckpointManager) -> tuple[dict, str | None, int | None]:
    """Actor rank 0: this run's identity (``asyncrl.trainer.resume``), the checkpoint to resume from and the first
    step whose old metrics are purged (None when not resuming)."""
    ident = establish_identity(cfg, run_dir, ckpts)
    ckpt = ckpts.pick(ident, resume=cfg.runner.resume, resume_from=cfg.runner.resume_from)
    if not (cfg.runner.resume or cfg.runner.resume_from):
        return ident, None, None
    start = ckpts.step_of(ckpt) if ckpt is not None else 0
    return ident, (str(ckpt) if ckpt is not None else None), start + 1
