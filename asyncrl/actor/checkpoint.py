"""The checkpoint layout, and the one object that knows it: ``CheckpointManager``.

The run's checkpoints live under one root (``actor.checkpoint_dir``, default ``<run dir>/checkpoints``)::

    step_{N:06d}/           the checkpoint of step N
      meta.json             format, step, weight version, tp/pp/ep/dp, padded vocab, skipped steps
      hf/                   the HF side files: config.json, tokenizer*, generation_config.json
      model_tp{R:02d}.safetensors   TP rank R's shard, canonical Megatron names (local layer spec)
      optim_tp{R:02d}.pt    Megatron optimizer state of TP rank R (absent in converted checkpoints)
                            At PP > 1 both are per stage S: model_tp{R:02d}_pp{S:02d}.safetensors,
                            optim_tp{R:02d}_pp{S:02d}.pt; layer names are global (HF layer index),
                            and with tied embeddings the last stage's file also holds its copy as
                            output_layer.weight (dropped when converting to HF).
                            At EP > 1 (MoE) both are per EP rank E too: model_tp{R:02d}_ep{E:02d}[_pp..]
                            holds EP rank E's experts (global expert indices), EP rank 0's file also
                            every other tensor; optim_tp{R:02d}_ep{E:02d}[_pp..].pt that rank's state.
      optim_rank{G:03d}.pt  with actor.use_distributed_optimizer: global rank G's shard of the
                            optimizer state (torch state + main params); resume needs the same DP
      sched.json            OptimizerParamScheduler state
      rng_rank{G:03d}.pt    RNG states of global actor rank G (CPU, CUDA, Megatron tracker, python)
      hf_export/            optional full HF export (runner.save_hf; the eval snapshots may reuse it)
      broker_state.bin      the broker's counters and buffered groups (written by actor rank 0)
      run.json              the run's identity ``{"run_id", "config_hash"}`` (``asyncrl.trainer.resume``)
      complete              written last by actor rank 0: only a complete checkpoint is resumed

Contract
- ``CheckpointManager(root)`` owns the paths, the markers, the listing and the pick (``pick``: with
  ``runner.resume`` this run's newest complete checkpoint, else ``runner.resume_from``), the writing
  (``save``, collective: the actor's state on every rank, then on actor rank 0 the broker state, the identity
  and ``complete``) and the reading (``load``, collective: the actor's state, and the broker state if any).
  Nobody else builds a path inside the root.
- The actor's own state (``save_actor_state`` / ``load_actor_state``, what ``Actor.save_checkpoint`` /
  ``load_checkpoint`` call): model/optimizer files are written by the first DP replica of each TP/EP/PP
  shard (expert-DP rank 0; DP replicas are identical with the non-distributed optimizer); every rank writes
  its RNG file; ``meta.json`` is written last of the actor's files. Resuming the optimizer needs the TP, PP
  and EP it was saved at; the model loads at any PP and EP. A checkpoint converted from HF (``hf_to_actor_checkpoint``) has only meta, hf/ and
  model files: loading it starts a fresh optimizer.

    mgr = CheckpointManager(run_dir / "checkpoints")
    mgr.save(actor, 10, broker_state=broker.get_state if rank == 0 else None, ident=ident)
    meta, broker_state = mgr.load(actor, mgr.pick(ident, resume=True, resume_from=None))
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.actor.convert import hf_state_to_megatron, megatron_state_to_hf, tp_merge, tp_shard
from asyncrl.actor.model import actor_spec, padded_vocab_size
from asyncrl.actor.names import is_expert
from asyncrl.actor.weights import is_tied_output_copy, local_params
from asyncrl.cluster.megatron_cpu import cuda_as_cpu
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors

# Lazy imports: megatron-core (the RNG tracker, the parallel state) is imported inside the functions that save and
# restore the actor's state; its import takes seconds and probes CUDA, and the converter and the manager's listing
# must import without it.

log = logging.getLogger(__name__)

FORMAT = "asyncrl-actor-v1"
META_FILE = "meta.json"
SCHED_FILE = "sched.json"
HF_DIR = "hf"
HF_EXPORT = "hf_export"
BROKER_STATE = "broker_state.bin"
IDENTITY_FILE = "run.json"
COMPLETE = "complete"
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


def _shard(tp_rank: int, pp_rank: int, pp: int, ep_rank: int, ep: int) -> str:
    return f"tp{tp_rank:02d}" + ("" if ep == 1 else f"_ep{ep_rank:02d}") + ("" if pp == 1 else f"_pp{pp_rank:02d}")


def model_file(tp_rank: int, pp_rank: int = 0, pp: int = 1, ep_rank: int = 0, ep: int = 1) -> str:
    return f"model_{_shard(tp_rank, pp_rank, pp, ep_rank, ep)}.safetensors"


def optim_file(tp_rank: int, pp_rank: int = 0, pp: int = 1, ep_rank: int = 0, ep: int = 1) -> str:
    return f"optim_{_shard(tp_rank, pp_rank, pp, ep_rank, ep)}.pt"


def read_model_tensors(ckpt: Path, tp_rank: int, pp: int, names: list[str], ep: int = 1) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of TP rank ``tp_rank``, from the stage and EP files of a checkpoint saved at
    PP=``pp``, EP=``ep``."""
    files = [Path(ckpt) / model_file(tp_rank, s, pp, e, ep) for s in range(pp) for e in range(ep)]
    reader = SafetensorsReader(files)
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
    tmp = ckpt / (META_FILE + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **meta}, indent=2) + "\n")
    tmp.replace(ckpt / META_FILE)


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    p = Path(ckpt) / META_FILE
    if not p.is_file():
        raise ValueError(f"{str(ckpt)!r} is not an actor checkpoint (no {META_FILE})")
    meta = json.loads(p.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(p)!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def read_identity(directory: str | Path) -> dict | None:
    """The run identity in ``directory`` (a run dir or a checkpoint), or None when absent or unreadable."""
    p = Path(directory) / IDENTITY_FILE
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and "run_id" in d and "config_hash" in d else None


def write_identity(directory: str | Path, ident: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (IDENTITY_FILE + ".tmp")
    tmp.write_text(json.dumps(ident) + "\n")
    tmp.replace(directory / IDENTITY_FILE)


class CheckpointManager:
    """The run's checkpoints under ``root`` (see the module contract): paths, markers, listing, pick, save, load."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{int(step):06d}"

    def hf_export(self, step: int) -> Path:
        """Where the checkpoint of ``step`` holds its full HF export (``runner.save_hf``)."""
        return self.step_dir(step) / HF_EXPORT

    @staticmethod
    def is_complete(ckpt: str | Path) -> bool:
        return (Path(ckpt) / COMPLETE).is_file()

    @staticmethod
    def step_of(ckpt: str | Path) -> int:
        """The step a checkpoint (of this layout, or a converted one) holds."""
        return int(read_meta(ckpt)["step"])

    @staticmethod
    def exported_version(snapshot: str | Path) -> int | None:
        """For a checkpoint's ``hf_export``: the weight version its checkpoint records (``meta.json`` is written
        after the export), or None when ``snapshot`` is no checkpoint's export or its meta is missing/unreadable."""
        d = Path(snapshot)
        meta = d.parent / META_FILE
        if d.name != HF_EXPORT or not meta.is_file():
            return None
        try:
            return int(json.loads(meta.read_text())["weight_version"])
        except (ValueError, TypeError, KeyError, OSError):
            return None

    def complete_checkpoints(self, ident: dict) -> list[Path]:
        """This run's (``ident``) complete checkpoints, oldest first; other runs' are skipped and logged."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.glob("step_*"):
            if not self.is_complete(p) or not p.name.split("_")[1].isdigit():
                continue
            if read_identity(p) == ident:
                out.append(p)
            else:
                log.info("checkpoint %s belongs to another run (%s); not resuming from it", p, read_identity(p))
        return sorted(out, key=lambda p: int(p.name.split("_")[1]))

    def pick(self, ident: dict, *, resume: bool, resume_from: str | None) -> Path | None:
        """The checkpoint to resume from: this run's newest complete one (with ``resume`` or ``resume_from``),
        else ``resume_from`` (any run's checkpoint), else None (start at step 0)."""
        if not (resume or resume_from):
            return None
        own = self.complete_checkpoints(ident)
        if own:
            return own[-1]
        return Path(resume_from) if resume_from else None

    def save(self, actor: Any, step: int, *, broker_state: Callable[[], bytes] | None, ident: dict | None) -> Path:
        """The checkpoint of ``step`` (collective over the actor ranks). Actor rank 0 passes ``broker_state`` (the
        broker client's ``get_state``) and ``ident``: after the actor's state it writes them, then ``complete``."""
        d = self.step_dir(step)
        actor.save_checkpoint(d, step=step)
        if broker_state is not None:
            assert ident is not None, "the leader writes the run identity with the broker state"
            (d / BROKER_STATE).write_bytes(broker_state())
            write_identity(d, ident)
            (d / COMPLETE).write_text("ok\n")
        return d

    def load(self, actor: Any, ckpt: str | Path) -> tuple[dict[str, Any], bytes | None]:
        """Restore the actor from ``ckpt`` (collective); its meta and the broker state it holds (None if none)."""
        meta = actor.load_checkpoint(ckpt)
        p = Path(ckpt) / BROKER_STATE
        return meta, (p.read_bytes() if p.is_file() else None)


def hf_to_actor_checkpoint(hf_dir: str | Path, out: str | Path, *, tp: int = 1) -> Path:
    """Convert a HF checkpoint into an actor checkpoint for ``tp`` TP ranks (model only)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = actor_spec(hf_dir)
    full = hf_state_to_megatron(SafetensorsReader(hf_dir).to_dict(), spec, tp=tp)
    for r in range(tp):
        save_safetensors({k: tp_shard(k, v, rank=r, tp=tp) for k, v in full.items()}, out / model_file(r))
    copy_hf_side_files(hf_dir, out / HF_DIR)
    write_meta(
        out,
        {
            "step": 0,
            "weight_version": 0,
            "tp": tp,
            "pp": 1,
            "ep": 1,
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
    pp, ep = int(meta.get("pp", 1)), int(meta.get("ep", 1))
    tied = actor_spec(ckpt / HF_DIR).tie_word_embeddings if pp > 1 else False
    full: dict[str, torch.Tensor] = {}
    for s, e in ((s, e) for s in range(pp) for e in range(ep)):
        shards = [SafetensorsReader(ckpt / model_file(r, s, pp, e, ep)).to_dict() for r in range(int(meta["tp"]))]
        for k in shards[0]:
            if tied and k == "output_layer.weight":  # the last stage's copy of the tied embeddings
                continue
            full[k] = tp_merge(k, [sh[k] for sh in shards])
    return full, meta


def actor_checkpoint_to_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write a HF checkpoint (model.safetensors + side files) from an actor checkpoint."""
    ckpt, out = Path(ckpt), Path(out)
    full, _ = load_full_megatron(ckpt)
    spec = actor_spec(ckpt / HF_DIR)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(dict(megatron_state_to_hf(full, spec)), out / "model.safetensors")
    copy_hf_side_files(ckpt / HF_DIR, out)
    return out


# ------------------------------------------------------------------ the actor's state in a checkpoint
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
        shard = SafetensorsReader(d / model_file(actor.tp_rank)).to_dict()
    else:  # this rank's tensors, from whichever stage / EP file holds them (any saved PP and EP)
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
        shard = torch.load(d / optim_shard_file(actor.rank), map_location="cpu", weights_only=False)
        _load_optimizer_shard_state(actor.optimizer, shard)
    else:
        path = d / optim_file(actor.tp_rank, actor.pp_rank, actor.pp, actor.experts.rank, actor.ep)
        state = torch.load(path, map_location="cpu", weights_only=False)
        with cuda_as_cpu():
            actor.optimizer.load_state_dict(state)
    # Megatron's load_state_dict *adds* the saved step count to the current one
    actor.scheduler.num_steps = 0
    actor.scheduler.load_state_dict(json.loads((d / SCHED_FILE).read_text()))
    rng = d / rng_file(actor.rank)
    if rng.is_file() and meta.get("dp") == actor.dp:
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
