"""The ``serialized_named_tensors`` of SGLang's ``/update_weights_from_tensor``, by value (pure: no I/O).

Contract
- SGLang reads each entry with ``MultiprocessingSerializer.deserialize`` (base64 -> its ``SafeUnpickler``, an
  allow-list: torch's tensor rebuild functions, ``collections.OrderedDict``, and ``torch.storage._load_from_bytes``
  redirected to a ``weights_only`` load). SGLang's own ``serialize`` uses ``ForkingPickler``, which sends a CPU
  tensor as a shared-memory handle (a file descriptor passed through the sender's ``resource_sharer``): it only
  works from a live process on the same machine. ``serialize_named_tensors`` pickles with the plain pickler
  instead, so every tensor travels by value (its bytes in the payload, ``torch.save``'s format) and the payload
  can cross machines; SGLang's unpickler reads it unchanged (``tools/check_sglang.py`` checks that).
- ``deserialize_named_tensors`` is the CPU engine's reader: the same allow-list idea (only what a list of
  ``(name, tensor)`` pickles to), storages read with ``torch.load(weights_only=True)``; anything else is refused.
- Every tensor is copied (contiguous, CPU) before pickling: a view would carry its whole base storage.
- ``pack_named_tensors`` / ``unpack_named_tensors``: many small tensors as two uint8 entries (``PACK_HEADER``: JSON
  of each tensor's name, dtype, shape and byte range; ``PACK_DATA``: their bytes back to back), since each pickled
  tensor costs a ``torch.save`` archive (~0.5 ms and ~400 bytes each way); an unpack of entries without them is the
  identity.

    body = {"serialized_named_tensors": [serialize_named_tensors(named)] * tp_size, "load_format": ...}
    named = deserialize_named_tensors(body["serialized_named_tensors"][0])   # engine side
    named = unpack_named_tensors(pack_named_tensors(named))                  # the same tensors
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
from collections import OrderedDict
from collections.abc import Iterable

import torch

_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
}


PACK_HEADER = "asyncrl.pack.header"
PACK_DATA = "asyncrl.pack.data"


class PayloadError(ValueError):
    """A ``serialized_named_tensors`` entry that is not a readable list of ``(name, tensor)``."""


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Base64 of the plain pickle of ``[(name, tensor), ...]`` (see module contract)."""
    items = [(n, t.detach().to("cpu").contiguous().clone()) for n, t in named]
    return base64.b64encode(pickle.dumps(items, protocol=4)).decode("ascii")


def _load_storage(b: bytes):
    return torch.load(io.BytesIO(b), weights_only=True)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) in _ALLOWED:
            return OrderedDict if module == "collections" else super().find_class(module, name)
        raise PayloadError(f"serialized_named_tensors: refused global {module}.{name}")


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``serialize_named_tensors`` (``PayloadError`` on anything else)."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
        items = _Unpickler(io.BytesIO(raw)).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, RuntimeError, TypeError) as e:
        raise PayloadError(f"serialized_named_tensors: unreadable ({type(e).__name__}: {e})") from None
    ok = isinstance(items, list) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor) for p in items
    )
    if not ok:
        raise PayloadError("serialized_named_tensors: not a list of (name, tensor) pairs")
    return items


def pack_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` as the two entries ``PACK_HEADER`` and ``PACK_DATA`` (see module contract)."""
    header, parts, pos = [], [], 0
    for n, t in named:
        b = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        header.append([n, str(t.dtype).removeprefix("torch."), list(t.shape), pos, pos + b.numel()])
        parts.append(b)
        pos += b.numel()
    head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    data = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return [(PACK_HEADER, head), (PACK_DATA, data)]


def unpack_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``pack_named_tensors`` (entries other than the two pass through, in order; ``PayloadError`` on a
    header that does not fit its data)."""
    named = list(named)
    found = dict((n, t) for n, t in named if n in (PACK_HEADER, PACK_DATA))
    if not found:
        return named
    try:
        header = json.loads(bytes(found[PACK_HEADER].to("cpu").tolist()).decode())
        data = found[PACK_DATA].to("cpu")
        out = []
        for n, dtype, shape, a, b in header:
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype) or not 0 <= a <= b <= data.numel():
                raise ValueError(f"entry {n!r}: dtype {dtype!r}, bytes {a}..{b} of {data.numel()}")
            out.append((n, data[a:b].clone().view(dt).view(shape)))
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise PayloadError(f"packed tensors: unreadable ({type(e).__name__}: {e})") from None
    return out + [(n, t) for n, t in named if n not in found]
