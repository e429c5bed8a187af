"""Preparation of the embedded default, made on first use and cached under ``prepare.dir``.

    dir/data/{corpus,train,test}.jsonl (+ .parquet, tokenizer_text.txt)   synthetic search-QA
    dir/model/                                                            tiny Qwen2, random weights,
                                                                          tokenizer trained on the data
    dir/model_sft/                                                        supervised warm start on
                                                                          synthetic demonstrations

Runs on global rank 0 before any role starts, only when ``prepare.enabled``. Each stage is
skipped when its output exists (a ``.done`` marker is written last, so an interrupted stage is
redone). The stages themselves live below the runner: the data generator ``asyncrl.embedded.synth``,
the tiny checkpoint ``asyncrl.models.tiny`` and the warm start ``asyncrl.embedded.warm_start`` (which
teaches the tool format from demonstrations of which only ``prepare.sft_correct_fraction`` search and
copy the right answer, so RL has room to improve).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from asyncrl.embedded.synth import write_dataset
from asyncrl.embedded.warm_start import warm_start
from asyncrl.models.tiny import make_tiny_checkpoint

log = logging.getLogger("asyncrl.prepare")


def _done(path: Path) -> bool:
    return (path / ".done").is_file()


def _mark(path: Path) -> None:
    (path / ".done").write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))


def prepare_if_needed(cfg) -> dict[str, Path]:
    p = cfg.prepare
    if not p.enabled:
        return {}
    root = Path(p.dir)
    data, base, sft = root / "data", root / "model", root / "model_sft"
    if not _done(data):
        t0 = time.time()
        write_dataset(data, seed=p.seed, num_countries=p.num_entities)
        _mark(data)
        log.info("prepare: synthetic data in %s (%.1fs)", data, time.time() - t0)
    if not _done(base):
        t0 = time.time()
        make_tiny_checkpoint(
            base,
            arch="qwen2",
            corpus_path=data / "tokenizer_text.txt",
            seed=p.seed,
            vocab_size=p.vocab_size,
            hidden_size=p.hidden_size,
            num_hidden_layers=p.num_layers,
            intermediate_size=p.hidden_size * 11 // 4,
        )
        _mark(base)
        log.info("prepare: tiny Qwen2 checkpoint in %s (%.1fs)", base, time.time() - t0)
    if not _done(sft):
        t0 = time.time()
        stats = warm_start(cfg, data_dir=data, base_dir=base, out_dir=sft)
        _mark(sft)
        log.info("prepare: warm start in %s (%.1fs): %s", sft, time.time() - t0, stats)
    return {"data": data, "model": base, "model_sft": sft}
