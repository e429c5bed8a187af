"""The engine side of the delta sync: an SGLang ``--custom-weight-loader`` that applies deltas and checks them.

Runs inside the engine: SGLang 0.5.23's ``/update_weights_from_tensor`` with ``load_format = LOADER`` (registered
with ``--custom-weight-loader asyncrl.sync.delta_loader.load_delta``) imports it (``dynamic_import``) and calls
``load_delta(model, named_tensors)`` on every TP rank, each value already moved ``.to(device)``; the CPU engine
calls the same function the same way. It imports neither sglang nor CUDA.

Contract
- ``named_tensors`` holds, by name: whole tensors (``name``), deltas (``name`` + ``delta.SUFFIXES``, the codec's
  wire form) and one reserved entry ``REPORT`` (uint8, the UTF-8 path prefix of the report file); the tensors may
  come packed in two entries (``tensor_payload.pack_named_tensors``).
- The loader keeps its own base: the last value of every HF-named tensor it received (``delta`` values are
  applied to it, never to the model's fused, possibly sharded, parameters), host memory, the wire dtype: one
  more copy of the weights per TP rank. A whole tensor replaces the base; a delta is applied to it
  (``delta.apply``) and checked against its checksum. What passed goes to ``model.load_weights`` (the model's
  own loader: fusing and TP slicing as on a checkpoint load).
- A delta that fails (checksum, unreadable, or no base: the engine restarted, or never got that tensor) changes
  nothing, neither the model nor the base. It is not raised: an exception in a custom loader kills SGLang's
  scheduler (nothing catches it) and its answer is "Success" whatever the loader did. So the loader writes its
  outcome to ``<report prefix>.rank<R>.json`` (R: this process's torch.distributed rank, 0 without one;
  written atomically): ``{"failed": {name: reason}, "loaded": n}``, which the sender reads (same node or a shared
  filesystem: ``docs/weight_sync.md``).

    load_delta(model, [("model.norm.weight", t), *to_tensors(d, "lm_head.weight").items(), (REPORT, path_u8)])
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from asyncrl.cluster.tensor_payload import unpack_named_tensors
from asyncrl.config.schema import DELTA_LOADER
from asyncrl.sync import delta as codec

log = logging.getLogger(__name__)

LOADER = DELTA_LOADER
"""The import path to register with ``--custom-weight-loader`` and send as ``load_format`` (this module's
``load_delta``)."""
REPORT = "asyncrl.delta.report"
"""The reserved entry naming where the loader writes its report."""

_BASES: weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def path_tensor(path: str) -> torch.Tensor:
    """``REPORT``'s value for a report path prefix."""
    return torch.tensor(list(path.encode()), dtype=torch.uint8)


def report_file(prefix: str | Path, rank: int) -> Path:
    return Path(f"{prefix}.rank{rank}.json")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def split_entries(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]], Optional[str]]:
    """Whole tensors, deltas (by tensor name: their wire parts) and the report prefix of one call."""
    whole, parts, report = [], {}, None
    for name, t in named:
        if name == REPORT:
            report = bytes(t.to("cpu", torch.uint8).tolist()).decode()
            continue
        suffix = next((s for s in codec.SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            whole.append((name, t))
        else:
            parts.setdefault(name[: -len(suffix)], {})[name] = t
    return whole, parts, report


def load_delta(model: Any, named_tensors: Any) -> None:
    """SGLang's custom-loader signature (see module contract)."""
    base = _BASES.setdefault(model, {})
    whole, parts, report = split_entries(unpack_named_tensors(named_tensors))
    loaded: list[tuple[str, torch.Tensor]] = []
    for name, t in whole:
        base[name] = t.detach().to("cpu").clone()
        loaded.append((name, t))
    failed: dict[str, str] = {}
    for name, wire in parts.items():
        old = base.get(name)
        if old is None:
            failed[name] = "no base: this engine has not received the tensor whole since it started"
            continue
        try:
            new = codec.apply(old, codec.from_tensors({k: v.to("cpu") for k, v in wire.items()}, name), name=name)
        except codec.ChecksumError as e:
            failed[name] = str(e)
            continue
        base[name] = new
        loaded.append((name, new))
    if loaded:
        model.load_weights(loaded)
    if failed:
        log.error("delta loader: %d tensors failed and were left as they were: %s", len(failed), sorted(failed))
    if report is not None:
        path = report_file(report, _rank())
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"failed": failed, "loaded": len(loaded)}))
        os.replace(tmp, path)
