"""Log-probs and entropy of response tokens under tensor parallelism (vocab-parallel logits).

``vocab_parallel_logprobs(logits_local, labels, ...)`` works on this TP rank's vocabulary slice
``[vocab_start, vocab_start + V_local)`` and returns the full-vocabulary log-prob of each label
and (optionally) the entropy, identical on every TP rank. Columns at or past ``true_vocab`` (the
padding added so the vocabulary divides by TP) are excluded from the softmax. Differentiable:
the sums across TP use Megatron's all-reduce-forward / identity-backward mapping, the right
gradient when every TP rank computes the same loss (Megatron's convention).

``forward_logprobs(model, packed, ...)``: one packed micro-batch through the GPTModel;
``logprobs_from_logits``: the same from the last pipeline stage's logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from asyncrl.actor.batch import PackedBatch
from asyncrl.actor.spec import response_logits

# Lazy imports here: megatron-core is imported inside the functions that use it; its import takes seconds
# and probes CUDA, and this module's pure parts (and --dry-run, the tests of them) must import without it.

_NEG = -1e30  # "minus infinity" that keeps 0 * logit finite in the entropy


def _reduce_sum(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


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
    col = torch.arange(vocab_start, vocab_start + v_local, device=z.device)
    if vocab_start + v_local > true_vocab:
        z = z.masked_fill(col >= true_vocab, _NEG)
    m = z.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    zs = z - m.unsqueeze(-1)
    e = torch.exp(zs)
    sum_e = _reduce_sum(e.sum(dim=-1), tp_group, tp)
    log_z = torch.log(sum_e)
    local = labels - vocab_start
    in_range = (local >= 0) & (local < v_local)
    tgt = torch.gather(zs, -1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    tgt = _reduce_sum(torch.where(in_range, tgt, torch.zeros_like(tgt)), tp_group, tp)
    logp = tgt - log_z
    ent = None
    if with_entropy:
        ez = _reduce_sum((e * zs).sum(dim=-1), tp_group, tp)
        ent = log_z - ez / sum_e
    return logp, ent


def forward_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    attention_backend: str,
    vocab_start: int,
    true_vocab: int,
    tp_group=None,
    tp: int = 1,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [T] (and entropies) of the response tokens of one packed micro-batch.

    ``attention_backend``: the one the model was built with (``asyncrl.actor.spec``)."""
    return logprobs_from_logits(
        response_logits(model, packed, attention_backend),
        packed,
        vocab_start=vocab_start,
        true_vocab=true_vocab,
        tp_group=tp_group,
        tp=tp,
        with_entropy=with_entropy,
        temperature=temperature,
    )


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
