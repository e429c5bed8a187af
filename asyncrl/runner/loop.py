"""The step loop on the actor ranks: get a batch, train, sync weights, log. Async and sync modes.

Contract
- Wires actor rank 0 to the broker (``BrokerClient``), the engines (``WeightSyncGroup`` +
  ``WeightSyncer``) and the metrics writer; every actor rank runs the Megatron actor.
- async (``runner.async_mode = true``): the broker keeps issuing while the actor trains; each step
  takes the oldest ``rollout_batch_size`` groups (``time/wait_data`` = how long it waited), trains
  (``time/training``) and, every ``rollout.update_weights_interval`` steps, syncs
  (``time/sync_weights``) while generation goes on.
- sync (``false``): the same parts taking turns: the broker issues exactly one batch when asked,
  the actor waits for all of it (``time/rollout``), trains, syncs.
- Weight version v = number of optimizer steps whose weights the engines carry; the engines start
  at 0 with the actor's initial weights.
- Eval (``asyncrl.runner.evaluation``): every ``eval.eval_interval`` steps, after the step's sync and
  checkpoint. Shared engines (default): actor rank 0 tells the broker to stop issuing new prompts
  (``hold_issuing``: in-flight groups finish and buffer, nothing is aborted), evaluates greedily,
  releases, and logs ``eval/<name>/accuracy`` etc. in the step's record. External
  (``eval.eval_function_path``): every actor rank takes part in the snapshot export (or the periodic
  ``save_hf`` checkpoint is reused), a background thread on rank 0 evaluates it, and the point is
  logged later at its own step with ``eval/lag_steps``; pending points are waited for at the end.
  Dedicated fleet (``eval.eval_num_gpus``): the same snapshot hand-off, and the background job loads
  it into the fleet's engines (``eval_engine_urls``) and evaluates there; training never pauses.
  ``runner.eval_before_after`` evaluates ``data.test_path`` before the first and after the last step.
- Leader-only phases (``asyncrl.runner.leader``): what actor rank 0 does alone (set-up, the evals on the
  shared engines, waiting for a batch, the end of the run) runs in ``phases.run``; the other actor ranks
  wait for it on the store, so ``cluster.actor_collective_timeout_s`` bounds real collectives only.
- The before/after eval is logged as ``eval/test/*`` at step 0 and at the last step (its own record).
- Logging: Miles' custom hooks (``asyncrl.runner.log_hooks``) see every step and eval record first; returning
  True leaves their ``rollout/*`` / ``eval/*`` keys out of the record.
- Invariant: a step's staleness (reported by the broker) never exceeds the buffer limit's bound
  ``max_buffered_groups / rollout_batch_size + 1`` unless a cap drops it first.
- Engine restarts (``asyncrl.sync.recovery``): every sync re-joins restarted engines and is retried
  when an engine dies under it; while the leader waits for a batch it asks for it in slices of
  ``_BATCH_SLICE_S`` and, when a restarted engine waits for its weights, all actor ranks run a
  catch-up sync first (``_next_batch``); ``rollout/engine_restarts`` counts the restarts.
- The broker is watched by ``asyncrl.cluster.process.fail_fast_on_exit`` (set up in ``roles``): its
  death fails the rank at once; here it is only marked as stopping before the deliberate shutdown.
- Bad numbers (``asyncrl.runner.guards``): a step with a non-finite loss, grad norm or reward counts in
  ``train/nonfinite_steps``; ``runner.max_nonfinite_steps`` of them in a row raise ``NonFiniteError`` on
  every actor rank (the step is logged first): the job exits non-zero.
- Preemption (``asyncrl.runner.guards``): SIGUSR1 or SIGTERM on any actor rank is checked between steps and right
  after training, on actor rank 0 also while it waits for a batch (the step's sync and eval are skipped; a sync that fails because
  the engines stopped is abandoned); then every actor rank writes the checkpoint of the last trained step and
  raises ``Preempted`` (the rank exits 75).
- Resume (``asyncrl.runner.resume``): only this run's checkpoints (run id + config hash, ``run.json`` in the
  run dir and in each checkpoint) or ``runner.resume_from``; resumed steps are purged from the metrics.

    rc = run_training(ctx, broker_address=..., engine_urls=[...], broker_child=child, actor_rank=0)
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from asyncrl.actor.trainer import Actor
from asyncrl.broker.client import BrokerClient
from asyncrl.cluster.discovery import read_count, restarts_key, synced_key
from asyncrl.config.validate import resolve_hook as import_path
from asyncrl.engine.blocking import EngineStepError, get_text
from asyncrl.engine.client import parse_prometheus
from asyncrl.runner.eval_fleet import FleetEval
from asyncrl.runner.evaluation import EngineEvaluator, PeriodicEval, engine_eval_metrics, select_backend
from asyncrl.runner.guards import PREEMPT_SIGNAL, NonFiniteError, NonFiniteGuard, Preempted, Preemption
from asyncrl.runner.log_hooks import LogHooks
from asyncrl.runner.metrics import MetricsWriter
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.recovery import EngineRecovery, SyncAbandoned, sync_weights
from asyncrl.sync.weight_sync import SyncHooks, WeightSyncer

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


def broker_accounting(status: dict) -> dict[str, float]:
    """Where every issued group is: trained, dropped, held (in flight or buffered), or re-issued
    after its worker died. ``issued == trained + dropped + held + reissued`` at all times."""
    c = status.get("counters", {})
    return {
        "broker/issued_groups": float(c.get("issued", 0)),
        "broker/trained_groups": float(c.get("trained", 0)),
        "broker/dropped_groups": float(c.get("dropped", 0)),
        "broker/reissued_groups": float(c.get("reissued", 0)),
        "broker/held_groups": float(status.get("num_inflight_groups", 0) + status.get("num_buffered_groups", 0)),
    }


class EngineScraper:
    """Reads each engine's Prometheus ``/metrics`` (running requests, cache hit rate) on a background
    thread every ``interval_s``, so a slow engine (busy re-prefilling after a retract) never stalls
    the step loop; ``latest()`` returns the newest figures without blocking.

    For the in-flight autotuner it also sums, over engines, running requests, queued requests that
    are not retracted ones (a weight sync in ``retract`` mode puts every running request back in the
    queue: a backlog of the pause, not saturation) and ``gen_throughput``, and ``autotune_figures()``
    returns their mean over the scrapes since its last call (the step's, not one snapshot taken right
    after a sync, when the queue holds the re-prefill backlog). Its tokens/s is wall-clock: the change of
    each engine's ``generation_tokens_total`` counter between two scrapes over the time between them
    (``gen_throughput`` is the rate while the engine decodes: an engine idle half the time, starved by a
    small in-flight limit, reports the same figure; on the CPU default it even rose as the limit fell),
    ``gen_throughput`` only for an engine's first scrape or after its counter went back (a restart)."""

    AUTOTUNE_KEYS = ("running_reqs", "queue_reqs", "gen_tokens_per_s")

    def __init__(self, urls: list[str], *, interval_s: float = 5.0, timeout_s: float = 5.0, clock=time.monotonic):
        self.urls, self.interval_s, self.timeout_s, self.clock = urls, interval_s, timeout_s, clock
        self._tokens: dict[str, tuple[float, float]] = {}  # url -> (time, generation_tokens_total) at its last scrape
        self._latest: dict[str, float] = {}
        self._sums = dict.fromkeys(self.AUTOTUNE_KEYS, 0.0)
        self._n = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._record(self.scrape())
            self._stop.wait(self.interval_s)

    def _record(self, figures: dict[str, float]) -> None:
        with self._lock:
            self._latest = figures
            if "_autotune/running_reqs" in figures:  # at least one engine answered
                for k in self.AUTOTUNE_KEYS:
                    self._sums[k] += figures["_autotune/" + k]
                self._n += 1

    def latest(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in self._latest.items() if not k.startswith("_autotune/")}

    def autotune_figures(self) -> dict[str, float] | None:
        """Mean over the scrapes since the last call of the engines' summed running requests, queued (not
        retracted) requests and generated tokens/s; None when no scrape succeeded meanwhile."""
        with self._lock:
            if not self._n:
                return None
            out = {k: v / self._n for k, v in self._sums.items()}
            self._sums = dict.fromkeys(self.AUTOTUNE_KEYS, 0.0)
            self._n = 0
            return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)

    def scrape(self) -> dict[str, float]:
        out: dict[str, float] = {}
        running, hit = [], []
        tune = dict.fromkeys(self.AUTOTUNE_KEYS, 0.0)
        for i, u in enumerate(self.urls):
            try:
                vals = parse_prometheus(get_text(u, "/metrics", timeout_s=self.timeout_s, step="metrics"))
            except (EngineStepError, OSError, ValueError) as e:  # a failed scrape is logged, never fatal
                log.warning("engine %s: /metrics scrape failed: %s", u, e)
                continue
            # parse_prometheus keys series by name without the ``sglang:`` prefix
            r = vals.get("num_running_reqs", 0.0)
            h = vals.get("cache_hit_rate", 0.0)
            q = vals.get("num_queue_reqs", 0.0)
            out[f"engine/{i}/num_running_reqs"] = r
            out[f"engine/{i}/cache_hit_rate"] = h
            out[f"engine/{i}/num_queue_reqs"] = q
            out[f"engine/{i}/gen_throughput"] = vals.get("gen_throughput", 0.0)
            running.append(r)
            hit.append(h)
            tune["running_reqs"] += r
            tune["queue_reqs"] += max(0.0, q - vals.get("num_retracted_reqs", 0.0))
            tune["gen_tokens_per_s"] += self._tokens_per_s(u, vals)
        if running:
            out["sglang_num_running_reqs"] = sum(running) / len(running)
            out["sglang_cache_hit_rate"] = sum(hit) / len(hit)
            out["prefix_cache_hit_rate"] = out["sglang_cache_hit_rate"]  # Miles' per-step name
            out.update({"_autotune/" + k: v for k, v in tune.items()})
        return out

    def _tokens_per_s(self, url: str, vals: dict[str, float]) -> float:
        now, n = self.clock(), vals.get("generation_tokens_total")
        last = self._tokens.get(url)
        if n is None:
            return vals.get("gen_throughput", 0.0)
        self._tokens[url] = (now, n)
        if last is None or n < last[1] or now <= last[0]:
            return vals.get("gen_throughput", 0.0)
        return (n - last[1]) / (now - last[0])


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


class _LeaderParts:
    """What actor rank 0 alone holds: the broker client, the metrics writer, the weight sync, the scraper."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        broker_address: str,
        engine_urls: list[str],
        discovery=None,
        *,
        purge_step: int | None = None,
    ):
        self.broker = BrokerClient(broker_address, timeout_s=cfg.rollout.control_timeout_s)
        self.writer = MetricsWriter(
            run_dir,
            tensorboard=cfg.logging.tensorboard,
            jsonl=cfg.logging.jsonl,
            console=cfg.logging.console,
            max_steps=cfg.runner.max_steps,
            purge_step=purge_step,
        )
        self.group = WeightSyncGroup(
            [EngineEndpoint(u, tp_size=cfg.rollout.tensor_parallel_size) for u in engine_urls], cfg.sync
        )
        self.group.init()
        self.syncer = WeightSyncer(
            self.group,
            pause_mode=cfg.rollout.pause_mode,
            sync_cfg=cfg.sync,
            hooks=SyncHooks(sync_begin=self.broker.sync_begin, sync_end=self.broker.sync_end),
        )
        self.recovery = make_recovery(cfg, self.group, discovery)
        self.scraper = EngineScraper(engine_urls, interval_s=cfg.logging.engine_metrics_interval_s)
        self.batch_filter = make_batch_filter(cfg.rollout_buffer.sample_filter_path)
        self.hooks = LogHooks(cfg)  # Miles' custom logging hooks
        self.last_groups: list = []

    def next_batch(self, cfg, step: int, actor_version: int, t0: float, preempt=None):
        """The step's groups (after the sample filter) and their metrics; None as soon as a restarted engine
        waits for its catch-up sync (``_next_batch`` runs it, then asks again); ``_PREEMPT`` on preemption."""
        if cfg.rollout_buffer.max_inflight_groups == "auto":
            self.report_engine_figures()
        batch = _wait_batch(self.broker, self.recovery, step, actor_version, batch_timeout_s(cfg), t0, preempt)
        if batch is None or batch is _PREEMPT:
            return batch
        m: dict[str, float] = {}
        groups = self.batch_filter(batch.groups)
        kept = {g.group_id for g in groups}
        removed = [g.group_id for g in batch.groups if g.group_id not in kept]
        if removed:
            self.broker.batch_filtered(removed)
        m["rollout/sample_filter/kept_groups"] = float(len(groups))
        m["rollout/sample_filter/removed_groups"] = float(len(removed))
        m.update(wait_split(batch.metrics, batch.wait_s, async_mode=cfg.runner.async_mode))
        m.update(rollout_metrics(groups))
        self.last_groups = groups
        return groups, m

    def report_engine_figures(self) -> None:
        """The engines' figures (summed over engines, averaged over the scrapes since the last report) to the
        broker's in-flight autotuner."""
        figures = self.scraper.autotune_figures()
        if figures is None:
            return
        self.broker.engine_figures(**figures)


def wait_split(batch_metrics: dict[str, float], wait_s: float, *, async_mode: bool) -> dict[str, float]:
    """The batch's metrics with its wait counted once: ``time/wait_data`` in async mode, ``time/rollout`` in sync
    mode (RLinf's split: sync time/step = rollout + training + sync_weights, async = training + wait_data + sync)."""
    m = {k: v for k, v in batch_metrics.items() if k not in ("time/wait_data", "time/rollout")}
    m["time/wait_data" if async_mode else "time/rollout"] = wait_s
    return m


def batch_timeout_s(cfg) -> float:
    """How long actor rank 0 waits for one batch from the broker."""
    return cfg.rollout.request_timeout_s * 4


def before_after_eval(cfg, parts: _LeaderParts, evaluator, engine_urls: list[str], *, step: int, release: bool) -> dict:
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
    leader's parts (``_LeaderParts``: broker client, weight-sync group, metrics writer, engine scraper, hooks,
    engine recovery) and the evaluator. ``phases`` (``asyncrl.runner.leader.LeaderPhases``) runs what actor rank
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
        self.ckpt_root = Path(cfg.actor.checkpoint_dir or ctx.run_dir / "checkpoints")
        plan = _resume_plan(cfg, ctx.run_dir, self.ckpt_root) if self.is_leader else None
        self.ident, self.latest, purge_step = _bcast_obj(plan)
        self.parts = phases.run(
            "set up the weight sync and the metrics",
            lambda: _LeaderParts(cfg, ctx.run_dir, broker_address, engine_urls, discovery, purge_step=purge_step),
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
                self.ckpt_root,
                eval_engine_urls=eval_engine_urls,
                phases=phases,
            ),
        )
        if not self.is_leader:
            built = _make_evaluation(cfg, self.actor, False, None, engine_urls, self.ckpt_root, phases=phases)
        self.periodic, self.evaluator = built
        self.summary: dict = {"staleness_max": 0.0, "drops": 0.0, "steps": []}
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
        meta = self.actor.load_checkpoint(self.latest)
        if self.is_leader:
            broker_state = Path(self.latest) / "broker_state.bin"
            if broker_state.is_file():
                self.broker.set_state(broker_state.read_bytes())
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
            _save(self.actor, self.ckpt_root, step, self.broker, self.ident)
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

    def _preempted(self, step: int) -> None:
        _preempted(self.actor, self.ckpt_root, step, self.broker, self.ident, self.preempt)


def _preempted(actor, root: Path, step: int, broker, ident: dict, preempt) -> None:
    """Every actor rank: the checkpoint of the last finished ``step`` (unless written already), then raise
    ``Preempted`` naming the signal (the first actor rank's that got one)."""
    signame = next((n for n in _gather_obj(preempt.signame) if n), PREEMPT_SIGNAL.name)
    d = root / f"step_{step:06d}"
    if step > 0 and not (d / "complete").is_file():
        log.warning("preemption signal (%s): writing the checkpoint of step %d before exiting", signame, step)
        t0 = time.perf_counter()
        _save(actor, root, step, broker, ident)
        log.warning("checkpoint of step %d written in %.1f s", step, time.perf_counter() - t0)
    dist.barrier()
    raise Preempted(step, str(d) if step > 0 else None, signame)


def _log_step(
    cfg, parts: _LeaderParts, periodic, summary: dict, m: dict, step: int, t_step: float, version: int
) -> None:
    m["time/step"] = time.perf_counter() - t_step
    m.update(parts.scraper.latest())
    m.update(broker_accounting(parts.broker.status()))
    m["actor/weight_version"] = float(version)
    m["rollout/engine_restarts"] = float(parts.recovery.total_restarts())
    parts.writer.log(parts.hooks.step(step, parts.last_groups, m), step)
    for eval_step, em in periodic.late_points(step):  # external/fleet evals: each at its own step
        parts.writer.log(parts.hooks.eval(eval_step, em), eval_step)
    summary["steps"].append(
        {
            k: m.get(k)
            for k in (
                "reward/mean",
                "rollout/data_staleness/mean",
                "rollout/data_staleness/max",
                "time/step",
                "time/training",
                "time/wait_data",
                "time/rollout",
                "time/sync_weights",
            )
        }
    )
    summary["staleness_max"] = max(summary["staleness_max"], m.get("rollout/data_staleness/max", 0.0))
    summary["drops"] += (
        m.get("rollout/fully_async/stale_groups_filtered", 0.0)
        + m.get("rollout/fully_async/aborted_groups_filtered", 0.0)
        + m["rollout/sample_filter/removed_groups"]
    )


def _finish(ctx, parts: _LeaderParts, periodic, summary: dict, evaluator, engine_urls: list[str], broker_child) -> None:
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
    if broker_child is not None:
        broker_child.stopping = True  # its exit from here on is asked for (see fail_fast_on_exit)
    parts.broker.shutdown()
    parts.broker.close()
    parts.writer.close()
    parts.group.destroy()


def _make_evaluation(
    cfg,
    actor,
    is_leader: bool,
    broker,
    engine_urls: list[str],
    ckpt_root: Path,
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
        ckpt_root=ckpt_root,
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


def make_recovery(cfg, group, discovery):
    """Actor rank 0's view of engine restarts through the discovery keys the rollout ranks publish."""
    r, n = cfg.rollout, len(group.engines)
    if discovery is None:
        read, publish = (lambda i: 0), (lambda i, k: None)
    else:
        read = lambda i: read_count(discovery, restarts_key(i))  # noqa: E731
        publish = lambda i, k: discovery.publish(synced_key(i), str(k))  # noqa: E731
    # long enough for the rollout rank to call a hang, restart the engine and see it answer
    wait_s = r.unhealthy_after_s + r.health_check_interval_s + r.health_check_timeout_s + r.start_timeout_s
    return EngineRecovery(
        group, read_restarts=read, publish_synced=publish, wait_s=wait_s, max_failures=2 * r.max_restarts * n + 1
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
            lambda: parts.next_batch(cfg, step, actor.version, t0, preempt),
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


def _resume_plan(cfg, run_dir: Path, ckpt_root: Path) -> tuple[dict, str | None, int | None]:
    """Actor rank 0: this run's identity, the checkpoint to resume from (``asyncrl.runner.resume``) and the
    first step whose old metrics are purged (None when not resuming)."""
    from asyncrl.actor.checkpoint import read_meta
    from asyncrl.runner.resume import establish_identity, pick_checkpoint

    ident = establish_identity(cfg, run_dir)
    ckpt = pick_checkpoint(cfg, ckpt_root, ident)
    if not (cfg.runner.resume or cfg.runner.resume_from):
        return ident, None, None
    start = int(read_meta(ckpt)["step"]) if ckpt is not None else 0
    return ident, (str(ckpt) if ckpt is not None else None), start + 1


def _save(actor, root: Path, step: int, broker, ident: dict) -> None:
    from asyncrl.runner.resume import write_identity

    d = root / f"step_{step:06d}"
    actor.save_checkpoint(d, step=step)
    if broker is not None:
        (d / "broker_state.bin").write_bytes(broker.get_state())
        write_identity(d, ident)
        (d / "complete").write_text("ok\n")


def print_summary(cfg, summary: dict, run_dir: Path) -> None:
    steps = summary["steps"]
    rewards = [s["reward/mean"] for s in steps if s.get("reward/mean") is not None]
    first = statistics.mean(rewards[:5]) if rewards else float("nan")
    last = statistics.mean(rewards[-5:]) if rewards else float("nan")

    def avg(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return statistics.mean(vals) if vals else 0.0

    out = {
        "mode": "async" if cfg.runner.async_mode else "sync",
        "steps": len(steps),
        "reward_first5": first,
        "reward_last5": last,
        "reward_gain": last - first,
        "test_accuracy_before": summary.get("eval_before", {}).get("accuracy"),
        "test_accuracy_after": summary.get("eval_after", {}).get("accuracy"),
        "staleness_mean": avg("rollout/data_staleness/mean"),
        "staleness_max": summary["staleness_max"],
        "dropped_groups": summary["drops"],
        "time/step": avg("time/step"),
        "time/training": avg("time/training"),
        "time/wait_data": avg("time/wait_data"),
        "time/rollout": avg("time/rollout"),
        "time/sync_weights": avg("time/sync_weights"),
        "wall_s": summary.get("wall_s"),
        "prepare_s": summary.get("prepare_s"),
    }
    (run_dir / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "",
        "=" * 72,
        f"asyncrl summary ({out['mode']}, {out['steps']} steps, run dir {run_dir})",
        f"  reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (gain {last - first:+.3f})",
        f"  held-out accuracy: before {out['test_accuracy_before']} -> after {out['test_accuracy_after']}",
        f"  staleness: mean {out['staleness_mean']:.2f}, max {out['staleness_max']:.0f}; "
        f"dropped groups {out['dropped_groups']:.0f}",
        f"  time/step {out['time/step']:.2f}s = training {out['time/training']:.2f}s + wait_data "
        f"{out['time/wait_data']:.2f}s + rollout {out['time/rollout']:.2f}s + sync_weights "
        f"{out['time/sync_weights']:.2f}s",
    ]
    if out["wall_s"] is not None:
        lines.append(
            f"  wall time {out['wall_s']:.0f}s (of which preparing the embedded default {out['prepare_s'] or 0.0:.0f}s)"
        )
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)
