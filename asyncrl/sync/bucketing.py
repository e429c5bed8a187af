"""Buckets of named tensors for the weight sync (pure: no I/O, no process groups).

Contract
- ``iter_buckets(named, bucket_bytes)`` groups ``(hf_name, tensor)`` pairs, in order, into lists
  whose total size stays within ``bucket_bytes``; a tensor larger than the limit travels alone.
  Order is preserved: the engine receives tensors in exactly the order of ``names``. The final
  bucket is a ``LastBucket`` (a plain list that also says no bucket follows), known for free: it is
  yielded once the input ran out. The sender lets that bucket's update call carry the new weight
  version (SGLang's ``weight_version`` field), which saves the sync one HTTP round trip per engine.
- ``BucketMeta`` is what ``/update_weights_from_distributed`` needs (``names``, ``dtypes`` as
  SGLang spells them, e.g. ``"bfloat16"``, ``shapes``) and ``update_request`` builds that body.
- Flattened-bucket option (``load_format = "flattened_bucket"``, as SGLang's engine reads it):
  the bucket travels as ONE 1-D ``uint8`` tensor, the raw bytes of every tensor
  (``t.contiguous().view(-1).view(torch.uint8)``) concatenated in ``names`` order with no padding;
  the receiver allocates ``flat_nbytes(meta)`` bytes, receives them, and cuts them back with
  ``unflatten_bucket`` (per tensor: its byte range, viewed as its dtype, reshaped).

    for bucket in iter_buckets(model.state_dict().items(), bucket_bytes=512 << 20):
        meta = bucket_meta(bucket)
        flat = flatten_bucket(bucket)            # sender
        tensors = unflatten_bucket(flat, meta)   # receiver: [(name, tensor), ...]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

Bucket = list[tuple[str, torch.Tensor]]


class LastBucket(list):
    """The final bucket of an ``iter_buckets`` stream (no bucket follows it); otherwise a plain bucket."""


FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format value for one-flat-tensor buckets

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPE_NAMES[torch.float8_e4m3fn] = "float8_e4m3fn"
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"weight sync: unsupported tensor dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; also accepts ``"torch.bfloat16"``."""
    key = name.removeprefix("torch.")
    try:
        return _NAME_DTYPES[key]
    except KeyError:
        raise ValueError(f"weight sync: unknown dtype name {name!r}") from None


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Greedy, order-preserving grouping of ``(name, tensor)`` pairs into <= ``bucket_bytes`` lists.

    A tensor bigger than ``bucket_bytes`` forms a bucket of its own. Empty input yields nothing; the
    final bucket is a ``LastBucket``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"sync.bucket_bytes must be > 0, got {bucket_bytes!r}")
    bucket: Bucket = []
    size = 0
    for name, t in named:
        n = tensor_nbytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield LastBucket(bucket)


@dataclass(frozen=True)
class BucketMeta:
    """What the engine needs to receive one bucket: names, dtypes and shapes, in send order."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return flat_nbytes(self)


def bucket_meta(bucket: Bucket) -> BucketMeta:
    if not bucket:
        raise ValueError("weight sync: empty bucket")
    names = tuple(n for n, _ in bucket)
    if len(set(names)) != len(names):
        raise ValueError(f"weight sync: duplicate tensor names in one bucket: {names}")
    return BucketMeta(
        names=names,
        dtypes=tuple(dtype_name(t.dtype) for _, t in bucket),
        shapes=tuple(tuple(int(s) for s in t.shape) for _, t in bucket),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def byte_ranges(meta: BucketMeta) -> list[tuple[int, int]]:
    """``[start, end)`` byte offsets of each tensor inside the flattened bucket."""
    out = []
    pos = 0
    for dtype, shape in zip(meta.dtypes, meta.shapes):
        n = _numel(shape) * torch.empty((), dtype=dtype_from_name(dtype)).element_size()
        out.append((pos, pos + n))
        pos += n
    return out


def flat_nbytes(meta: BucketMeta) -> int:
    ranges = byte_ranges(meta)
    return ranges[-1][1] if ranges else 0


def flatten_bucket(bucket: Bucket) -> torch.Tensor:
    """One 1-D uint8 tensor holding every tensor's bytes in order (no padding), on their device."""
    if not bucket:
        raise ValueError("weight sync: empty bucket")
    parts = [t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unflatten_bucket(flat: torch.Tensor, meta: BucketMeta) -> Bucket:
    """Cut a received flat uint8 tensor back into ``(name, tensor)`` (views where the byte offset is
    aligned to the dtype's size, copies where it is not: the wire format has no padding)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"weight sync: flat bucket must be 1-D uint8, got {flat.dtype} {tuple(flat.shape)}")
    ranges = byte_ranges(meta)
    if flat.numel() != (ranges[-1][1] if ranges else 0):
        raise ValueError(f"weight sync: flat bucket has {flat.numel()} bytes, metadata says {flat_nbytes(meta)}")
    out: Bucket = []
    for name, dtype, shape, (a, b) in zip(meta.names, meta.dtypes, meta.shapes, ranges):
        dt = dtype_from_name(dtype)
        part = flat[a:b]
        if (flat.storage_offset() + a) % part.new_empty((), dtype=dt).element_size():
            part = part.clone()
        out.append((name, part.view(dt).view(shape)))
    return out


def update_request(
    meta: BucketMeta,
    *,
    group_name: str,
    flush_cache: bool,
    flattened: bool,
    weight_version: Optional[str] = None,
) -> dict:
    """The JSON body of ``POST /update_weights_from_distributed`` for this bucket."""
    return {
        "names": list(meta.names),
        "dtypes": list(meta.dtypes),
        "shapes": [list(s) for s in meta.shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
        "load_format": FLATTENED_BUCKET if flattened else None,
    }
