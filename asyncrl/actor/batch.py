"""From broker Groups to per-rank micro-batches (pure: no torch.distributed, no model).

- ``Sample`` and ``SAMPLE_FIELDS``: one trajectory as the actor trains it. Its fields beyond the token ids
  (``tokens``, ``prompt_len``) are declared in ``SAMPLE_FIELDS``: the record's trained fields
  (``asyncrl.broker.record``, the one declaration of what travels) and the two the actor derives (advantage,
  aggregation weight); ``groups_to_samples`` and the per-rank ``scatter`` are derived from that list.
- ``groups_to_samples``: one ``Sample`` per trajectory (tensors, from the broker's arrays: no list round
  trip), with its GRPO advantage and the per-token aggregation weights of the *global* batch
  (``global_agg_weights``, the arithmetic of ``asyncrl.actor.loss.aggregation_weights``).
  Aborted groups/trajectories are skipped.
- ``microbatch_extras``: a micro-batch's loss inputs (behaviour logprobs, mask, weights, advantages, and each
  token's staleness against the actor's version, each token's sequence in the micro-batch).
- ``split_balanced``: DP split that balances tokens (longest first onto the lightest rank); each
  rank's list keeps the global order of its samples.
- ``make_microbatches``: consecutive samples packed until the token budget would be exceeded (a
  sample longer than the budget forms a micro-batch of its own).
- ``pack``: one micro-batch as packed tensors (positions restart per sequence; the sequences and
  padding runs as segments, ``cu_seqlens``, from which the block-diagonal causal mask is derived)
  with the indices of the response tokens' predicting positions, and where the padding is (``padding``).
- ``uniform_shape`` / ``pack_uniform``: micro-batches packed to one common ``[rows, row_len]``
  shape (pipeline parallelism sends fixed-shape activations between stages); the extra rows and
  columns are padding that no real token attends to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.actor.loss import grpo_advantages
from asyncrl.broker.record import RESPONSE, SCALAR, SCALAR_TYPES, Field, sample_fields
from asyncrl.broker.types import Group, Trajectory


@dataclass
class Sample:
    """One trajectory as the actor trains it; the per-token fields are CPU tensors aligned with the response."""

    tokens: torch.Tensor
    """prompt + response token ids (int64)."""
    prompt_len: int
    loss_mask: torch.Tensor
    """Per response token: True = trained (bool)."""
    rollout_logprobs: torch.Tensor
    """Per response token: the engine's log-prob (the behaviour policy; float32)."""
    advantage: float
    agg_weight: torch.Tensor
    """Per response token: weight in the global aggregation (0 where masked; float64)."""
    weight_versions: torch.Tensor | None = None
    """Per response token: the weight version that generated it (-1: a tool token; int32). None: unknown (a
    filler); ``microbatch_extras`` then counts the token as fresh."""
    reward: float = 0.0
    routed_experts: torch.Tensor | None = None
    """Per token position (prompt and response): the experts the engine routed it to in every layer, ``[num_tokens,
    layers * top-k]`` int32, layer-major, -1 where unknown (None: not asked; ``actor.moe_routing_replay``)."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


_F8 = np.dtype(np.float64)
_FROM_RECORD = sample_fields()  # the record's fields the actor trains on (``Field.sample``): routing, logprobs, ...
SAMPLE_FIELDS: tuple[Field, ...] = (
    *_FROM_RECORD,
    Field("advantage", SCALAR, _F8),  # derived here: the trajectory's GRPO advantage in its group
    Field("agg_weight", RESPONSE, _F8),  # derived here: the token's weight in the global aggregation
)
"""A ``Sample``'s fields besides its token ids (``dtype``: the one it holds), in the order the scatter sends them."""


# (name, the Python type of a scalar or None, the dtype of an array) of each record field a Sample holds
_CONVERT = tuple((f.name, SCALAR_TYPES[f.dtype.kind] if f.per == SCALAR else None, f.dtype) for f in _FROM_RECORD)


def _trained(t: Trajectory) -> dict:
    """The record's trained fields of ``t`` as a ``Sample`` holds them: one copy of each array into a tensor (an
    absent ``POSITION`` field stays None)."""
    out = {}
    for name, typ, dtype in _CONVERT:
        v = getattr(t, name)
        out[name] = typ(v) if typ is not None else None if v is None else torch.from_numpy(np.array(v, dtype))
    return out


def groups_to_samples(groups: Sequence[Group], *, normalize_adv_by_std: bool, loss_agg_mode: str) -> list[Sample]:
    """Token fields are read as arrays (the broker's zero-copy views, or lists): one copy into tensors each."""
    rows: list[tuple] = []
    for g in groups:
        if g.aborted:
            continue
        trajs = [t for t in g.trajectories if not t.aborted]
        if not trajs:
            continue
        adv = grpo_advantages(torch.tensor([[float(t.reward) for t in trajs]]), normalize_by_std=normalize_adv_by_std)[
            0
        ]
        for t, a in zip(trajs, adv.tolist()):
            if len(t.response_ids):
                rows.append((t, a))
    trained = [_trained(t) for t, _ in rows]
    weights = global_agg_weights([kw["loss_mask"].numpy() for kw in trained], loss_agg_mode)
    return [
        Sample(
            tokens=torch.from_numpy(
                np.concatenate([np.asarray(t.prompt_ids), np.asarray(t.response_ids)], dtype=np.int64)
            ),
            prompt_len=len(t.prompt_ids),
            advantage=float(a),
            agg_weight=torch.from_numpy(w),
            **kw,
        )
        for (t, a), kw, w in zip(rows, trained, weights)
    ]


def global_agg_weights(masks: Sequence[np.ndarray], mode: str) -> list[np.ndarray]:
    """``asyncrl.actor.loss.aggregation_weights`` on boolean arrays, vectorized per sequence (float64): the
    per-token weights of the whole batch so that ``sum(w * loss)`` is the ``mode`` mean."""
    lengths = [int(np.count_nonzero(m)) for m in masks]
    num_seqs = sum(1 for n in lengths if n > 0)
    num_tokens = sum(lengths)
    if mode not in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        raise ValueError(
            f"algorithm.loss_agg_mode={mode!r} is not one of token_mean, seq_mean_token_sum, seq_mean_token_mean"
        )
    out = []
    for m, n in zip(masks, lengths):
        w = m.astype(np.float64)
        if n:
            w /= num_tokens if mode == "token_mean" else num_seqs if mode == "seq_mean_token_sum" else n * num_seqs
        out.append(w)
    return out


def token_staleness(versions: torch.Tensor, actor_version: int) -> torch.Tensor:
    """Per token: ``actor_version - version`` (RLinf's staleness, per token), 0 for a tool token (version -1)."""
    v = versions.to(torch.int64)
    return torch.where(v >= 0, actor_version - v, torch.zeros_like(v))


def microbatch_extras(mb: Sequence[Sample], *, actor_version: int = 0) -> dict[str, torch.Tensor]:
    """The loss's per-token inputs of one micro-batch, in its samples' order (CPU tensors); ``staleness`` is each
    token's against ``actor_version`` (the actor's version at the start of the step)."""
    versions = [
        s.weight_versions if s.weight_versions is not None else torch.full((s.response_len,), actor_version) for s in mb
    ]
    return {
        "staleness": token_staleness(torch.cat(versions), actor_version),
        "seq": torch.repeat_interleave(
            torch.arange(len(mb)), torch.tensor([s.response_len for s in mb], dtype=torch.long)
        ),
        "behav": torch.cat([s.rollout_logprobs for s in mb]).to(torch.float32),
        "mask": torch.cat([s.loss_mask for s in mb]).to(torch.bool),
        "agg": torch.cat([s.agg_weight for s in mb]).to(torch.float32),
        "adv": torch.repeat_interleave(
            torch.tensor([s.advantage for s in mb], dtype=torch.float32),
            torch.tensor([s.response_len for s in mb], dtype=torch.long),
        ),
    }


def split_balanced(token_counts: Sequence[int], num_parts: int) -> list[list[int]]:
    """Indices per part, balancing the sum of token counts (greedy, longest first)."""
    loads = [0] * num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        k = min(range(num_parts), key=lambda j: (loads[j], j))
        parts[k].append(i)
        loads[k] += token_counts[i]
    return [sorted(p) for p in parts]


def make_microbatches(token_counts: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive indices grouped so each group's token sum is <= max_tokens (or is one sample)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, n in enumerate(token_counts):
        if cur and size + n > max_tokens:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


@dataclass
class PackedBatch:
    """Sequences packed into rows of ``row_len`` tokens: [R, C], each sequence its own causal block.

    Attention costs R * C^2 (not (sum of lengths)^2 as a single packed row would), and the
    padding is at most one row's worth of waste per row. The block structure is kept as segments
    of the flattened ``R * C`` tokens (``cu_seqlens``): every sequence, and every run of padding,
    is one segment; fused attention (``asyncrl.actor.layer_spec``) reads the segments, the unfused
    reference reads the dense ``attention_mask`` built from them.
    """

    input_ids: torch.Tensor  # [R, C]
    position_ids: torch.Tensor  # [R, C] restart at 0 for every sequence
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32: segment starts in the flattened R*C tokens
    max_seqlen: int
    """Longest segment."""
    pred_index: torch.Tensor  # [T] flat index (into R*C) of the position predicting each response token
    labels: torch.Tensor  # [T] the response tokens
    seq_of_token: torch.Tensor  # [T] index (within the micro-batch) of each token's sequence
    num_tokens: int
    """Real tokens (padding excluded)."""
    padding: torch.Tensor | None = None
    """[R, C] bool, True = a padding position (None: there is none). A MoE layer leaves them out of its
    load-balancing loss (megatron-core's ``padding_mask``), the routing metrics leave them uncounted."""
    seq_start: torch.Tensor | None = None
    """[num sequences] flat index (into R*C) of each sequence's first token."""
    routed: torch.Tensor | None = None
    """[R, C, layers * top-k] the experts to replay at each position (``with_routing``; -1: unknown, padding)."""

    @property
    def attention_mask(self) -> torch.Tensor:
        """[R, 1, C, C] bool, True = masked out: block-diagonal causal, one block per segment."""
        R, C = self.input_ids.shape
        dev = self.input_ids.device
        seg = torch.repeat_interleave(
            torch.arange(len(self.cu_seqlens) - 1, device=dev), (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(dev)
        ).view(R, C)
        causal = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=1)
        return ((seg[:, :, None] != seg[:, None, :]) | causal)[:, None]

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
            pred_index=self.pred_index.to(device),
            labels=self.labels.to(device),
            seq_of_token=self.seq_of_token.to(device),
            num_tokens=self.num_tokens,
            padding=None if self.padding is None else self.padding.to(device),
            seq_start=self.seq_start,
            routed=None if self.routed is None else self.routed.to(device),
        )


def _cu_seqlens(seg_lens: Sequence[int]) -> torch.Tensor:
    cu = [0]
    for n in seg_lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _rows_first_fit(lengths: Sequence[int], cap: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(cap - lengths[i])
    return rows


def pack(seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], *, row_len: int | None = None) -> PackedBatch:
    """Pack sequences (tensors, arrays or lists; first fit, longest first) into rows of ``row_len`` (default:
    the longest)."""
    seqs = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
    lengths = [len(s) for s in seqs]
    cap = max(max(lengths), row_len or 0)
    rows = _rows_first_fit(lengths, cap)
    R = len(rows)
    ids = torch.zeros(R, cap, dtype=torch.long)
    pos = torch.zeros(R, cap, dtype=torch.long)
    seg_lens: list[int] = []
    where: dict[int, tuple[int, int]] = {}
    ramp = torch.arange(cap)
    padding = torch.zeros(R, cap, dtype=torch.bool)
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            n = lengths[i]
            ids[r, off : off + n] = seqs[i]
            pos[r, off : off + n] = ramp[:n]
            seg_lens.append(n)
            where[i] = (r, off)
            off += n
        if off < cap:  # padding: its own causal block, so no query row is fully masked
            seg_lens.append(cap - off)
            padding[r, off:] = True
    pred, labels, seq_idx, starts = [], [], [], []
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        if p < 1:
            raise ValueError("every sequence needs at least one prompt token")
        r, off = where[i]
        base = r * cap + off
        starts.append(base)
        pred.append(torch.arange(base + p - 1, base + len(s) - 1))
        labels.append(s[p:])
        seq_idx.append(torch.full((len(s) - p,), i, dtype=torch.long))
    return PackedBatch(
        input_ids=ids,
        position_ids=pos,
        cu_seqlens=_cu_seqlens(seg_lens),
        max_seqlen=max(seg_lens),
        pred_index=torch.cat(pred),
        labels=torch.cat(labels),
        seq_of_token=torch.cat(seq_idx),
        num_tokens=sum(lengths),
        padding=padding if bool(padding.any()) else None,
        seq_start=torch.tensor(starts, dtype=torch.long),
    )


def with_routing(packed: PackedBatch, routed: Sequence[torch.Tensor | None]) -> PackedBatch:
    """``packed`` with ``routed``: each sequence's ``[len, width]`` experts (``Sample.routed_experts``, in the order
    the sequences were given to ``pack``; None: unknown) at its positions, -1 elsewhere. Unchanged when none is
    known."""
    known = [r for r in routed if r is not None]
    if not known:
        return packed
    R, C = packed.input_ids.shape
    width = known[0].shape[1]
    flat = torch.full((R * C, width), -1, dtype=torch.int32)
    for start, r in zip(packed.seq_start.tolist(), routed):
        if r is not None:
            if r.shape[1] != width:
                raise ValueError(f"routed experts: a sequence has rows of {r.shape[1]} experts, another {width}")
            flat[start : start + len(r)] = r
    packed.routed = flat.view(R, C, width).to(packed.input_ids.device)
    return packed


def pad_rows(packed: PackedBatch, rows: int) -> PackedBatch:
    """Append padding rows (token 0, each row its own causal block) up to ``rows`` rows."""
    R, C = packed.input_ids.shape
    if rows < R:
        raise ValueError(f"pad_rows: the batch has {R} rows, more than {rows}")
    if rows == R:
        return packed
    extra = rows - R
    tail = packed.cu_seqlens[-1] + C * torch.arange(1, extra + 1, dtype=packed.cu_seqlens.dtype)
    first = torch.zeros(R, C, dtype=torch.bool) if packed.padding is None else packed.padding
    return PackedBatch(
        input_ids=torch.cat([packed.input_ids, torch.zeros(extra, C, dtype=packed.input_ids.dtype)]),
        position_ids=torch.cat([packed.position_ids, torch.arange(C).expand(extra, C)]),
        cu_seqlens=torch.cat([packed.cu_seqlens, tail]),
        max_seqlen=max(packed.max_seqlen, C),
        pred_index=packed.pred_index,  # flat indices of the first R rows are unchanged
        labels=packed.labels,
        seq_of_token=packed.seq_of_token,
        num_tokens=packed.num_tokens,
        padding=torch.cat([first, torch.ones(extra, C, dtype=torch.bool)]),
        seq_start=packed.seq_start,
    )


def uniform_shape(mbs: Sequence[Sequence[Sequence[int]]]) -> tuple[int, int]:
    """``(rows, row_len)`` that every micro-batch (a list of sequences) fits when packed at that row length."""
    if not mbs:
        return 0, 0
    row_len = max(len(s) for seqs in mbs for s in seqs)
    rows = max(len(_rows_first_fit([len(s) for s in seqs], row_len)) for seqs in mbs)
    return rows, row_len


def pack_uniform(
    mbs: Sequence[tuple[Sequence[Sequence[int]], Sequence[int]]], *, rows: int, row_len: int
) -> list[PackedBatch]:
    """Each ``(sequences, prompt_lens)`` micro-batch packed to exactly ``[rows, row_len]``."""
    return [pad_rows(pack(seqs, pl, row_len=row_len), rows) for seqs, pl in mbs]
