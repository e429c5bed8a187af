"""The dedicated eval fleet (``eval.eval_num_gpus = N``): Miles' "Mode 2", engines of their own, synced
from HF snapshots, so training never pauses for an eval.

Contract
- Size: ``eval.eval_num_gpus / eval.eval_num_gpus_per_engine`` engines (must divide); the devices are
  the ``eval`` key of ``cluster.component_placement`` (as many as ``eval.eval_num_gpus``).
- Engine settings (``asyncrl.config.eval_engine``, pure): inherited from the rollout engines (``rollout.*``
  and ``rollout.sglang.*``, ``extra_args`` parsed as ``--flag value`` / ``--flag``), TP =
  ``eval.eval_num_gpus_per_engine``; when it differs from ``rollout.tensor_parallel_size``,
  ``dp_size``, ``pp_size``, ``ep_size`` and ``attn_cp_size`` are 1 instead of inherited (SGLang ties
  them to TP). ``eval.eval_sglang = { field = "value" }`` overrides single fields (``"false"`` turns an
  inherited boolean flag off; ``no_<flag> = "true"`` too); ``tp_size`` cannot be overridden there.
- Launch (``asyncrl.runner.roles.run_eval_engine``, the role of the ``eval`` ranks): the first rank of each fleet engine
  starts it as its child (SGLang server or CPU engine, log ``logs/eval_engine<i>.log``) exactly as a rollout
  engine is started (``EngineSupervisor.from_config``: torchrun's variables removed, its own devices), publishes
  ``eval_engine/<i>/url`` in the discovery store, restarts it if it crashes (``rollout.max_restarts``)
  and stops it at ``shutdown``; the engine's other ranks idle. Actor rank 0 looks the URLs up.
- Per eval point (``FleetEval``, called by ``EvalDispatcher`` on its background thread): every fleet
  engine loads the snapshot with ``/update_weights_from_disk`` (weight version = the snapshot's step;
  checked on every engine afterwards; bounded by ``eval.eval_reload_timeout_s``, a failure names the engine
  index, its URL, the step and the version), then the eval datasets are evaluated greedily against the fleet
  with the shared-engine evaluator (prompts round-robin over the engines). Metrics:
  ``eval/<name>/accuracy`` etc., ``eval/fleet/load_time_seconds``, ``eval/fleet/weight_version``,
  ``eval/fleet/probe_logprob`` (the fleet's log-prob of ``PROBE_IDS``: identifies its weights). The
  snapshot path must be readable on the engines' hosts (one node, or a shared file system).

    n = fleet_size(cfg.eval)                      # engines
    ecfg = eval_engine_config(cfg)                # the Config an eval engine is launched from (config.eval_engine)
    fn = FleetEval(cfg, urls, tokenizer_path=...); fn(snapshot_dir, step) -> metrics
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from asyncrl.config.eval_engine import fleet_size
from asyncrl.config.schema import Config
from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.eval.backends import SNAPSHOT_META, EngineEvaluator, engine_eval_metrics, eval_datasets

log = logging.getLogger("asyncrl.eval.fleet")

URL_KEY = "eval_engine/{}/url"
PROBE_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
"""After a load every fleet engine scores this prompt; the sum of its log-probs (``eval/fleet/probe_logprob``)
identifies the weights it carries (the engines must agree)."""


# ------------------------------------------------------------------------------------------- the eval job
class FleetEval:
    """``(snapshot_dir, step) -> metrics``: load the snapshot into every fleet engine, then evaluate."""

    def __init__(self, cfg: Config, urls: list[str], *, tokenizer_path: str):
        if not urls:
            raise ValueError("eval.eval_num_gpus: the dedicated fleet has no engine URLs")
        self.cfg, self.urls = cfg, list(urls)
        self.datasets = eval_datasets(cfg)
        self.evaluator = EngineEvaluator(cfg, self.urls, tokenizer_path=tokenizer_path)

    def load(self, snapshot_dir: str, version: str) -> float:
        """``/update_weights_from_disk`` on every engine at once; each must then report ``version`` and the
        same probe log-prob (returned)."""
        r = self.cfg.rollout
        reload_s = self.cfg.eval.eval_reload_timeout_s

        async def one(i: int, url: str) -> float:
            async with SGLangClient.from_config(url, r) as c:
                try:
                    await c.update_weights_from_disk(snapshot_dir, weight_version=version, timeout_s=reload_s)
                except EngineError as e:
                    raise RuntimeError(
                        f"eval fleet engine {i} ({url}): step update_weights_from_disk of "
                        f"{snapshot_dir} (version {version}, eval.eval_reload_timeout_s={reload_s:g}) "
                        f"failed: {e}"
                    ) from e
                got = await c.weight_version()
                if got != version:
                    raise RuntimeError(
                        f"eval fleet engine {i} ({url}): weight version {got!r} after loading "
                        f"{snapshot_dir}, expected {version!r}"
                    )
                res = await c.generate(PROBE_IDS, {"max_new_tokens": 1, "temperature": 0.0}, logprob_start_len=0)
                return sum(float(x[0]) for x in res.meta_info["input_token_logprobs"] if x[0] is not None)

        async def all_() -> list[float]:
            return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(self.urls))))

        probes = asyncio.run(all_())
        if max(probes) - min(probes) > 1e-3 * (1 + abs(probes[0])):
            raise RuntimeError(
                f"eval fleet engines {self.urls} disagree after loading {snapshot_dir}: probe log-probs {probes}"
            )
        return probes[0]

    def __call__(self, snapshot_dir: str, step: int) -> dict[str, float]:
        meta = Path(snapshot_dir) / SNAPSHOT_META
        version = json.loads(meta.read_text())["weight_version"] if meta.is_file() else step
        t0 = time.perf_counter()
        probe = self.load(snapshot_dir, str(version))
        m = {
            "eval/fleet/load_time_seconds": time.perf_counter() - t0,
            "eval/fleet/weight_version": float(version),
            "eval/fleet/probe_logprob": probe,
        }
        m.update(engine_eval_metrics(self.evaluator.evaluate(self.datasets)))
        return m


# ------------------------------------------------------------------------------------------- the eval ranks
def lookup_fleet_urls(cfg: Config, disc: Any) -> list[str]:
    """Actor rank 0: the fleet engines' URLs, in engine order."""
    return [
        disc.lookup(URL_KEY.format(i), timeout_s=cfg.rollout.start_timeout_s + 60) for i in range(fleet_size(cfg.eval))
    ]
