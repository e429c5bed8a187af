"""The CPU engine's prefix cache: finished requests' KV keyed by their token sequence, LRU-bounded in tokens.

    cache = PrefixCache(max_tokens=32768)
    cache.insert((1, 2, 3, 4, 5), k_L, v_L)       # KVPool.read_row: [layers, kv_heads, 5, head_dim] each (+ routing)
    cache.lookup([1, 2, 3, 4, 9], limit=4)        # -> (4, (k_L, v_L)): the longest common prefix

Only prefixes of at least ``MIN_PREFIX_TOKENS`` tokens count (the scheduler reuses no shorter one): entries are
indexed by their first ``MIN_PREFIX_TOKENS`` tokens, so a lookup compares only the entries that share them (none,
for unrelated prompts), and a common prefix is measured by tuple slice comparisons (C speed), not token by token.

Pure (no I/O).
"""

from __future__ import annotations

import collections
from typing import Optional

import torch

# A finished request's KV goes to the prefix cache only when it has at least this many tokens; a shorter common
# prefix is never reused.
MIN_PREFIX_TOKENS = 4
MAX_PREFIX_ENTRIES = 512  # entries sharing a head are scanned at each lookup: keep it short


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples: one whole comparison, else a bisection over slice
    comparisons (each compares only the part not yet known to match: O(length) in all)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """Finished requests' KV keyed by their token sequence, LRU-bounded in tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: collections.OrderedDict[tuple[int, ...], tuple[torch.Tensor, ...]] = collections.OrderedDict()
        self.by_head: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}
        """The keys by their first MIN_PREFIX_TOKENS tokens, each group in LRU order (as ``entries``)."""
        self.tokens = 0

    def insert(self, key: tuple[int, ...], *saved: torch.Tensor) -> None:
        """Keep ``saved``, the row of the tokens ``key`` as ``KVPool.read_row`` returns it (k, v, [routing])."""
        if self.max_tokens <= 0 or len(key) > self.max_tokens or len(key) < MIN_PREFIX_TOKENS or key in self.entries:
            return
        self.entries[key] = saved
        self.by_head.setdefault(key[:MIN_PREFIX_TOKENS], {})[key] = None
        self.tokens += len(key)
        while self.tokens > self.max_tokens or len(self.entries) > MAX_PREFIX_ENTRIES:
            old, _ = self.entries.popitem(last=False)
            self.tokens -= len(old)
            group = self.by_head[old[:MIN_PREFIX_TOKENS]]
            del group[old]
            if not group:
                del self.by_head[old[:MIN_PREFIX_TOKENS]]

    def lookup(self, tokens: list[int], limit: int) -> tuple[int, Optional[tuple[torch.Tensor, ...]]]:
        """Longest common prefix (capped at ``limit``) with any entry, and that entry's KV (the least recently used
        of equals); (0, None) when no entry shares ``MIN_PREFIX_TOKENS`` tokens with ``tokens[:limit]``."""
        if limit < MIN_PREFIX_TOKENS or len(tokens) < MIN_PREFIX_TOKENS:
            return 0, None
        group = self.by_head.get(tuple(tokens[:MIN_PREFIX_TOKENS]))
        if not group:
            return 0, None
        t = tuple(tokens[:limit])
        best, best_key = 0, None
        for key in group:
            lcp = common_prefix_len(key, t)
            if lcp > best:
                best, best_key = lcp, key
        assert best_key is not None  # every key of the group shares MIN_PREFIX_TOKENS tokens with t
        self.entries.move_to_end(best_key)
        del group[best_key]
        group[best_key] = None
        return best, self.entries[best_key]

    def clear(self) -> None:
        self.entries.clear()
        self.by_head.clear()
        self.tokens = 0
