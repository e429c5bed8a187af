"""The CPU engine's weight updates: the weight-update group, the receiver of broadcast buckets, and loads
from disk, as SGLang's HTTP calls.

    # the scheduler process (scheduler_process): call(fn) runs fn(scheduler) on the engine thread and waits
    updates = WeightUpdates(model, call=run_on_engine_thread, timeout_s=600.0)
    ok, message, extra = updates.update_weights_from_distributed(body)  # WEIGHT_ROUTES: path -> method

Contract
- Each op takes the call's JSON body and returns ``(success, message, extra fields)``, SGLang's answer; the HTTP
  process reads the body and answers (``WEIGHT_ROUTES``), the scheduler process runs the op (``scheduler_process``:
  on the engine thread, or on a thread of its own for ``WAITING_OPS``).
- ``/init_weights_update_group`` blocks its thread (not the scheduler) until the trainer joins.
- ``/update_weights_from_distributed`` fails (400) unless ``/begin_weight_update`` was called and not yet
  ended (``UpdateWindow``, kept on the engine thread as SGLang keeps its session in the scheduler; a second begin
  is refused); tensors are received by ``broadcast`` from group rank 0 in the order of ``names``
  (``load_format="flattened_bucket"``: ONE uint8 broadcast holding each tensor's raw bytes back to back, in
  that order, as SGLang's FlattenedTensorBucket), on the engine thread (through ``call``), so a weight load
  never overlaps a forward. ``/update_weights_from_disk`` reads a HF safetensors directory on a worker thread
  and copies it in on the engine thread the same way.
- Atomic: dtypes and shapes are checked against the running model before the collective (a mismatch
  is a 400, never a gloo size mismatch); a name the model does not have is received and dropped with a warning,
  and the update still succeeds, as SGLang's loaders do (``sync.verify_interval`` on the trainer catches that); tensors are received off the running weights (into a standby bank of
  the same shapes, made on the first update and kept) and put in only when all arrived: a weight buffer that
  arrived whole is swapped with the bank's (no copy), the rest copied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from asyncrl.cluster.weight_update_group import (
    broadcast_from_rank0,
    destroy_weight_update_group,
    init_weight_update_group,
)
from asyncrl.cpu_engine.http_shapes import SELECTORS, weight_version_field
from asyncrl.cpu_engine.model import CausalLM, NoCheckpoint, read_checkpoint
from asyncrl.cpu_engine.sampling_params import RequestError, check_bool, check_int
from asyncrl.cpu_engine.scheduler import Scheduler
from asyncrl.cpu_engine.tensor_updates import update_from_tensor
from asyncrl.engine.client import weight_version_note

log = logging.getLogger("asyncrl.cpu_engine")

MAX_TENSORS_PER_UPDATE = 100_000  # names in one /update_weights_from_distributed call

WEIGHT_ROUTES = {
    "/init_weights_update_group": "init_weights_update_group",
    "/destroy_weights_update_group": "destroy_weights_update_group",
    "/update_weights_from_distributed": "update_weights_from_distributed",
    "/update_weight_version": "update_weight_version",
    "/update_weights_from_disk": "update_weights_from_disk",
    "/update_weights_from_tensor": "update_weights_from_tensor",
    "/begin_weight_update": "begin_weight_update",
    "/end_weight_update": "end_weight_update",
    "/get_weights_by_name": "get_weights_by_name",
}
"""POST path -> the ``WeightUpdates`` op. The session calls (``/begin_weight_update``, ``/end_weight_update``) run in
the scheduler process in order with the updates, as SGLang's (its ``SchedulerWeightUpdaterManager``): a begin or an
end sent while a receive blocks the engine thread waits for it, as on SGLang."""
WEIGHT_OPS = frozenset(WEIGHT_ROUTES.values())
WAITING_OPS = frozenset({"init_weights_update_group", "update_weights_from_disk"})
"""Ops that wait on something besides the engine (the trainer joining, the disk): each runs on a thread of its own.
The others run on the engine thread itself, between two model steps (no thread hand-off on a sync's path)."""

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. Retract or "
    "finish them, then call /flush_cache."
)
"""SGLang 0.5.23's answer to an update with ``flush_cache`` whose flush was refused (the update call fails)."""
READABLE_BY_NAME = frozenset({"llama"})
"""Model types whose SGLang 0.5.23 class implements ``get_weights_by_name`` (``LlamaForCausalLM``; not
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` nor ``Qwen3MoeForCausalLM``)."""

Answer = tuple[bool, str, dict]
"""(success, message, extra fields): SGLang's answer of a weight call."""


def answer(ok: bool, message: str, **extra) -> Answer:
    return ok, message, extra


def torch_dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str):
        raise RequestError(f"dtypes: a dtype is a string such as 'bfloat16', got {name!r:.80}")
    n = name.removeprefix("torch.")
    dt = getattr(torch, n, None)
    if not isinstance(dt, torch.dtype):
        raise RequestError(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True)
class CheckedUpdate:
    """One ``/update_weights_from_distributed`` call whose body passed its checks: what ``_receive`` receives."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    """The running model's shape of each name (``check_update``)."""
    load_format: Optional[str]
    """None (one broadcast per tensor) or ``"flattened_bucket"`` (one uint8 broadcast of them all)."""
    flush: bool
    version: Optional[str]


class UpdateWindow:
    """Whether a weight update is open (``/begin_weight_update`` .. ``/end_weight_update``): an update outside it
    is refused (400) before it reaches the scheduler process."""

    def __init__(self) -> None:
        self.open = False

    def begin(self, body: dict) -> Answer:
        selector = body.get("selector", "all")
        if selector not in SELECTORS:  # the HTTP side refused it already (SGLang's validation error)
            return answer(False, f"selector={selector!r} is not one of {list(SELECTORS)}")
        if self.open:  # SGLang 0.5.23 (scheduler_components/weight_updater.py) refuses a second session
            return answer(False, "a weight-update session is already open; call end_weight_update() first")
        self.open = True
        return answer(True, "Success")

    def end(self, body: dict) -> Answer:
        if not self.open:
            return answer(False, "no weight-update session is open; call begin_weight_update() first")
        self.open = False
        return answer(True, "Success")

    def refusal(self, op: str, body: dict) -> Optional[Answer]:
        """The answer to ``op`` when it must not run now (an update while no update is open), else None. A body
        whose ``group_name`` is not a string goes on: the op's own check names that field first."""
        named = isinstance(body.get("group_name", "weight_update_group"), str)
        if op in ("update_weights_from_distributed", "update_weights_from_tensor") and not self.open and named:
            return answer(False, f"{op} must run between begin_weight_update() and end_weight_update()")
        return None


class WeightUpdates:
    """The weight-update state of one engine (its groups, the open update, the standby bank) and its handlers.
    ``call(fn)`` runs ``fn(scheduler)`` on the engine thread between two model steps and returns its result."""

    def __init__(
        self,
        model: CausalLM,
        *,
        call: Callable[[Callable[[Scheduler], Any]], Any],
        timeout_s: float,
        custom_weight_loaders: tuple[str, ...] = (),
    ):
        self.model = model
        self.custom_weight_loaders = custom_weight_loaders
        """SGLang's ``--custom-weight-loader``: the ``load_format`` values ``/update_weights_from_tensor`` imports."""
        self._call = call
        self.timeout_s = timeout_s
        """Timeout of the weight-update group (join and each broadcast)."""
        self.groups: dict[str, Any] = {}
        self._standby: Optional[CausalLM] = None
        """Weight-update standby bank (``_receive``): a second copy of the weights, made on first use."""
        self._flat_staging: Optional[torch.Tensor] = None
        """Reused receive buffer of the flattened format (grown to the largest bucket)."""
        self.session = UpdateWindow()
        """The open weight-update session (``/begin_weight_update`` .. ``/end_weight_update``)."""

    def begin_weight_update(self, body: dict) -> Answer:
        return self.session.begin(body)

    def end_weight_update(self, body: dict) -> Answer:
        return self.session.end(body)

    def get_weights_by_name(self, body: dict) -> Answer:
        """SGLang's ``/get_weights_by_name {name, truncate_size=100}``: the parameter as float32 ``tolist()``, cut to
        its first ``truncate_size`` entries (rows of a matrix). SGLang 0.5.23 implements the model side for
        Llama-family classes only; for Qwen2/Qwen3/Qwen3-MoE (and for an unknown name) its model runner logs an
        error and the server answers 400 ``{"error": {"message": "Get parameter by name failed"}}``: so does this
        engine.
        Extra field ``parameter`` carries the answer (the HTTP side sends it as the whole body)."""
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise RequestError(f"name must be a string, got {name!r:.80}")
        check_int(size, "truncate_size", lo=-(2**31), hi=2**31)
        m = self.model
        if m.spec.model_type not in READABLE_BY_NAME:
            log.error("get_weights_by_name: %s models do not implement it (as in SGLang 0.5.23)", m.spec.model_type)
            return answer(False, "Get parameter by name failed")
        if name == "lm_head.weight" and m.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        t = m.params.get(name)
        if t is None:
            log.error("get_weights_by_name: no parameter %r", name)
            return answer(False, "Get parameter by name failed")
        return answer(True, "", parameter=self._call(lambda s: t.detach().to(torch.float32).tolist()[:size]))

    def init_weights_update_group(self, body: dict) -> Answer:
        try:
            addr, name, backend = (
                body.get("master_address"),
                body.get("group_name", "weight_update_group"),
                body.get("backend", "nccl"),
            )
            for key, v in (("master_address", addr), ("group_name", name), ("backend", backend)):
                if not isinstance(v, str) or not v:
                    raise RequestError(f"{key} must be a non-empty string, got {v!r:.80}")
            port = check_int(body.get("master_port"), "master_port", lo=1, hi=65535)
            world = check_int(body.get("world_size"), "world_size", lo=2, hi=1 << 20)
            rank = check_int(body.get("rank_offset"), "rank_offset", lo=1, hi=world - 1)  # the CPU engine: one rank
        except RequestError as e:
            return answer(False, f"init_weights_update_group: {e}")
        if backend != "gloo":
            return answer(False, f"backend={backend!r} is not available on the CPU engine; use 'gloo'")
        if name in self.groups:
            return answer(False, f"group {name!r} already exists; destroy it first")
        try:
            pg = init_weight_update_group(
                addr,
                port,
                rank=rank,
                world_size=world,
                group_name=name,
                backend=backend,
                timeout_s=self.timeout_s,
            )
        except (RuntimeError, ValueError) as e:
            log.error("init_weights_update_group failed: %s", e)
            return answer(False, f"Failed to initialize custom process group: {e}.")
        self.groups[name] = pg
        log.info("joined weight-update group %s at %s:%d as rank %d/%d", name, addr, port, rank, world)
        return answer(True, "Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, body: dict) -> Answer:
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            return answer(False, f"group_name must be a string, got {name!r:.80}")
        pg = self.groups.pop(name, None)
        if pg is None:
            return answer(False, "The group to be destroyed does not exist.")
        self._call(lambda s: destroy_weight_update_group(pg))
        return answer(True, "Succeeded to destroy custom process group.")

    def update_weights_from_distributed(self, body: dict) -> Answer:
        refused = self.session.refusal("update_weights_from_distributed", body)
        if refused is not None:
            return refused
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            return answer(False, f"group_name must be a string, got {name!r:.80}")
        pg = self.groups.get(name)
        if pg is None:  # SGLang's receive asserts it; the answer wraps the assertion's text
            return answer(
                False,
                f"Failed to receive weights: Group {name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first.",
            )
        try:  # all of it before the collective: a bad bucket is a 400, never a broadcast of mismatched sizes
            names, dts, shapes = self.check_update(body)
            flush = check_bool(body.get("flush_cache", True), "flush_cache")
            version = weight_version_field(body.get("weight_version"), "weight_version")
            abort_all = check_bool(body.get("abort_all_requests", False), "abort_all_requests")
            fmt = body.get("load_format")
            if fmt not in (None, "flattened_bucket"):
                raise RequestError(f"load_format={fmt!r:.80} is not supported (null or 'flattened_bucket')")
        except RequestError as e:
            return answer(False, str(e))
        if abort_all:
            self._call(lambda s: s.abort(abort_all=True))
        update = CheckedUpdate(names, dts, shapes, load_format=fmt, flush=flush, version=version)
        fn = lambda s: self._receive(s, pg, update)  # noqa: E731
        ok, msg = self._call(fn)
        return answer(ok, msg)

    def check_update(self, body: dict) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
        """Validate an update's metadata against the running model BEFORE the collective: no name twice, a float
        dtype, and the model's own shape for a name it has. A name it does not have (SGLang's loaders warn "not
        found" and skip it) is received with the shape sent and dropped in ``_receive``. The broadcast sizes follow
        from these shapes, so a metadata mistake is a 400 here instead of a size mismatch inside gloo (which
        aborts the process)."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
            and names
        ):
            raise RequestError("names, dtypes and shapes must be non-empty lists of the same length")
        if len(names) > MAX_TENSORS_PER_UPDATE:
            raise RequestError(f"names: {len(names)} tensors in one update, at most {MAX_TENSORS_PER_UPDATE}")
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise RequestError("names must be distinct strings")
        dts = [torch_dtype(d) for d in dtypes]
        for n, d in zip(names, dts):
            if not d.is_floating_point:
                raise RequestError(f"dtypes: {n!r} has dtype {d}; weights are floating point")
        m = self.model
        out = []
        for n, shape in zip(names, shapes):
            if not isinstance(shape, list) or not all(type(x) is int and 0 <= x < 2**31 for x in shape):
                raise RequestError(f"shapes: {n!r} has shape {shape!r:.80}; expected a list of sizes")
            dst = m.params.get(n)
            if dst is not None:
                expected = tuple(dst.shape)
            elif n == "lm_head.weight" and m.spec.tie_word_embeddings:
                expected = tuple(m.params["model.embed_tokens.weight"].shape)
            elif n.endswith("rotary_emb.inv_freq"):
                expected = (m.spec.head_dim // 2,)
            else:
                expected = tuple(shape)  # not the model's: received, then dropped with a warning (as SGLang)
            if tuple(shape) != expected:
                raise RequestError(
                    f"shapes: parameter {n!r} has shape {tuple(shape)}, the running model's is {expected}"
                )
            out.append(expected)
        return names, dts, out

    def _standby_bank(self) -> CausalLM:
        """The standby copy of the weights that broadcasts land in (made on the first update, kept)."""
        if self._standby is None:
            self._standby = CausalLM(self.model.spec, weight_dtype=self.model.weight_dtype)
        return self._standby

    def _receive_staged(self, pg, update: CheckedUpdate) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        """Engine thread: receive one update without touching the running weights. fp32 tensors land
        straight in the standby bank's views (preallocated, no copy); others (another dtype, a skipped
        name, the flattened format) in a reused staging buffer. Returns the tensors to copy in and the
        names received into the standby bank."""
        names, dts, shapes = update.names, update.dtypes, update.shapes
        if update.load_format == "flattened_bucket":
            sizes = [int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dts)]
            total = sum(sizes)
            if self._flat_staging is None or self._flat_staging.numel() < total:
                self._flat_staging = torch.empty(total, dtype=torch.uint8)
            buf = self._flat_staging[:total]
            broadcast_from_rank0(buf, pg).wait()
            named, off = [], 0
            for name, size, s, d in zip(names, sizes, shapes, dts):
                named.append((name, buf[off : off + size].view(d).reshape(s)))
                off += size
            return named, []
        bank = self._standby_bank()
        named, banked, works = [], [], []
        # every receive is queued at once (as the trainer queues its sends): the collectives run back to
        # back inside gloo instead of one Python call and thread wake-up per tensor
        for name, s, d in zip(names, shapes, dts):
            dst = bank.params.get(name)
            exact = self.model.weight_dtype == torch.float32  # else the values must be rounded: load_weights
            if d == torch.float32 and exact and dst is not None and dst.is_contiguous():
                banked.append(name)
            else:
                dst = torch.empty(s, dtype=d)
                named.append((name, dst))
            works.append(broadcast_from_rank0(dst, pg))
        first_error = None
        for w in works:  # wait for all (none left writing into the bank), then raise the first failure
            try:
                w.wait()
            except (RuntimeError, dist.DistError) as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return named, banked

    def _receive(self, sched: Scheduler, pg, update: CheckedUpdate) -> tuple[bool, str]:
        """Engine thread: receive the whole broadcast off the running weights, then put it in. Atomic: a
        failed receive leaves every weight as it was (the metadata was checked in ``check_update``).
        Putting it in: a weight buffer whose every view arrived (q, k and v of a fused qkv) is swapped
        with the standby bank's (no copy; the bank then holds the old values, overwritten by the next
        update); a buffer that arrived in part, and anything staged elsewhere, is copied in."""
        t0 = time.monotonic()
        try:
            named, banked = self._receive_staged(pg, update)
        except (RuntimeError, dist.DistError) as e:
            return False, f"Failed to receive weights: {e}"  # SGLang's text; here no weight changed
        t1 = time.monotonic()
        unknown = [n for n, _ in named if not self._loadable(n)]
        if unknown:  # SGLang's loaders: a warning per name, and the update still succeeds
            for n in unknown:
                log.warning("Parameter %s not found in params_dict: skipped", n)
            named = [(n, t) for n, t in named if self._loadable(n)]
        if banked:
            m, got = self.model, set(banked)
            whole = {m.group_of[n] for n in banked}
            whole = [g for g in whole if got.issuperset(m.groups[g])]
            m.swap_groups(self._standby, whole)
            swapped = {n for g in whole for n in m.groups[g]}
            named += [(n, self._standby.params[n]) for n in banked if n not in swapped]
        self.model.load_weights(named)  # names and shapes were checked: cannot fail half-way
        msg = "Succeeded to update parameter online."
        if update.flush and not sched.flush_cache():  # SGLang fails the update call (the weights are in)
            log.error(FLUSH_REFUSED)
            return False, FLUSH_REFUSED
        if update.version is not None:
            sched.weight_version = update.version
            msg += weight_version_note(update.version)
        log.info(
            "received %d tensors in %.3fs, put in in %.3fs (%s)",
            len(update.names),
            t1 - t0,
            time.monotonic() - t1,
            update.load_format or "per-tensor",
        )
        return True, msg

    def _loadable(self, name: str) -> bool:
        return name in self.model.params or self.model.skips(name)

    def update_weights_from_disk(self, body: dict) -> Answer:
        """SGLang's ``/update_weights_from_disk``: ``{model_path, load_format?, weight_version?,
        abort_all_requests?, flush_cache?}`` -> ``{success, message, num_paused_requests}``. The files are
        read on a worker thread; the copy into the model runs on the engine thread, between two model
        steps (never mid-forward). Every tensor's name and shape are checked before any is copied, so a
        failed load leaves the running weights untouched. ``weight_version`` (when given) is set."""
        path = body.get("model_path")

        def failed(message: str) -> Answer:
            return answer(False, message, num_paused_requests=0)

        if not isinstance(path, str) or not path:
            return failed("update_weights_from_disk: model_path is required")
        try:
            flush = check_bool(body.get("flush_cache", True), "flush_cache")
            version = weight_version_field(body.get("weight_version"), "weight_version")
            abort_all = check_bool(body.get("abort_all_requests", False), "abort_all_requests")
        except RequestError as e:
            return failed(f"update_weights_from_disk: {e}")
        fmt = body.get("load_format")
        if fmt not in (None, "auto", "safetensors"):
            return failed(f"load_format={fmt!r} is not supported by the CPU engine (null, 'auto' or 'safetensors')")
        if abort_all:  # SGLang aborts before the load, whatever its outcome
            self._call(lambda s: s.abort(abort_all=True))
        t0 = time.monotonic()
        try:
            named = read_checkpoint(self.model, Path(path))
        except NoCheckpoint as e:  # SGLang: its loader found no weights to iterate
            return failed(f"Failed to get weights iterator: {e}.")
        except (KeyError, ValueError, OSError) as e:  # SGLang: the load failed (it rolls back; nothing changed here)
            return failed(
                f"Failed to update weights: {e.args[0] if isinstance(e, KeyError) else e}.\n"
                "Rolling back to original weights."
            )

        def apply(s: Scheduler) -> Optional[str]:
            self.model.load_weights(named)  # names and shapes checked in read_checkpoint
            if flush and not s.flush_cache():  # SGLang fails the update call (the weights are in)
                return None
            if version is not None:
                s.weight_version = version
            return s.weight_version

        v = self._call(apply)
        if v is None:
            log.error(FLUSH_REFUSED)
            return failed(FLUSH_REFUSED)
        log.info("loaded %d tensors from %s in %.3fs (weight version %s)", len(named), path, time.monotonic() - t0, v)
        note = weight_version_note(version) if version is not None else ""
        return answer(True, "Succeeded to update model weights." + note, num_paused_requests=0)

    def update_weights_from_tensor(self, body: dict) -> Answer:
        """SGLang's ``/update_weights_from_tensor`` (``tensor_updates.update_from_tensor``)."""
        refused = self.session.refusal("update_weights_from_tensor", body)
        if refused is not None:
            return refused
        loaders = self.custom_weight_loaders
        return update_from_tensor(self.model, body, call=self._call, loaders=loaders, flush_refused=FLUSH_REFUSED)

    def update_weight_version(self, body: dict) -> Answer:
        if "new_version" not in body:
            return answer(False, "new_version is required")
        try:
            v = weight_version_field(body["new_version"], "new_version")
            abort_all = check_bool(body.get("abort_all_requests", True), "abort_all_requests")  # SGLang: True
        except RequestError as e:
            return answer(False, str(e))
        if v is None:
            return answer(False, "new_version must be a string, got None")

        def apply(s: Scheduler) -> None:
            if abort_all:
                s.abort(abort_all=True)
            s.weight_version = v

        self._call(apply)
        return answer(True, f"Weight version updated to {v}", new_version=v)
