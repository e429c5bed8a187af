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
      manifest.json         size and sha256 of every other file (written by actor rank 0 after them, each fsynced)
      complete              written last by actor rank 0: ``sha256 <hex of manifest.json>``; only a complete
                            checkpoint is resumed (``ok`` in checkpoints older than the manifest: not verified)
    .partial_step_{N:06d}/  a checkpoint being written: renamed to ``step_{N:06d}`` once complete (atomic); a
                            crashed save's leftover is removed by the next save

Contract
- ``CheckpointManager(root)`` owns the paths, the markers, the listing and the pick (``pick``: with
  ``runner.resume`` this run's newest complete checkpoint, else ``runner.resume_from``), the writing
  (``save``, collective: the actor's state on every rank into ``.partial_step_N``, then on actor rank 0 the
  broker state, the identity, the manifest and ``complete``, and the rename to ``step_N``; then the retention:
  only this run's newest ``keep`` complete checkpoints are kept, 0 keeps all) and the reading (``load``,
  collective: the actor's state, and the broker state if any). Nobody else builds a path inside the root.
- Nothing at rest is lost: a save never replaces another run's checkpoint (``CheckpointError``); ``pick``
  verifies the candidate against its manifest (``verify_checkpoint``) and skips a damaged one with a warning
  naming it and what is wrong, in favour of the newest intact one (``CheckpointError`` when every one of the
  run's checkpoints is damaged and no ``resume_from`` is given); a file that cannot be read at load raises
  ``CheckpointError`` naming it; a save that fails (a full disk) raises ``CheckpointError`` naming the directory
  and its file system's free space, after actor rank 0 removed the partial checkpoint (the previous ones stay).
- The actor's own state (model, optimizer, scheduler, RNG: what ``Actor.save_checkpoint`` / ``load_checkpoint``
  write and read) is ``asyncrl.actor.checkpoint_state``'s; a checkpoint converted from HF (``hf_to_actor_checkpoint``)
  has only meta, hf/ and model files: loading it starts a fresh optimizer.

    mgr = CheckpointManager(run_dir / "checkpoints", keep=3)
    mgr.save(actor, 10, broker_state=broker.get_state if rank == 0 else None, ident=ident)
    meta, broker_state = mgr.load(actor, mgr.pick(ident, resume=True, resume_from=None))
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from asyncrl.actor.convert import hf_state_to_megatron, megatron_state_to_hf, tp_merge, tp_shard
from asyncrl.actor.model import actor_spec, padded_vocab_size
from asyncrl.cluster.durable import fsync_dir, write_durable
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors

log = logging.getLogger(__name__)

FORMAT = "asyncrl-actor-v1"
META_FILE = "meta.json"
SCHED_FILE = "sched.json"
HF_DIR = "hf"
HF_EXPORT = "hf_export"
BROKER_STATE = "broker_state.bin"
IDENTITY_FILE = "run.json"
COMPLETE = "complete"
MANIFEST = "manifest.json"
PARTIAL = ".partial_"
"""Prefix of a checkpoint being written (``.partial_step_000010``); the listing never sees it."""
HASH_THREADS = 8
"""Files hashed at once (sha256 releases the GIL: ~1.7 GB/s a thread)."""
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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or trusted; the message names its path."""


@contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Re-raise what reading ``path`` raises (a truncated JSON, a corrupt safetensors or pickle) as
    ``CheckpointError`` naming the file."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader's error, re-raised with the path it concerns
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {type(e).__name__}: {e}") from e


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    p = Path(ckpt) / META_FILE
    if not p.is_file():
        raise ValueError(f"{str(ckpt)!r} is not an actor checkpoint (no {META_FILE})")
    with reading(p):
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
    if not (isinstance(d, dict) and "run_id" in d and "config_hash" in d):
        return None
    return {"run_id": d["run_id"], "config_hash": d["config_hash"]}  # a run dir's run.json also holds the config


def write_identity(directory: str | Path, ident: dict, *, config: dict | None = None) -> None:
    """``run.json``: the identity (and, in the run dir, the hashed ``config``: a changed key is then named)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (IDENTITY_FILE + ".tmp")
    body = {"run_id": ident["run_id"], "config_hash": ident["config_hash"]}
    tmp.write_text(json.dumps(body if config is None else {**body, "config": config}) + "\n")
    tmp.replace(directory / IDENTITY_FILE)


def read_run_config(directory: str | Path) -> dict | None:
    """The hashed config ``write_identity`` recorded in ``directory``, or None (absent, unreadable, older runs)."""
    try:
        d = json.loads((Path(directory) / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return d.get("config") if isinstance(d, dict) and isinstance(d.get("config"), dict) else None


# ------------------------------------------------------------------ integrity at rest
def _digest(path: Path) -> tuple[int, str]:
    """Size and sha256 of ``path``, fsynced first (a power loss cannot leave it shorter than the manifest)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()


def _hash_files(ckpt: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: _digest(ckpt / n), names)))


def seal_checkpoint(ckpt: str | Path) -> None:
    """``manifest.json`` (size and sha256 of every file in ``ckpt``), then ``complete`` naming its sha256."""
    ckpt = Path(ckpt)
    names = sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE)
    )
    files = {n: {"size": size, "sha256": h} for n, (size, h) in _hash_files(ckpt, names).items()}
    blob = (json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n").encode()
    write_durable(ckpt / MANIFEST, blob)
    write_durable(ckpt / COMPLETE, f"sha256 {hashlib.sha256(blob).hexdigest()}\n".encode())


def verify_checkpoint(ckpt: str | Path) -> str | None:
    """What is wrong with a complete checkpoint (a file missing, of another size or checksum than its manifest
    says, the manifest itself damaged), or None when it is intact or predates manifests (``complete`` = ``ok``)."""
    ckpt = Path(ckpt)
    try:
        marker = (ckpt / COMPLETE).read_text().split()
    except OSError as e:
        return f"its {COMPLETE} marker cannot be read ({e})"
    if marker[:1] != ["sha256"]:
        return None  # written before checkpoints carried a manifest
    try:
        blob = (ckpt / MANIFEST).read_bytes()
    except OSError:
        return f"{MANIFEST} is missing"
    if len(marker) != 2 or hashlib.sha256(blob).hexdigest() != marker[1]:
        return f"{MANIFEST} does not match the checksum in {COMPLETE}"
    files = json.loads(blob)["files"]
    for name, want in files.items():
        p = ckpt / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["size"]:
            return f"{name} has {p.stat().st_size} bytes, its manifest says {want['size']}"
    for name, (_, h) in _hash_files(ckpt, sorted(files)).items():
        if h != files[name]["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def _free_space(path: Path) -> str:
    """``path``'s file system: free and total bytes, in words."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        u = shutil.disk_usage(path)
    except OSError as e:
        return f"free space unknown ({e})"
    return f"{u.free / 2**20:.1f} MiB free of {u.total / 2**20:.1f} MiB"


class CheckpointManager:
    """The run's checkpoints under ``root`` (see the module contract): paths, markers, listing, pick, save, load;
    ``keep``: how many of this run's newest complete checkpoints a save keeps (0: all)."""

    def __init__(self, root: str | Path, *, keep: int = 0):
        self.root = Path(root)
        self.keep = int(keep)

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

    def _complete_step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.name[5:].isdigit() and self.is_complete(p)]
        return sorted(found, key=lambda p: int(p.name[5:]))

    def complete_checkpoints(self, ident: dict) -> list[Path]:
        """This run's (``ident``) complete checkpoints, oldest first; other runs' are skipped and logged."""
        out = []
        for p in self._complete_step_dirs():
            if read_identity(p) == ident:
                out.append(p)
            else:
                log.info("checkpoint %s belongs to another run (%s); not resuming from it", p, read_identity(p))
        return out

    def foreign_checkpoints(self, ident: dict | None) -> list[Path]:
        """The complete checkpoints under the root that are not of the run ``ident`` (all of them for None)."""
        return [p for p in self._complete_step_dirs() if ident is None or read_identity(p) != ident]

    def pick(self, ident: dict, *, resume: bool, resume_from: str | None) -> Path | None:
        """The checkpoint to resume from: this run's newest intact complete one (with ``resume`` or
        ``resume_from``; a damaged one is skipped with a warning), else ``resume_from`` (any run's checkpoint;
        verified when it has a manifest), else None (start at step 0)."""
        if not (resume or resume_from):
            return None
        damaged = []
        for p in reversed(self.complete_checkpoints(ident)):
            why = verify_checkpoint(p)
            if why is None:
                return p
            log.warning("checkpoint %s is damaged (%s): skipped, resuming from an older checkpoint if any", p, why)
            damaged.append(f"{p} ({why})")
        if resume_from:
            why = verify_checkpoint(resume_from) if self.is_complete(resume_from) else None
            if why is not None:
                raise CheckpointError(f"runner.resume_from = {resume_from!r}: the checkpoint is damaged ({why})")
            return Path(resume_from)
        if damaged:
            raise CheckpointError(
                f"every checkpoint of this run under {str(self.root)!r} is damaged: {'; '.join(damaged)}. "
                "Set runner.resume_from to a checkpoint you trust, or move them away to start from step 0"
            )
        return None

    def save(
        self,
        actor: Any,
        step: int,
        *,
        broker_state: Callable[[], bytes] | None,
        ident: dict | None,
        prune: bool = True,
    ) -> Path:
        """The checkpoint of ``step`` (collective over the actor ranks), written into ``.partial_step_N``. Actor
        rank 0 passes ``broker_state`` (the broker client's ``get_state``) and ``ident``: after the actor's state
        it writes them, the manifest and ``complete``, renames the directory to ``step_N`` and (``prune``, with
        ``keep``) deletes this run's older checkpoints beyond the newest ``keep``."""
        final = self.step_dir(step)
        part = self.root / f"{PARTIAL}{final.name}"
        leader = broker_state is not None
        try:
            if leader:
                self._clear_partials()
            actor.save_checkpoint(part, step=step)
            if leader:
                assert ident is not None, "the leader writes the run identity with the broker state"
                (part / BROKER_STATE).write_bytes(broker_state())
                write_identity(part, ident)
                seal_checkpoint(part)
                self._publish(part, final, ident)
        except Exception as e:  # noqa: BLE001 - any writer's error (a full disk), re-raised naming the place
            err = CheckpointError(
                f"writing the checkpoint of step {step} into {str(part)!r} failed: {type(e).__name__}: {e}; "
                f"the file system of {str(self.root)!r} has {_free_space(self.root)} (the partial checkpoint is "
                "removed, the previous ones are kept)"
            )
            if leader:
                shutil.rmtree(part, ignore_errors=True)
            raise err from e
        if leader and prune and self.keep:
            self.prune(ident)
        return final

    def _clear_partials(self) -> None:
        """Remove what crashed saves left (``.partial_step_*``): never resumed, only taking space."""
        for p in self.root.glob(f"{PARTIAL}*") if self.root.is_dir() else []:
            log.warning("removing %s: the leftover of a checkpoint save that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)

    def _publish(self, part: Path, final: Path, ident: dict) -> None:
        """Rename the sealed ``part`` to ``final``; an earlier save of the same step by this run (or an incomplete
        one) is replaced, another run's complete checkpoint never."""
        if final.exists():
            owner = read_identity(final)
            if self.is_complete(final) and owner != ident:
                raise CheckpointError(f"{str(final)!r} holds a checkpoint of another run ({owner}): not replacing it")
            log.warning("replacing %s, an earlier (or unfinished) save of this step by this run", final)
            old = self.root / f"{PARTIAL}old_{final.name}"
            final.rename(old)
            part.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            part.rename(final)
        fsync_dir(self.root)

    def prune(self, ident: dict, keep: int | None = None) -> list[Path]:
        """Delete this run's complete checkpoints older than its newest ``keep`` (default the manager's; 0: none);
        other runs' are never touched. The deleted ones (renamed out of the listing first)."""
        keep = self.keep if keep is None else int(keep)
        own = self.complete_checkpoints(ident)
        if keep <= 0 or len(own) <= keep:
            return []
        gone = own[:-keep]
        for p in gone:
            doomed = self.root / f"{PARTIAL}deleted_{p.name}"
            p.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            log.info("deleted %s (actor.keep_checkpoints = %d)", p, keep)
        return gone

    def load(self, actor: Any, ckpt: str | Path) -> tuple[dict[str, Any], bytes | None]:
        """Restore the actor from ``ckpt`` (collective); its meta and the broker state it holds (None if none)."""
        meta = actor.load_checkpoint(ckpt)
        p = Path(ckpt) / BROKER_STATE
        with reading(p):
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
