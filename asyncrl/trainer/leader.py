"""What actor rank 0 alone holds, built in one place: the broker client, the metrics writer, the weight-sync group
and its syncer, the engine recovery, the engine scraper, the sample filter and Miles' log hooks.

Contract
- ``LeaderParts(cfg, run_dir, broker_address, engine_urls, discovery, purge_step=)`` joins the engines' weight-update
  group (``WeightSyncGroup.init``) and starts the scraper's thread; the step loop (``asyncrl.trainer.step_loop``) waits
  for its batches and logs through it; ``last_groups`` is the batch the log hooks see with the step's record.
- ``make_recovery``: actor rank 0's view of engine restarts through the discovery keys the rollout ranks publish.
- ``make_batch_filter``: Miles' sample filter on the assembled batch.

    parts = LeaderParts(cfg, run_dir, broker_address, engine_urls, discovery, purge_step=None)
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.broker.client import BrokerClient
from asyncrl.cluster.discovery import read_count, restarts_key, synced_key
from asyncrl.config.validate import resolve_hook as import_path
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.recovery import EngineRecovery
from asyncrl.sync.weight_sync import SyncHooks, WeightSyncer
from asyncrl.trainer.engine_scraper import EngineScraper
from asyncrl.trainer.log_hooks import LogHooks
from asyncrl.trainer.writers import MetricsWriter


class LeaderParts:
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

    def report_engine_figures(self) -> None:
        """The engines' figures (summed over engines, averaged over the scrapes since the last report) to the
        broker's in-flight autotuner."""
        figures = self.scraper.autotune_figures()
        if figures is None:
            return
        self.broker.engine_figures(**figures)


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
