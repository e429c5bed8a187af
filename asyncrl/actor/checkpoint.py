"""The actor's checkpoint format, and HF <-> actor conversion without torch.distributed.

A checkpoint is a directory::

    meta.json               format, step, weight version, tp/pp/dp, padded vocab, skipped steps
    hf/                     the HF side files: config.json, tokenizer*, generation_config.json
    model_tp{R:02d}.safetensors   TP rank R's shard, canonical Megatron names (local layer spec)
    optim_tp{R:02d}.pt      Megatron optimizer state of TP rank R (absent in converted checkpoints)
                            At PP > 1 both are per stage S: model_tp{R:02d}_pp{S:02d}.safetensors,
                            optim_tp{R:02d}_pp{S:02d}.pt; layer names are global (HF layer index),
                            and with tied embeddings the last stage's file also holds its copy as
                            output_layer.weight (dropped when converting to HF).
    optim_rank{G:03d}.pt    with actor.use_distributed_optimizer: global rank G's shard of the
                            optimizer state (torch state + main params); resume needs the same DP
    sched.json              OptimizerParamScheduler state
    rng_rank{G:03d}.pt      RNG states of global actor rank G (CPU, CUDA, Megatron tracker, python)
    hf_export/              optional full HF export (runner.save_hf)

Model/optimizer files are written by the DP-rank-0 replica (DP replicas are identical with the
non-distributed optimizer); every rank writes its RNG file. A checkpoint converted from HF
(``hf_to_actor_checkpoint``) has only meta, hf/ and model files: loading it starts a fresh
optimizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from asyncrl.actor.convert import hf_state_to_megatron, megatron_state_to_hf, tp_merge, tp_shard
from asyncrl.actor.model import actor_spec, padded_vocab_size
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors

FORMAT = "asyncrl-actor-v1"
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def _stage(pp_rank: int, pp: int) -> str:
    return "" if pp == 1 else f"_pp{pp_rank:02d}"


def model_file(tp_rank: int, pp_rank: int = 0, pp: int = 1) -> str:
    return f"model_tp{tp_rank:02d}{_stage(pp_rank, pp)}.safetensors"


def optim_file(tp_rank: int, pp_rank: int = 0, pp: int = 1) -> str:
    return f"optim_tp{tp_rank:02d}{_stage(pp_rank, pp)}.pt"


def read_model_tensors(ckpt: Path, tp_rank: int, pp: int, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of TP rank ``tp_rank``, from the stage files of a checkpoint saved at PP=``pp``."""
    reader = SafetensorsReader([Path(ckpt) / model_file(tp_rank, s, pp) for s in range(pp)])
    return {k: reader.get(k) for k in names if k in reader}


def optim_shard_file(rank: int) -> str:
    return f"optim_rank{rank:03d}.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:03d}.pt"


def copy_hf_side_files(src: str | Path, dst: str | Path) -> None:
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def write_meta(ckpt: Path, meta: dict[str, Any]) -> None:
    tmp = ckpt / "meta.json.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, **meta}, indent=2) + "\n")
    tmp.replace(ckpt / "meta.json")


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    p = Path(ckpt) / "meta.json"
    if not p.is_file():
        raise ValueError(f"{str(ckpt)!r} is not an actor checkpoint (no meta.json)")
    meta = json.loads(p.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(p)!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def hf_to_actor_checkpoint(hf_dir: str | Path, out: str | Path, *, tp: int = 1) -> Path:
    """Convert a HF checkpoint into an actor checkpoint for ``tp`` TP ranks (model only)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = actor_spec(hf_dir)
    full = hf_state_to_megatron(SafetensorsReader(hf_dir).to_dict(), spec, tp=tp)
    for r in range(tp):
        save_safetensors({k: tp_shard(k, v, rank=r, tp=tp) for k, v in full.items()}, out / model_file(r))
    copy_hf_side_files(hf_dir, out / "hf")
    write_meta(
        out,
        {
            "step": 0,
            "weight_version": 0,
            "tp": tp,
            "pp": 1,
            "dp": None,
            "padded_vocab_size": padded_vocab_size(spec.vocab_size, tp),
            "num_skipped_steps": 0,
            "has_optimizer": False,
        },
    )
    return out


def load_full_megatron(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Merge all TP shards of a checkpoint into full Megatron tensors."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    pp = int(meta.get("pp", 1))
    tied = actor_spec(ckpt / "hf").tie_word_embeddings if pp > 1 else False
    full: dict[str, torch.Tensor] = {}
    for s in range(pp):
        shards = [SafetensorsReader(ckpt / model_file(r, s, pp)).to_dict() for r in range(int(meta["tp"]))]
        for k in shards[0]:
            if tied and k == "output_layer.weight":  # the last stage's copy of the tied embeddings
                continue
            full[k] = tp_merge(k, [sh[k] for sh in shards])
    return full, meta


def actor_checkpoint_to_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write a HF checkpoint (model.safetensors + side files) from an actor checkpoint."""
    ckpt, out = Path(ckpt), Path(out)
    full, _ = load_full_megatron(ckpt)
    spec = actor_spec(ckpt / "hf")
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(dict(megatron_state_to_hf(full, spec)), out / "model.safetensors")
    copy_hf_side_files(ckpt / "hf", out)
    return out
