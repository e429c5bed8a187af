"""The CPU engine's prefix cache: finished requests' KV keyed by their token sequence, LRU-bounded in tokens.

    cache = PrefixCache(max_tokens=32768)
    cache.insert((1, 2, 3, 4), k_L, v_L)        # [layers, kv_heads, 4, head_dim] each
    cache.lookup([1, 2, 3, 9], limit=3)        # -> (3, (k_L, v_L)): the longest common prefix

Pure (no I/O).
"""

from __future__ import annotations

import collections
from typing import Optional

import torch

# A finished request's KV goes to the prefix cache only when it has at least this many tokens.
MIN_PREFIX_TOKENS = 4
MAX_PREFIX_ENTRIES = 512  # linear-scan lookup: keep it short


class PrefixCache:
    """Finished requests' KV keyed by their token sequence, LRU-bounded in tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: collections.OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = (
            collections.OrderedDict()
        )
        self.tokens = 0

    def insert(self, key: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        if self.max_tokens <= 0 or len(key) > self.max_tokens or key in self.entries:
            return
        self.entries[key] = (k, v)
        self.tokens += len(key)
        while self.tokens > self.max_tokens or len(self.entries) > MAX_PREFIX_ENTRIES:
            old, _ = self.entries.popitem(last=False)
            self.tokens -= len(old)

    def lookup(self, tokens: list[int], limit: int) -> tuple[int, Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """Longest common prefix (capped at ``limit``) with any entry, and that entry's KV."""
        best, best_kv, best_key = 0, None, None
        if not self.entries or limit <= 0:
            return 0, None
        x = torch.tensor(tokens[:limit])
        for key, kv in self.entries.items():
            if key[0] != tokens[0]:
                continue
            m = min(len(key), limit)
            neq = (torch.tensor(key[:m]) != x[:m]).nonzero()
            lcp = int(neq[0]) if len(neq) else m
            if lcp > best:
                best, best_kv, best_key = lcp, kv, key
        if best_key is not None:
            self.entries.move_to_end(best_key)
        return best, best_kv

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
