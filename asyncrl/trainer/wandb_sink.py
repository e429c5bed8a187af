"""The optional Weights & Biases sink of ``MetricsWriter`` (``logging.wandb``; ``pip install asyncrl[wandb]``).

Contract
- ``WandbSink(settings, run_dir, config=, run_id=)`` starts one wandb run (actor rank 0, when the leader is built, so
  before the first step): project, entity, mode, group and tags from ``logging.wandb``; its name is
  ``logging.wandb.name`` or the run directory's name; its files go to ``<run_dir>/wandb/``; the resolved config is
  its config; its id is the run's id (``run.json``, ``asyncrl.trainer.resume``) with ``resume="allow"``, so a resumed
  run continues the same wandb run and a new run in the same directory starts a new one. ``wandb.init`` raising, or
  not done within ``init_timeout_s``, raises ``RuntimeError`` naming ``logging.wandb``: the run fails at its start.
- Steps: every record carries the run's step as the metric ``step``, and every other metric is plotted against it
  (``define_metric("*", step_metric="step")``); wandb's own ``_step`` only counts records. ``log(step=)`` would
  drop a record whose step is below the last one, and the run logs such records on purpose: an eval point that
  finished later, at its own step, and the held-out eval at the last step after that step's record. wandb cannot
  delete points: the steps a resumed run writes again after its checkpoint show twice there (metrics.jsonl and
  TensorBoard are purged).
- ``close()`` finishes the run (the uploads get ``finish_timeout_s``; what is left stays in the local files, for
  ``wandb sync``), then stops wandb's service process (``wandb.teardown``). ``run.finish()`` alone returns before
  that process has written the run's ``.wandb`` file out (seen with wandb 0.31: a file of its 7-byte header just
  after ``finish``); once ``close()`` returns, the local files are complete.

    sink = WandbSink(cfg.logging.wandb, run_dir, config=to_dict(cfg), run_id=ident["run_id"])
    sink.log({"reward/mean": 0.4}, step=3)
    sink.close()
"""

from __future__ import annotations

from pathlib import Path

STEP_KEY = "step"  # the x axis of every metric: the same name as metrics.jsonl's step field


class WandbSink:
    def __init__(self, settings, run_dir: Path, *, config: dict | None = None, run_id: str | None = None):
        s = settings
        try:
            import wandb  # optional: check_wandb reported a missing package before any process started

            self._run = wandb.init(
                project=s.project,
                entity=s.entity,
                mode=s.mode,
                name=s.name or Path(run_dir).resolve().name,
                group=s.group,
                tags=list(s.tags),
                dir=str(run_dir),
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(
                    init_timeout=s.init_timeout_s,
                    finish_timeout=s.finish_timeout_s,
                    console="off",  # the run's own logs are in <run_dir>/logs; stdout stays unwrapped
                ),
            )
            self._run.define_metric(STEP_KEY)
            self._run.define_metric("*", step_metric=STEP_KEY)
        except Exception as e:
            raise RuntimeError(
                f"logging.wandb: the wandb sink did not start (mode {s.mode!r}, project {s.project!r}): "
                f"{type(e).__name__}: {e}"
            ) from e

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log({**metrics, STEP_KEY: step})

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # joins wandb's service process, which writes the run's local files out on its way down
