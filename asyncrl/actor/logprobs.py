"""Log-probs and entropy of response tokens under tensor parallelism (vocab-parallel logits).

``vocab_parallel_logprobs(logits_local, labels, ...)`` works on this TP rank's vocabulary slice
``[vocab_start, vocab_start + V_local)`` and returns the full-vocabulary log-prob of each label
and (optionally) the entropy, identical on every TP rank. Columns at or past ``true_vocab`` (the
padding added so the vocabulary divides by TP) are excluded from the softmax. Differentiable:
the sums across TP are all-reduced in the forward and the backward is local to the slice (a hand-written
autograd function), the right gradient when every TP rank computes the same loss (Megatron's convention).

``logprobs_from_logits(logits, packed, ...)``: the log-probs (and entropies) of one packed micro-batch's response
tokens from the last pipeline stage's response logits (``asyncrl.actor.layer_spec.response_logits``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from asyncrl.actor.batch import PackedBatch

# Lazy imports here: megatron-core is imported inside the functions that use it; its import takes seconds
# and probes CUDA, and this module's pure parts (and --dry-run, the tests of them) must import without it.

_NEG = -1e30  # "minus infinity" that keeps 0 * logit finite in the entropy


class _VocabParallelLogProbs(torch.autograd.Function):
    """Log-prob of each label and (optionally) the entropy from this rank's vocabulary slice, with a
    hand-written backward: one ``exp`` pass forward, the softmax ``p`` (and the shifted logits ``zs``, for the
    entropy) kept, and the gradient in three passes over ``[N, V_local]``:
    ``d logp / dz = onehot - p``, ``d ent / dz = -p * (log p + ent)`` with ``log p = zs - log Z``.
    The sums across TP are all-reduced in the forward only (one all-reduce of the stacked sums): every TP
    rank computes the same loss, and each rank's gradient is that of its own slice (Megatron's convention)."""

    @staticmethod
    def forward(ctx, z, labels, vocab_start, tp_group, tp, with_entropy):
        v_local = z.shape[-1]
        m = z.max(dim=-1, keepdim=True).values
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        zs = z - m
        e = torch.exp(zs)
        local = labels - vocab_start
        in_range = (local >= 0) & (local < v_local)
        idx = local.clamp(0, v_local - 1).unsqueeze(-1)
        sums = [e.sum(dim=-1), torch.gather(zs, -1, idx).squeeze(-1).masked_fill(~in_range, 0.0)]
        if with_entropy:
            sums.append(torch.linalg.vecdot(e, zs))
        sums = torch.stack(sums)
        if tp > 1:
            dist.all_reduce(sums, group=tp_group)
        sum_e = sums[0]
        log_z = torch.log(sum_e)
        logp = sums[1] - log_z
        p = e.div_(sum_e.unsqueeze(-1))
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.save_for_backward(p, idx, in_range)
            return logp
        ent = log_z - sums[2] / sum_e
        ctx.save_for_backward(p, idx, in_range, zs, ent - log_z)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        p, idx, in_range = ctx.saved_tensors[:3]
        if g_lp is None:
            g_lp = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
        if ctx.with_entropy and g_ent is not None:
            zs, ent_minus_log_z = ctx.saved_tensors[3:]
            g = (zs * g_ent.unsqueeze(-1)).add_((g_lp + g_ent * ent_minus_log_z).unsqueeze(-1)).mul_(p).neg_()
        else:
            g = p * (-g_lp).unsqueeze(-1)
        g.scatter_add_(-1, idx, (g_lp * in_range).unsqueeze(-1))
        return g, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    true_vocab: int,
    tp_group=None,
    tp: int = 1,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits``: [N, V_local] (this rank's slice); ``labels``: [N] global token ids."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    v_local = z.shape[-1]
    if vocab_start + v_local > true_vocab:
        col = torch.arange(vocab_start, vocab_start + v_local, device=z.device)
        z = z.masked_fill(col >= true_vocab, _NEG)
    out = _VocabParallelLogProbs.apply(z, labels, vocab_start, tp_group, tp, with_entropy)
    return out if with_entropy else (out, None)


def logprobs_from_logits(
    logits: torch.Tensor,
    packed: PackedBatch,
    *,
    vocab_start: int,
    true_vocab: int,
    tp_group=None,
    tp: int = 1,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits``: [T, V_local], those of the positions predicting ``packed``'s response tokens
    (``spec.response_logits``, the last pipeline stage's output) -> log-probs [T] (and entropies)."""
    return vocab_parallel_logprobs(
        logits,
        packed.labels,
        vocab_start=vocab_start,
        true_vocab=true_vocab,
        tp_group=tp_group,
        tp=tp,
        with_entropy=with_entropy,
        temperature=temperature,
    )
