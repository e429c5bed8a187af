"""The dedicated eval fleet (``eval.eval_num_gpus = N``): Miles' "Mode 2", engines of their own, synced
from HF snapshots, so training never pauses for an eval.

Contract
- Size: ``eval.eval_num_gpus / eval.eval_num_gpus_per_engine`` engines (must divide); the devices are
  the ``eval`` key of ``cluster.component_placement`` (as many as ``eval.eval_num_gpus``).
- Engine settings (``eval_engine_settings``, pure): inherited from the rollout engines (``rollout.*``
  and ``rollout.sglang.*``, ``extra_args`` parsed as ``--flag value`` / ``--flag``), TP =
  ``eval.eval_num_gpus_per_engine``; when it differs from ``rollout.tensor_parallel_size``,
  ``dp_size``, ``pp_size``, ``ep_size`` and ``attn_cp_size`` are 1 instead of inherited (SGLang ties
  them to TP). ``eval.eval_sglang = { field = "value" }`` overrides single fields (``"false"`` turns an
  inherited boolean flag off; ``no_<flag> = "true"`` too); ``tp_size`` cannot be overridden there.
- Launch (``run_eval_engine``, the role of the ``eval`` ranks): the first rank of each fleet engine
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
    ecfg = eval_engine_config(cfg)                # the Config an eval engine is launched from
    fn = FleetEval(cfg, urls, tokenizer_path=...); fn(snapshot_dir, step) -> metrics
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Union

from asyncrl.config.schema import Config, ConfigError

log = logging.getLogger("asyncrl.eval.fleet")

TP_TIED = ("dp_size", "pp_size", "ep_size", "attn_cp_size")
"""SGLang settings tied to TP: 1 (not inherited) when the fleet's TP differs from the rollout's."""
URL_KEY = "eval_engine/{}/url"
PROBE_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
"""After a load every fleet engine scores this prompt; the sum of its log-probs (``eval/fleet/probe_logprob``)
identifies the weights it carries (the engines must agree)."""

Value = Union[str, bool]


# ------------------------------------------------------------------------------------------- pure parts
def fleet_size(e: Any) -> int:
    """Engines of the fleet (``EvalConfig``); 0 without one."""
    if not e.eval_num_gpus:
        return 0
    if e.eval_num_gpus % e.eval_num_gpus_per_engine:
        raise ConfigError(
            f"eval.eval_num_gpus_per_engine: {e.eval_num_gpus_per_engine} does not divide eval.eval_num_gpus = "
            f"{e.eval_num_gpus}; each fleet engine takes eval_num_gpus_per_engine devices")
    return e.eval_num_gpus // e.eval_num_gpus_per_engine


def _key(k: str) -> str:
    return k.strip().lstrip("-").replace("-", "_").removeprefix("sglang_")


def parse_flags(args: list[str]) -> dict[str, Value]:
    """``["--foo-bar", "3", "--baz"]`` -> ``{"foo_bar": "3", "baz": True}`` (``--no-x`` -> ``x: False``)."""
    out: dict[str, Value] = {}
    i = 0
    while i < len(args):
        a = str(args[i])
        if not a.startswith("--"):
            raise ConfigError(f"rollout.sglang.extra_args: expected a --flag at {a!r} (in {args!r})")
        if "=" in a:
            k, v = a.split("=", 1)
            out[_key(k)] = v
            i += 1
            continue
        if i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
            out[_key(a)] = str(args[i + 1])
            i += 2
            continue
        k = _key(a)
        if k.startswith("no_"):
            out[k[3:]] = False
        else:
            out[k] = True
        i += 1
    return out


def render_flags(settings: dict[str, Value]) -> list[str]:
    """The inverse of ``parse_flags`` (False flags are left out)."""
    out: list[str] = []
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return out


def _override_value(v: Any) -> Value:
    if isinstance(v, bool):
        return v
    s = str(v)
    return {"true": True, "false": False}.get(s.lower(), s)


def resolve_eval_sglang(inherited: dict[str, Value], *, rollout_tp: int, eval_tp: int,
                        overrides: dict[str, Any]) -> dict[str, Value]:
    """The fleet's engine settings: ``inherited`` (the rollout engines', without ``tp_size``), the TP-tied
    fields reset to 1 when ``eval_tp != rollout_tp``, then ``overrides`` (``eval.eval_sglang``) field by
    field; ``tp_size`` = ``eval_tp``."""
    out = {_key(k): v for k, v in inherited.items()}
    out.pop("tp_size", None)
    if eval_tp != rollout_tp:
        for k in TP_TIED:
            if k in out:
                out[k] = "1"
    for k, v in overrides.items():
        kk = _key(k)
        if kk in ("tp_size", "tensor_parallel_size"):
            raise ConfigError(f"eval.eval_sglang.{k}: the fleet's TP is eval.eval_num_gpus_per_engine "
                              f"(it also places the engines); set that instead")
        val = _override_value(v)
        if kk.startswith("no_") and val is True:
            kk, val = kk[3:], False
        out[kk] = val
    out["tp_size"] = str(eval_tp)
    return out


def rollout_engine_settings(cfg: Config) -> dict[str, Value]:
    """The rollout engines' settings as SGLang fields (what the fleet inherits)."""
    r = cfg.rollout
    return {"mem_fraction_static": str(r.sglang.mem_fraction_static),
            "max_running_requests": str(r.max_running_requests), **parse_flags(list(r.sglang.extra_args))}


def eval_engine_settings(cfg: Config) -> dict[str, Value]:
    return resolve_eval_sglang(rollout_engine_settings(cfg), rollout_tp=cfg.rollout.tensor_parallel_size,
                               eval_tp=cfg.eval.eval_num_gpus_per_engine, overrides=dict(cfg.eval.eval_sglang))


def eval_engine_config(cfg: Config) -> Config:
    """``cfg`` with ``rollout`` replaced by the fleet engines' settings (what the command builders read)."""
    s = dict(eval_engine_settings(cfg))
    tp = int(s.pop("tp_size"))
    try:
        mem = float(s.pop("mem_fraction_static"))
        mrr = int(s.pop("max_running_requests"))
    except ValueError as e:
        raise ConfigError(f"eval.eval_sglang: {e}") from None
    r = cfg.rollout
    sg = dataclasses.replace(r.sglang, mem_fraction_static=mem, extra_args=render_flags(s))
    return dataclasses.replace(cfg, rollout=dataclasses.replace(r, tensor_parallel_size=tp, max_running_requests=mrr,
                                                                sglang=sg))


# ------------------------------------------------------------------------------------------- the eval job
class FleetEval:
    """``(snapshot_dir, step) -> metrics``: load the snapshot into every fleet engine, then evaluate."""

    def __init__(self, cfg: Config, urls: list[str], *, tokenizer_path: str):
        from asyncrl.runner.evaluation import EngineEvaluator, eval_datasets

        if not urls:
            raise ValueError("eval.eval_num_gpus: the dedicated fleet has no engine URLs")
        self.cfg, self.urls = cfg, list(urls)
        self.datasets = eval_datasets(cfg)
        self.evaluator = EngineEvaluator(cfg, self.urls, tokenizer_path=tokenizer_path)

    def load(self, snapshot_dir: str, version: str) -> float:
        """``/update_weights_from_disk`` on every engine at once; each must then report ``version`` and the
        same probe log-prob (returned)."""
        from asyncrl.rollout.sglang_client import EngineError, SGLangClient

        r = self.cfg.rollout
        reload_s = self.cfg.eval.eval_reload_timeout_s

        async def one(i: int, url: str) -> float:
            async with SGLangClient.from_config(url, r) as c:
                try:
                    await c.update_weights_from_disk(snapshot_dir, weight_version=version, timeout_s=reload_s)
                except EngineError as e:
                    raise RuntimeError(f"eval fleet engine {i} ({url}): step update_weights_from_disk of "
                                       f"{snapshot_dir} (version {version}, eval.eval_reload_timeout_s={reload_s:g}) "
                                       f"failed: {e}") from e
                got = await c.weight_version()
                if got != version:
                    raise RuntimeError(f"eval fleet engine {i} ({url}): weight version {got!r} after loading "
                                       f"{snapshot_dir}, expected {version!r}")
                res = await c.generate(PROBE_IDS, {"max_new_tokens": 1, "temperature": 0.0}, logprob_start_len=0)
                return sum(float(x[0]) for x in res.meta_info["input_token_logprobs"] if x[0] is not None)

        async def all_() -> list[float]:
            return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(self.urls))))

        probes = asyncio.run(all_())
        if max(probes) - min(probes) > 1e-3 * (1 + abs(probes[0])):
            raise RuntimeError(f"eval fleet engines {self.urls} disagree after loading {snapshot_dir}: probe "
                               f"log-probs {probes}")
        return probes[0]

    def __call__(self, snapshot_dir: str, step: int) -> dict[str, float]:
        from asyncrl.runner.evaluation import SNAPSHOT_META, engine_eval_metrics

        meta = Path(snapshot_dir) / SNAPSHOT_META
        version = json.loads(meta.read_text())["weight_version"] if meta.is_file() else step
        t0 = time.perf_counter()
        probe = self.load(snapshot_dir, str(version))
        m = {"eval/fleet/load_time_seconds": time.perf_counter() - t0, "eval/fleet/weight_version": float(version),
             "eval/fleet/probe_logprob": probe}
        m.update(engine_eval_metrics(self.evaluator.evaluate(self.datasets)))
        return m


# ------------------------------------------------------------------------------------------- the eval ranks
def lookup_fleet_urls(cfg: Config, disc: Any) -> list[str]:
    """Actor rank 0: the fleet engines' URLs, in engine order."""
    return [disc.lookup(URL_KEY.format(i), timeout_s=cfg.rollout.start_timeout_s + 60) for i in range(fleet_size(cfg.eval))]


def run_eval_engine(ctx: Any, disc: Any) -> int:
    """The role of an ``eval`` rank: the first rank of each fleet engine runs it until ``shutdown``."""
    from asyncrl.rollout.sglang_launcher import EngineSupervisor, engine_port
    from asyncrl.runner.roles import SHUTDOWN_KEY, local_address, run_idle

    cfg = ctx.cfg
    engines = ctx.placement.eval_engines(cfg.eval.eval_num_gpus_per_engine)
    i = next(k for k, ranks in enumerate(engines) if ctx.rank in ranks)
    ranks = engines[i]
    if ctx.rank != ranks[0]:
        return run_idle(ctx, disc)
    ecfg = eval_engine_config(cfg)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.cluster.num_devices_per_node)
    host = local_address()
    port = engine_port(cfg, ctx.local_rank)  # local ranks are unique on a node: no clash with rollout engines
    bind = "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0"
    # the same launch path as a rollout engine: clean environment, CUDA_VISIBLE_DEVICES = its devices
    sup = EngineSupervisor.from_config(ecfg, engine_index=i, base_gpu_id=ranks[0] % per_node, run_dir=ctx.run_dir,
                                       host=bind, advertise_host=host, port=port, name=f"eval_engine{i}")
    sup.start()
    try:
        disc.publish(URL_KEY.format(i), sup.url)
        log.info("eval fleet engine %d at %s (ranks %s)", i, sup.url, list(ranks))
        while True:
            try:
                disc.lookup(SHUTDOWN_KEY, timeout_s=2.0)
                return 0
            except TimeoutError:
                sup.check()  # a crashed engine is restarted (it reloads the next snapshot anyway)
    finally:
        sup.stop()
