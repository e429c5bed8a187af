"""The CPU engine's KV cache: one row per running request, each layer's keys and values, and (for a
mixture-of-experts model whose engine returns routed experts) each cached token's experts.

    kv = KVPool(model.spec, max_rows=8)                  # grows its capacity on demand
    kv.ensure_capacity(1000)
    saved = kv.read_row(0, 12)                           # copies of row 0's first 12 positions (the prefix cache's)
    kv.write_row(3, saved, 12)

Pure torch (no I/O); the decoder (``model``) writes and reads the rows in its forward.
"""

from __future__ import annotations

from typing import Optional

import torch

from asyncrl.models.spec import ModelSpec


class KVPool:
    """Per-request KV rows: k[layer] and v[layer] are [max_rows, kv_heads, capacity, head_dim].

    A running request owns one row; the scheduler keeps running requests in rows 0..n-1 (it moves
    a row when one finishes). ``capacity`` grows on demand (``ensure_capacity``). With ``routing`` (a
    mixture-of-experts model), ``routed`` [max_rows, capacity, layers, top-k] int32 holds the experts each cached
    token was routed to in each layer (-1 in a dense layer), kept, moved and copied with the row's KV.
    """

    GROW_TOKENS = 256  # capacity is rounded up to this: fewer reallocations, little waste

    def __init__(self, spec: ModelSpec, max_rows: int, capacity: int = 256, *, routing: bool = False):
        if routing and not spec.is_moe:
            raise ValueError(
                f"{spec.source}: model_type={spec.model_type!r} has no experts: routing capture "
                "(--enable-return-routed-experts) needs a mixture-of-experts model"
            )
        self.spec = spec
        self.max_rows = max_rows
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.routed: Optional[torch.Tensor] = None
        if routing:
            self.routed = torch.empty(max_rows, 0, spec.num_layers, spec.num_experts_per_tok, dtype=torch.int32)
        self.ensure_capacity(capacity)

    def ensure_capacity(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        cap = -(-tokens // self.GROW_TOKENS) * self.GROW_TOKENS
        s = self.spec
        shape = (self.max_rows, s.num_query_groups, cap, s.head_dim)
        for store in (self.k, self.v):
            for layer in range(s.num_layers):
                new = torch.zeros(shape, dtype=torch.float32)
                if store and len(store) > layer:
                    new[:, :, : self.capacity].copy_(store[layer])
                    store[layer] = new
                else:
                    store.append(new)
        if self.routed is not None:
            new = torch.full((self.max_rows, cap, s.num_layers, s.num_experts_per_tok), -1, dtype=torch.int32)
            new[:, : self.capacity].copy_(self.routed)
            self.routed = new
        self.capacity = cap

    def move_row(self, src: int, dst: int, length: int) -> None:
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :length].copy_(t[src, :, :length])
        if self.routed is not None:
            self.routed[dst, :length].copy_(self.routed[src, :length])

    def read_row(self, row: int, length: int) -> tuple[torch.Tensor, ...]:
        """Copies of one row's first ``length`` positions: ([L, kvh, length, d], same) (``stack`` copies), and
        their routing [length, L, top-k] when the pool keeps it."""
        kv = torch.stack([t[row, :, :length] for t in self.k]), torch.stack([t[row, :, :length] for t in self.v])
        return kv if self.routed is None else (*kv, self.routed[row, :length].clone())

    def write_row(self, row: int, saved: tuple[torch.Tensor, ...], length: int) -> None:
        """Write what ``read_row`` returned (of a pool of the same spec and routing) into ``row``'s first
        ``length`` positions."""
        self.ensure_capacity(length)
        k_L, v_L = saved[:2]
        for layer in range(self.spec.num_layers):
            self.k[layer][row, :, :length].copy_(k_L[layer, :, :length])
            self.v[layer][row, :, :length].copy_(v_L[layer, :, :length])
        if self.routed is not None:
            self.routed[row, :length].copy_(saved[2][:length])
