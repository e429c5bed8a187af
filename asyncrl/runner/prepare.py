"""Preparation of the embedded default, made on first use and cached under ``prepare.dir``.

    dir/data/{corpus,train,test}.jsonl (+ .parquet, tokenizer_text.txt)   synthetic search-QA (``searchr1``), or
                                                                          the config's environment's own data
                                                                          (``asyncrl.embedded.DATA_MODULES``:
                                                                          ``arith``: train/test word problems)
    dir/model/                                                            tiny Qwen2 (or Qwen3-MoE:
                                                                          ``prepare.arch``), random weights,
                                                                          tokenizer trained on the data
    dir/model_sft/                                                        supervised warm start on
                                                                          synthetic demonstrations

Runs on global rank 0 before any role starts, only when ``prepare.enabled``. Each stage is
skipped when its output exists (a ``.done`` marker is written last, so an interrupted stage is
redone). The marker records the stage's recipe (``recipes``: the ``prepare`` and agent-loop settings its
output depends on). A cached stage made by another recipe, or by an asyncrl that did not record it, is made
again, with a warning that names the settings that differ: a changed ``prepare`` key takes effect, it is never
accepted and ignored. A stage's recipe includes the ones before it, so the stages after a remade one are remade
too. ``upto`` stops after a stage (``tools/warm_start_curve.py`` needs the data and the random model only). The
stages themselves live below the runner: the data generators (``asyncrl.embedded.DATA_MODULES`` by
``agentloop.task_name``: ``synth`` for ``searchr1`` and any environment without data of its own, ``arith`` for
``arith``; the data recipe records ``env`` when it is not ``searchr1``), the tiny checkpoint
``asyncrl.models.tiny`` and the warm start ``asyncrl.embedded.warm_start`` (which teaches the tool format from
demonstrations of which only ``prepare.sft_correct_fraction`` call the tool and copy the right answer, so RL has
room to improve).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional

from asyncrl.embedded import DEFAULT_ENV, data_env, data_module
from asyncrl.embedded.warm_start import warm_start
from asyncrl.models.tiny import make_tiny_checkpoint

log = logging.getLogger("asyncrl.prepare")


def recipes(cfg) -> dict[str, dict]:
    """What each stage's output depends on, by stage directory name (a stage's recipe includes the ones before it):
    recorded in its ``.done`` marker, compared on later runs (``prepare_if_needed``)."""
    p, a = cfg.prepare, cfg.agentloop
    data = {"seed": p.seed, "num_entities": p.num_entities}
    env = data_env(a.task_name)
    if env != DEFAULT_ENV:  # recorded only when not Search-R1's data: its cached stages stay valid
        data["env"] = env
    model = data | {"vocab_size": p.vocab_size, "hidden_size": p.hidden_size, "num_layers": p.num_layers}
    if p.arch != "qwen2":  # recorded only when not the default: the dense default's cached stages stay valid
        model["arch"] = p.arch
    sft_keys = "steps lr batch_size correct_fraction wrong_copy_fraction weight_decay context_loss_weight matmul_dtype"
    sft = model | {f"sft_{k}": getattr(p, f"sft_{k}") for k in sft_keys.split()}
    sft |= {
        "agentloop.tool.topk": a.tool.topk,
        "agentloop.tool.max_obs_tokens": a.tool.max_obs_tokens,
        "agentloop.max_total_tokens": a.max_total_tokens,
    }
    return {"data": data, "model": model, "model_sft": sft}


def _done(path: Path) -> bool:
    return (path / ".done").is_file()


def _mark(path: Path, recipe: dict) -> None:
    (path / ".done").write_text(json.dumps({"made": time.strftime("%Y-%m-%d %H:%M:%S"), "recipe": recipe}) + "\n")


def recipe_drift(path: Path, recipe: dict) -> Optional[str]:
    """None when the stage in ``path`` was made by ``recipe``; else what differs, in words."""
    try:
        made = json.loads((path / ".done").read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        made = None
    if not isinstance(made, dict):
        return "an earlier asyncrl made it and did not record its recipe"
    diff = [f"{k} {made.get(k)!r} -> {v!r}" for k, v in recipe.items() if made.get(k) != v]
    return f"it was made with another recipe ({', '.join(diff)})" if diff else None


def _drop_if_drifted(path: Path, recipe: dict) -> None:
    """Delete the cached stage in ``path`` when another recipe made it (it is made again), saying what differs."""
    drift = recipe_drift(path, recipe)
    if drift is not None:
        log.warning("prepare: %s is made again with this config: %s", path, drift)
        shutil.rmtree(path)


def prepare_if_needed(cfg, *, upto: str = "model_sft") -> dict[str, Path]:
    p = cfg.prepare
    if not p.enabled:
        return {}
    root = Path(p.dir)
    data, base, sft = root / "data", root / "model", root / "model_sft"
    made = recipes(cfg)
    if upto not in made:
        raise ValueError(f"prepare: no stage {upto!r} (one of {', '.join(made)})")
    stages = [data, base, sft][: list(made).index(upto) + 1]
    for stage in stages:
        if _done(stage):
            _drop_if_drifted(stage, made[stage.name])
    if not _done(data):
        t0 = time.time()
        data_module(cfg.agentloop.task_name).prepare_data(cfg, data)
        _mark(data, made["data"])
        log.info("prepare: synthetic %s data in %s (%.1fs)", data_env(cfg.agentloop.task_name), data, time.time() - t0)
    if base in stages and not _done(base):
        t0 = time.time()
        moe = {"moe_intermediate_size": p.hidden_size // 2} if p.arch == "qwen3_moe" else {}
        make_tiny_checkpoint(
            base,
            arch=p.arch,
            corpus_path=data / "tokenizer_text.txt",
            seed=p.seed,
            vocab_size=p.vocab_size,
            hidden_size=p.hidden_size,
            num_hidden_layers=p.num_layers,
            intermediate_size=p.hidden_size * 11 // 4,
            **moe,
        )
        _mark(base, made["model"])
        log.info("prepare: tiny %s checkpoint in %s (%.1fs)", p.arch, base, time.time() - t0)
    if sft in stages and not _done(sft):
        t0 = time.time()
        stats = warm_start(cfg, data_dir=data, base_dir=base, out_dir=sft)
        _mark(sft, made["model_sft"])
        log.info("prepare: warm start in %s (%.1fs): %s", sft, time.time() - t0, stats)
    return {s.name: s for s in stages}
