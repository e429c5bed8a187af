"""The one safetensors reader (and writer) of the project.

Contract
- ``SafetensorsReader(source)``: lazy, memory-mapped access to the tensors of
  - a HF checkpoint directory: the shards ``model.safetensors.index.json`` names, else every
    ``*.safetensors`` in it (``model.safetensors`` alone, usually);
  - one ``.safetensors`` file, or a list of files (the actor's per-rank shards).
  ``keys()`` in file order, ``name in reader``, ``get(name)`` (one tensor, read when asked), ``items()``
  (every tensor, file by file), ``to_dict()``. A directory without weights, a missing file or an unknown
  name is an error naming the path. Used by the actor (load, checkpoints), the converter, the CPU engine
  and the plain-PyTorch decoder (warm start).
- ``save_safetensors(tensors, path)``: writes atomically (a ``.tmp`` file renamed into place), contiguous CPU
  copies, ``{"format": "pt"}`` metadata (what transformers and SGLang expect).

    reader = SafetensorsReader("runs/tiny/model")
    w = reader.get("model.embed_tokens.weight")
    for name, t in reader.items(): ...
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def _files_of(source: str | Path | Sequence[str | Path]) -> tuple[Path, list[Path]]:
    if isinstance(source, (str, Path)):
        p = Path(source)
        if p.is_dir():
            index = p / INDEX
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
                files = [p / f for f in dict.fromkeys(weight_map.values())]
            else:
                files = sorted(p.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{str(p)!r}: no model.safetensors (or {INDEX}) in this directory")
            return p, files
        return p, [p]
    files = [Path(f) for f in source]
    return (files[0].parent if files else Path(".")), files


class SafetensorsReader:
    """Lazy access to the tensors of safetensors files (see the module contract)."""

    def __init__(self, source: str | Path | Sequence[str | Path]):
        self.path, self.files = _files_of(source)
        for f in self.files:
            if not f.is_file():
                raise ValueError(f"safetensors file {str(f)!r} is missing")
        self._where: dict[str, Path] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self._where.setdefault(k, f)
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise KeyError(f"{name!r} is not in the safetensors of {str(self.path)!r}")
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(name)  # type: ignore[attr-defined]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, file by file (one file's handle open at a time)."""
        for f in self.files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    if self._where[k] == f:
                        yield k, h.get_tensor(k)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.items())


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path
