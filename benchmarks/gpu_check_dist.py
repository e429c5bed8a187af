"""The two-process checks of ``benchmarks/gpu_check.py``: the weight sync's broadcast and the actor's TP=2 gather,
both ends on one device (one GPU, or the CPU in ``--cpu-smoke``), each rank a spawned process.

    report = check_weight_sync(hf, device_type="cuda", deadline_s=180.0, tmp=Path(tmp))
    report = check_tp_gather(hf, device_type="cuda", deadline_s=120.0, tmp=Path(tmp))

Contract
- ``weight_sync``: rank 0 is the trainer's end: the checkpoint's tensors in bf16 on the device, in buckets
  (``iter_buckets``), sent by the sync's own ``push_buckets`` / ``send_bucket`` (``broadcast_from_rank0`` of every
  tensor, or of the bucket's one ``flatten_bucket`` uint8 tensor with ``load_format = "flattened_bucket"``) on a
  ``PeerGroup``: the weight-update group with no HTTP engine. Rank 1 is the CPU engine's receiving end:
  ``WeightUpdates`` (``init_weights_update_group`` under gloo, then ``update_weights_from_distributed``:
  ``check_update``, ``_receive_staged``, ``_receive`` and the model's load) with its model, standby bank and staging
  buffers on the same device (``torch.device`` as the default device) and a real ``Scheduler``, whose calls run on
  this thread (in the engine, on its engine thread). The one piece left out is HTTP: the receiver makes the bodies
  the trainer would POST from the same checkpoint and bucket size. The first repetition of each format is verified
  (every tensor ``_receive_staged`` handed on is bitwise the bf16 tensor sent, with its dtype, shape and device, and
  the model holds it after the load); the next ones are timed (sender: the push, then a fence all-reduce, so the
  receiver's load is inside the time).
- ``tp_gather``: two ranks of a TP=2 default group, each holding its ``tp_shard`` of every Megatron tensor (bf16, on
  the device, in a module whose parameters carry Megatron's names), run ``iter_hf_buckets``: the gather and HF
  conversion the actor runs before a sync. Every gathered tensor must be bitwise the unsharded checkpoint tensor.
- Backends: NCCL first; on one GPU NCCL normally refuses two ranks on one device ("Duplicate GPU detected"), then
  gloo over the same device's tensors runs. ``backend`` names the one that ran, ``attempts`` what each try gave. On
  CPU the NCCL try fails at once (CPU tensors, or a CPU build of torch), so the smoke run exercises the fallback too.
- Deadlines: each try's processes are killed at its deadline (NCCL's try gets at most ``NCCL_TRY_S``) and
  ``FAIL_GRACE_S`` after a rank failed; each rank's group timeout is the deadline, so no collective outlives it.
  Only this module's own child processes are ever killed (by their ``Process`` objects).
"""

from __future__ import annotations

import datetime as _dt
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.cluster.ports import free_port

GROUP_NAME = "gpu_check_weight_update"
TP = 2
FORMATS = ("per_tensor", "flattened_bucket")
NCCL_TRY_S = 60.0  # spawn + CUDA init + a failed NCCL init take ~15 s; a hang must leave gloo most of the deadline
FAIL_GRACE_S = 5.0  # after one rank failed, how long the other gets to report its own error before it is killed
_DTYPE = torch.bfloat16  # what the actor sends (bf16 weights)


@dataclass
class PeerGroup:
    """What ``push_buckets`` reads of a ``WeightSyncGroup`` when the receiver is a group rank with no HTTP endpoint:
    the process group, its name, and no engine URLs (so ``send_bucket`` makes no update call: the receiver makes its
    own from the same metadata)."""

    pg: dist.ProcessGroup
    group_name: str = GROUP_NAME
    urls: tuple[str, ...] = ()


# ---- running two ranks with a deadline ---------------------------------------------------------------------------


def _rank_main(fn: Callable[..., dict], rank: int, kwargs: dict, path: str) -> None:
    """Child process: ``fn(rank, **kwargs)``'s report (or its error) written to ``path``, then a hard exit (1 on an
    error): a failed group is never destroyed nor torn down at exit, where a broken NCCL communicator can hang."""
    try:
        res = fn(rank, **kwargs)
    except Exception as e:  # noqa: BLE001 - a diagnostic: the error goes into the report, the parent decides
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"[:2000]}
    tmp = Path(path + ".part")
    tmp.write_text(json.dumps(res))
    tmp.rename(path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "error" in res else 0)


def run_ranks(fn: Callable[..., dict], kwargs: dict, *, deadline_s: float, out_dir: Path) -> list[dict]:
    """``fn(rank, **kwargs)`` in ``TP`` spawned processes; their reports, in rank order. A rank still running at
    ``deadline_s``, or ``FAIL_GRACE_S`` after another rank failed, is killed and reported as an error."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or a process group
    paths = [out_dir / f"rank{r}.json" for r in range(TP)]
    procs = [ctx.Process(target=_rank_main, args=(fn, r, kwargs, str(p)), daemon=True) for r, p in enumerate(paths)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    failed_at = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
            end = min(end, now + FAIL_GRACE_S)
        if now >= end:
            break
        wait_any([p.sentinel for p in procs if p.is_alive()], timeout=min(1.0, end - now))
    killed = {r for r, p in enumerate(procs) if p.is_alive()}
    for r in killed:
        procs[r].kill()
    for p in procs:
        p.join(10)
    out = []
    for r, (p, path) in enumerate(zip(procs, paths)):
        if path.is_file():
            out.append(json.loads(path.read_text()))
        elif r in killed:
            why = "after another rank failed" if failed_at is not None else f"at the deadline ({deadline_s:.0f} s)"
            out.append({"error": f"killed {why}"})
        else:
            out.append({"error": f"exited with status {p.exitcode} without a report"})
    return out


def with_fallback(
    fn: Callable[..., dict], kwargs: dict, merge: Callable[[list[dict]], dict], *, deadline_s: float, tmp: Path
) -> dict:
    """Run ``fn``'s two ranks with NCCL, then with gloo if NCCL failed; the merged report of the try that ran, with
    ``backend`` and ``attempts`` (backend -> "ok" or the ranks' errors)."""
    attempts: dict[str, str] = {}
    end = time.monotonic() + deadline_s
    for backend in ("nccl", "gloo"):
        left = end - time.monotonic()
        budget = min(left, NCCL_TRY_S) if backend == "nccl" else left
        if budget <= 0:
            attempts[backend] = "not tried: deadline reached"
            continue
        kw = {**kwargs, "backend": backend, "port": free_port("127.0.0.1"), "deadline_s": budget}
        ranks = run_ranks(fn, kw, deadline_s=budget, out_dir=tmp / backend)
        errors = [f"rank {r}: {x['error']}" for r, x in enumerate(ranks) if "error" in x]
        if not errors:
            attempts[backend] = "ok"
            return {"backend": backend, "attempts": attempts, **merge(ranks)}
        attempts[backend] = "; ".join(errors)
    return {"error": "no backend ran: " + json.dumps(attempts), "attempts": attempts}


# ---- helpers of both checks ----------------------------------------------------------------------------------------


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _fence(dev: torch.device, pg: dist.ProcessGroup | None = None) -> None:
    """An all-reduce both ranks must reach (a refusing NCCL fails here, on the first collective)."""
    t = torch.ones(1, device=dev)
    dist.all_reduce(t, group=pg)
    assert t.item() == TP, f"fence all-reduce gave {t.item()}, expected {TP}"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def compare(
    got: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]], *, device_type: str
) -> dict[str, object]:
    """Every expected tensor present in ``got`` with its dtype, shape, device type and bytes (bitwise)."""
    missing = [n for n, _ in expected if n not in got]
    bad = {"dtype": [], "shape": [], "device": [], "bytes": []}
    for n, t in expected:
        g = got.get(n)
        if g is None:
            continue
        if g.dtype != t.dtype:
            bad["dtype"].append(n)
        elif tuple(g.shape) != tuple(t.shape):
            bad["shape"].append(n)
        elif not torch.equal(_as_bytes(g), _as_bytes(t)):
            bad["bytes"].append(n)
        if g.device.type != device_type:
            bad["device"].append(n)
    return {
        "num_checked": len(expected) - len(missing),
        "missing": missing[:3],
        "bitwise_equal": not missing and not bad["bytes"] and not bad["dtype"] and not bad["shape"],
        "dtype_ok": not bad["dtype"],
        "shapes_ok": not bad["shape"],
        "device_ok": not bad["device"],
        "mismatched": {k: v[:3] for k, v in bad.items() if v},
    }


# ---- 1. the weight sync's broadcast: trainer end -> the CPU engine's receive -----------------------------------------


def _bf16_tensors(hf: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in bf16 on the CPU, in file order: the bytes the sender sends."""
    from asyncrl.cpu_engine.model import iter_safetensors

    return [(n, t.to(_DTYPE).contiguous()) for n, t in iter_safetensors(Path(hf))]


def _sync_rank(
    rank: int, *, hf: str, device_type: str, backend: str, port: int, deadline_s: float, bucket_bytes: int, reps: int
) -> dict:
    dev = _device(device_type)
    if rank == 0:
        return _sync_sender(hf, dev, backend, port, deadline_s, bucket_bytes, reps)
    return _sync_receiver(hf, dev, backend, port, deadline_s, bucket_bytes, reps)


def _sync_sender(hf, dev, backend, port, deadline_s, bucket_bytes, reps) -> dict:
    from asyncrl.cluster.weight_update_group import destroy_weight_update_group, init_weight_update_group
    from asyncrl.sync.bucketing import iter_buckets
    from asyncrl.sync.weight_sync import push_buckets

    pg = init_weight_update_group(
        "127.0.0.1", port, rank=0, world_size=TP, group_name=GROUP_NAME, backend=backend, timeout_s=deadline_s
    )
    group = PeerGroup(pg)
    buckets = list(iter_buckets([(n, t.to(dev)) for n, t in _bf16_tensors(hf)], bucket_bytes))
    _fence(dev, pg)
    out: dict = {}
    for fmt in FORMATS:
        rep_s, transfer_s = [], []
        for _ in range(1 + reps):  # the first is the receiver's verified (and warm-up) repetition
            t0 = time.perf_counter()
            stats = push_buckets(
                group, buckets, flush_cache=True, flattened=fmt == "flattened_bucket", step_timeout_s=deadline_s
            )
            _sync(dev)
            _fence(dev, pg)  # the receiver has loaded every bucket
            rep_s.append(time.perf_counter() - t0)
            transfer_s.append(stats.transfer_s)
        out[fmt] = {
            "rep_s": [round(t, 4) for t in rep_s[1:]],
            "push_transfer_s": [round(t, 4) for t in transfer_s[1:]],
            "bytes_per_s": round(stats.num_bytes / statistics.median(rep_s[1:]), 1),
        }
    out.update(num_bytes=stats.num_bytes, num_buckets=stats.num_buckets, num_tensors=stats.num_tensors)
    destroy_weight_update_group(pg)  # after a failure the process exits instead (``_rank_main``)
    return out


def _sync_receiver(hf, dev, backend, port, deadline_s, bucket_bytes, reps) -> dict:
    from asyncrl.cluster.weight_update_group import destroy_weight_update_group, init_weight_update_group
    from asyncrl.cpu_engine.model import load_model
    from asyncrl.cpu_engine.scheduler import Scheduler
    from asyncrl.cpu_engine.weight_updates import WeightUpdates
    from asyncrl.sync.bucketing import iter_buckets

    expected = _bf16_tensors(hf)
    buckets = list(iter_buckets(expected, bucket_bytes))
    # the engine's tensors (model, standby bank, staging) on ``dev``; its thread runs under inference mode
    with torch.device(dev), torch.inference_mode():
        model = load_model(hf)
        sched = Scheduler(model, lambda ids, skip: "", max_running_requests=1)
        updates = WeightUpdates(model, call=lambda fn: fn(sched), timeout_s=deadline_s)
        if backend == "gloo":  # the engine's own op (it accepts gloo only)
            join = {"master_address": "127.0.0.1", "master_port": port, "group_name": GROUP_NAME}
            ok, msg, _ = updates.init_weights_update_group(
                {**join, "backend": backend, "world_size": TP, "rank_offset": 1}
            )
            if not ok:
                raise RuntimeError(f"init_weights_update_group: {msg}")
        else:
            updates.groups[GROUP_NAME] = init_weight_update_group(
                "127.0.0.1", port, rank=1, world_size=TP, group_name=GROUP_NAME, backend=backend, timeout_s=deadline_s
            )
        pg = updates.groups[GROUP_NAME]
        _fence(dev, pg)
        out = {fmt: _receive_format(updates, model, pg, buckets, expected, fmt, dev, reps) for fmt in FORMATS}
        destroy_weight_update_group(pg)
        return out


def _receive_format(updates, model, pg, buckets, expected, fmt, dev, reps) -> dict:
    """One format's repetitions through ``update_weights_from_distributed``: the first verified, the rest timed."""
    from asyncrl.sync.bucketing import bucket_meta, update_request

    bodies = [
        update_request(bucket_meta(b), group_name=GROUP_NAME, flush_cache=True, flattened=fmt == "flattened_bucket")
        for b in buckets
    ]
    # the update session around each repetition, as the sync's pause and finish open and close it: where the session
    # is the engine thread's (``WeightUpdates.begin_weight_update``) the update is refused outside it; where the HTTP
    # process keeps it (``UpdateWindow`` in ``cpu_engine``), this op does not look at it
    begin, end = (getattr(updates, op, None) for op in ("begin_weight_update", "end_weight_update"))
    out: dict = {}
    receive_s = []
    for i in range(1 + reps):
        if begin is not None:
            _answered(begin({}), "begin_weight_update")
        staged: dict[str, torch.Tensor] = {}
        if i == 0:  # observe what the receive staged before ``_receive`` puts it in (an instance attribute)
            updates._receive_staged = _recording(updates, staged)
            for t in model.params.values():  # so that the load must bring every weight back (the model holds them)
                t.zero_()
        t0 = time.perf_counter()
        try:
            for k, body in enumerate(bodies):
                _answered(updates.update_weights_from_distributed(body), f"{fmt} bucket {k}")
            _sync(dev)
        finally:
            if i == 0:
                del updates._receive_staged
        receive_s.append(time.perf_counter() - t0)
        if end is not None:
            _answered(end({}), "end_weight_update")
        if i == 0:
            out = compare(staged, expected, device_type=dev.type)
            held = [n for n, t in expected if n in model.params and not torch.equal(model.params[n].cpu(), t.float())]
            out["model_holds_sent"] = not held
            out["model_mismatched"] = held[:3]
        _fence(dev, pg)
    out["receive_s"] = [round(t, 4) for t in receive_s[1:]]
    return out


def _answered(ans: tuple, what: str) -> None:
    """Raise unless a ``WeightUpdates`` op answered success."""
    ok, msg, _ = ans
    if not ok:
        raise RuntimeError(f"{what}: {msg}")


def _recording(updates, staged: dict[str, torch.Tensor]):
    """``updates._receive_staged`` that also copies every received tensor into ``staged`` (name -> tensor): the
    staging views (bf16, the flattened format) and the standby bank's tensors (fp32 received in place)."""
    receive_staged = type(updates)._receive_staged

    def record(pg, update):
        named, banked = receive_staged(updates, pg, update)
        staged.update((n, t.clone()) for n, t in named)
        staged.update((n, updates._standby_bank().params[n].clone()) for n in banked)
        return named, banked

    return record


def merge_sync(ranks: list[dict]) -> dict:
    sender, receiver = ranks
    out = {k: v for k, v in sender.items() if k not in FORMATS}
    for fmt in FORMATS:
        out[fmt] = {**sender[fmt], **receiver[fmt]}
    return out


def check_weight_sync(hf: Path, *, device_type: str, deadline_s: float, tmp: Path, smoke: bool) -> dict:
    """The weight sync's bf16 broadcast into the CPU engine's receive, both on ``device_type`` (module contract)."""
    from asyncrl.config.schema import SyncConfig

    # smoke: a ~1 MB model in several buckets; GPU: the sync's default bucket size
    kwargs = dict(
        hf=str(hf),
        device_type=device_type,
        bucket_bytes=256 * 1024 if smoke else SyncConfig().bucket_bytes,
        reps=2 if smoke else 3,
    )
    report = with_fallback(_sync_rank, kwargs, merge_sync, deadline_s=deadline_s, tmp=tmp / "weight_sync")
    return {"device": device_type, "dtype": "bfloat16", "bucket_bytes": kwargs["bucket_bytes"], **report}


# ---- 2. the actor's TP=2 gather --------------------------------------------------------------------------------------


def megatron_module(named: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``named_parameters()`` are ``named`` in order, under their dotted (Megatron) names."""
    root = torch.nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _tp_rank(rank: int, *, hf: str, device_type: str, backend: str, port: int, deadline_s: float, bucket_bytes: int):
    from asyncrl.actor.convert import hf_state_to_megatron, tp_shard
    from asyncrl.actor.weights import iter_hf_buckets
    from asyncrl.cpu_engine.model import iter_safetensors
    from asyncrl.models.spec import ModelSpec

    dev = _device(device_type)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=TP,
        timeout=_dt.timedelta(seconds=deadline_s),
    )
    _fence(dev)
    spec = ModelSpec.from_pretrained(hf)
    hf_sd = dict(iter_safetensors(Path(hf)))
    full = hf_state_to_megatron(hf_sd, spec, tp=TP)
    shards = {n: tp_shard(n, t, rank=rank, tp=TP).to(_DTYPE).to(dev) for n, t in full.items()}
    model = megatron_module(shards)
    del full, shards
    _sync(dev)
    t0 = time.perf_counter()
    gathered = [nt for b in iter_hf_buckets(model, spec, bucket_bytes, tp_group=dist.group.WORLD, tp=TP) for nt in b]
    _sync(dev)
    gather_s = time.perf_counter() - t0
    tied = spec.tie_word_embeddings
    expected = [(n, t.to(_DTYPE)) for n, t in hf_sd.items() if not (tied and n == "lm_head.weight")]
    got = dict(gathered)
    out = compare(got, expected, device_type=dev.type)
    num_bytes = sum(t.numel() * t.element_size() for _, t in gathered)
    out.update(
        num_tensors=len(gathered),
        unexpected=sorted(set(got) - {n for n, _ in expected})[:3],
        num_bytes=num_bytes,
        gather_s=round(gather_s, 4),
        bytes_per_s=round(num_bytes / gather_s, 1),
    )
    _fence(dev)
    dist.destroy_process_group()
    return out


def merge_tp(ranks: list[dict]) -> dict:
    out = dict(ranks[0])
    for key in ("bitwise_equal", "dtype_ok", "shapes_ok", "device_ok"):
        out[key] = all(r[key] for r in ranks)
    out["unexpected"] = sorted({n for r in ranks for n in r["unexpected"]})
    out["gather_s"] = max(r["gather_s"] for r in ranks)
    out["bytes_per_s"] = round(out["num_bytes"] / out["gather_s"], 1)
    out["per_rank"] = [{k: r[k] for k in ("bitwise_equal", "mismatched", "missing", "gather_s")} for r in ranks]
    return out


def check_tp_gather(hf: Path, *, device_type: str, deadline_s: float, tmp: Path, smoke: bool) -> dict:
    """The actor's TP=2 gather (``iter_hf_buckets``) of bf16 shards on ``device_type`` against the unsharded tensors."""
    from asyncrl.config.schema import SyncConfig

    kwargs = dict(hf=str(hf), device_type=device_type, bucket_bytes=256 * 1024 if smoke else SyncConfig().bucket_bytes)
    report = with_fallback(_tp_rank, kwargs, merge_tp, deadline_s=deadline_s, tmp=tmp / "tp_gather")
    return {"device": device_type, "dtype": "bfloat16", "tp": TP, **report}
