"""The actor's own state in a checkpoint directory: what ``Actor.save_checkpoint`` / ``load_checkpoint`` write and
read, in the layout of ``asyncrl.actor.checkpoint`` (which owns the names and the run's checkpoints).

Contract
- ``save_actor_state`` (collective): model/optimizer files are written by the first DP replica of each TP/EP/PP
  shard (expert-DP rank 0; DP replicas are identical with the non-distributed optimizer); every rank writes its
  RNG file; ``meta.json`` is written last of the actor's files.
- ``load_actor_state`` (collective): resuming the optimizer needs the TP, PP and EP it was saved at (and the DP with
  the distributed optimizer); the model loads at any PP and EP; a checkpoint converted from HF has only the model
  (a fresh optimizer). A file that cannot be read raises ``CheckpointError`` naming it.

    save_actor_state(actor, ckpt_dir, step=10)
    meta = load_actor_state(actor, ckpt_dir)
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.actor.checkpoint import (
    HF_DIR,
    HF_EXPORT,
    SCHED_FILE,
    copy_hf_side_files,
    model_file,
    optim_file,
    optim_shard_file,
    read_meta,
    read_model_tensors,
    reading,
    rng_file,
    write_meta,
)
from asyncrl.actor.names import is_expert
from asyncrl.actor.weights import is_tied_output_copy, local_params
from asyncrl.cluster.megatron_cpu import cuda_as_cpu
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors

# Lazy imports: megatron-core (the RNG tracker, the parallel state) is imported inside the functions; its import
# takes seconds and probes CUDA.

log = logging.getLogger(__name__)


def save_actor_state(actor: Any, directory: str | Path, *, step: int) -> Path:
    """Model, optimizer, scheduler, RNG, step and weight version of an ``asyncrl.actor.megatron_actor.Actor``
    (collective: every actor rank calls it; ``meta.json`` last)."""
    from megatron.core import parallel_state as ps

    d = Path(directory)
    if actor.rank == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dopt = actor.cfg.actor.use_distributed_optimizer
    if ps.get_expert_data_parallel_rank() == 0:  # the first DP replica of this TP/EP/PP shard
        ex = actor.experts
        params = local_params(actor.model, actor.layer_offset, ex.offset)
        shard = {name: p.detach() for name, p in params if ex.rank == 0 or is_expert(name)}
        where = (actor.tp_rank, actor.pp_rank, actor.pp, ex.rank, ex.ep)
        save_safetensors(shard, d / model_file(*where))
        if not dopt:
            _atomic_save(actor.optimizer.state_dict(), d / optim_file(*where))
    if dopt:  # each DP rank holds its own shard of the state
        _atomic_save(_optimizer_shard_state(actor.optimizer), d / optim_shard_file(actor.rank))
    torch.save(_rng_state(), d / rng_file(actor.rank))
    if actor.cfg.runner.save_hf:
        actor.export_hf(d / HF_EXPORT)
    if actor.rank == 0:
        (d / SCHED_FILE).write_text(json.dumps(actor.scheduler.state_dict()) + "\n")
        copy_hf_side_files(actor.model_path, d / HF_DIR)
        write_meta(
            d,
            {
                "step": int(step),
                "weight_version": actor.version,
                "tp": actor.tp,
                "pp": actor.pp,
                "ep": actor.ep,
                "dp": actor.dp,
                "padded_vocab_size": actor.padded_vocab,
                "num_skipped_steps": actor.num_skipped_steps,
                "has_optimizer": True,
                "distributed_optimizer": dopt,
                "model_path": str(actor.model_path),
            },
        )
    dist.barrier()
    return d


def load_actor_state(actor: Any, directory: str | Path) -> dict[str, Any]:
    """Restore what ``save_actor_state`` wrote (or the model of a converted checkpoint) into ``actor``; its meta
    (the caller takes the step, weight version and skipped steps from it). Collective."""
    d = Path(directory)
    meta = read_meta(d)
    if int(meta["tp"]) != actor.tp:
        raise ValueError(
            f"checkpoint {str(d)!r} has TP={meta['tp']} but actor.tensor_model_parallel_size={actor.tp}: "
            "convert it with `python -m asyncrl.actor.convert_cli actor-to-hf` and start from the HF export"
        )
    _load_model(actor, d, int(meta.get("pp", 1)), int(meta.get("ep", 1)))
    if meta.get("has_optimizer"):
        _check_optimizer_layout(actor, d, meta)
        _load_optimizer(actor, d, meta)
    dist.barrier()
    return meta


def _load_model(actor: Any, d: Path, pp_saved: int, ep_saved: int) -> None:
    params = local_params(actor.model, actor.layer_offset, actor.experts.offset)
    if actor.pp == 1 and pp_saved == 1 and actor.ep == 1 and ep_saved == 1:
        with reading(d / model_file(actor.tp_rank)):
            shard = SafetensorsReader(d / model_file(actor.tp_rank)).to_dict()
    else:  # this rank's tensors, from whichever stage / EP file holds them (any saved PP and EP)
        with reading(d / f"model_tp{actor.tp_rank:02d}_*.safetensors"):
            shard = read_model_tensors(d, actor.tp_rank, pp_saved, [n for n, _ in params], ep=ep_saved)
    with torch.no_grad():
        for name, p in params:
            if name not in shard and is_tied_output_copy(name, actor.spec):
                name = "embedding.word_embeddings.weight"  # a checkpoint saved at PP=1
            if name not in shard:
                raise KeyError(f"checkpoint {str(d)!r} lacks {name}")
            p.copy_(shard[name].to(p.dtype))


def _check_optimizer_layout(actor: Any, d: Path, meta: dict[str, Any]) -> None:
    """An optimizer state resumes only at the PP and EP it was saved at (and the DP, with the distributed
    optimizer)."""
    for size, key, have in (("pp", "pipeline", actor.pp), ("ep", "expert", actor.ep)):
        saved = int(meta.get(size, 1))
        if saved != have:
            raise ValueError(
                f"checkpoint {str(d)!r} has {size.upper()}={saved} but actor.{key}_model_parallel_size={have}: "
                "its optimizer state cannot be resumed; convert it with `python -m asyncrl.actor.convert_cli "
                "actor-to-hf` and start from the HF export"
            )
    dopt, want = bool(meta.get("distributed_optimizer", False)), actor.cfg.actor.use_distributed_optimizer
    if dopt != want or (dopt and meta.get("dp") != actor.dp):
        raise ValueError(
            f"checkpoint {str(d)!r} was saved with distributed_optimizer={dopt}, dp={meta.get('dp')}; "
            f"actor.use_distributed_optimizer={want}, dp={actor.dp} cannot resume its optimizer state"
        )


def _load_optimizer(actor: Any, d: Path, meta: dict[str, Any]) -> None:
    """Optimizer (or this rank's shard of it), scheduler and RNG."""
    if meta.get("distributed_optimizer", False):
        with reading(d / optim_shard_file(actor.rank)):
            shard = torch.load(d / optim_shard_file(actor.rank), map_location="cpu", weights_only=False)
        _load_optimizer_shard_state(actor.optimizer, shard)
    else:
        path = d / optim_file(actor.tp_rank, actor.pp_rank, actor.pp, actor.experts.rank, actor.ep)
        with reading(path):
            state = torch.load(path, map_location="cpu", weights_only=False)
        with cuda_as_cpu():
            actor.optimizer.load_state_dict(state)
    # Megatron's load_state_dict *adds* the saved step count to the current one
    actor.scheduler.num_steps = 0
    with reading(d / SCHED_FILE):
        actor.scheduler.load_state_dict(json.loads((d / SCHED_FILE).read_text()))
    rng = d / rng_file(actor.rank)
    if rng.is_file() and meta.get("dp") == actor.dp:
        with reading(rng):
            _set_rng_state(torch.load(rng, weights_only=False))
    else:
        log.warning("checkpoint %s: no RNG state for rank %d (or another DP size): RNG not restored", d, actor.rank)


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_shard_state(optimizer: Any) -> list[dict[str, Any]]:
    """This rank's torch optimizer state and main (fp32) params, per Megatron sub-optimizer."""
    return [
        {
            "inner": o.optimizer.state_dict(),
            "main": [p.detach().cpu().clone() for g in o.optimizer.param_groups for p in g["params"]],
        }
        for o in _sub_optimizers(optimizer)
    ]


@torch.no_grad()
def _load_optimizer_shard_state(optimizer: Any, states: list[dict[str, Any]]) -> None:
    subs = _sub_optimizers(optimizer)
    if len(states) != len(subs):
        raise ValueError(f"optimizer checkpoint has {len(states)} sub-optimizers, the actor {len(subs)}")
    for o, st in zip(subs, states):
        o.optimizer.load_state_dict(st["inner"])
        params = [p for g in o.optimizer.param_groups for p in g["params"]]
        for p, t in zip(params, st["main"], strict=True):
            p.copy_(t.to(p.device, p.dtype))


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
