"""RoPE frequencies of a ``ModelSpec``: plain, ``linear`` and ``llama3`` scaling (as HF transformers computes them).

Shared by the CPU engine (``asyncrl.cpu_engine.model``) and the plain-PyTorch decoder
(``asyncrl.models.torch_decoder``), so both rotate by exactly the same angles.

    inv_freq = rope_inv_freq(spec)            # [head_dim / 2], fp32
    angles = positions[:, None] * inv_freq    # cos/sin of cat(angles, angles) rotate q and k
"""

from __future__ import annotations

import math

import torch

from asyncrl.models.spec import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    rs = spec.rope_scaling
    if rs is None:
        return inv
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv / factor
    assert rs["rope_type"] == "llama3", rs  # the consumers refuse other types (asyncrl.models.spec.require)
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)
