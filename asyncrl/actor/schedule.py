"""How the actor runs its micro-batches through the model: the plain loop (PP = 1) or Megatron's pipeline
schedule (PP > 1), behind one interface, so ``Actor`` has one training step and one log-prob path.

Contract
- ``MicroBatch``: one micro-batch of a step: ``packed`` (on the actor's device, in the schedule's shape) and,
  where the loss is computed (``schedule.computes_loss``: every rank at PP = 1, the last stage at PP > 1), the
  loss inputs ``extra`` and the recomputed ``prox`` / reference ``ref`` log-probs. A ``filler`` (nothing
  trained, ``asyncrl.actor.moe``) runs like the others, in eval mode (``spec.response_logits``).
- ``pack(mbs)``: ``[(sequences, prompt_lens)]`` -> one ``PackedBatch`` per micro-batch on the device. Plain:
  each packed for the attention backend (``spec.pack_microbatch``: no padding with fused attention). Pipeline: every micro-batch padded to the one ``[rows, row_len]``
  shape agreed over the pipeline group (collective over it, even with no micro-batch), because activations
  travel between stages as fixed-shape tensors.
- ``forward(model, items, fn)``: ``fn(item, logits)`` of every item in order (``logits``: ``[T, V_local]``, the
  positions predicting the response tokens, ``spec.response_logits``), on the ranks that compute the loss
  (``[]`` on the other stages). The caller chooses the grad mode (log-probs run under ``torch.no_grad``).
- ``forward_backward(model, items, loss_fn, grad_scale=)``: ``loss_fn(item, logits) -> (loss, data)``; the
  gradient of ``loss * grad_scale`` of every item accumulates in the model's (DDP) grad buffers; returns each
  item's ``data`` (``[]`` on the non-last stages). The pipeline undoes its schedule's division of every loss by
  the number of micro-batches, so both schedules accumulate the same gradient. Nothing is all-reduced here.
  A MoE model's load-balancing loss (attached to the routers by megatron-core, backpropagated through its
  ``MoEAuxLossAutoScaler``) gets megatron-core's scale in both: 1 / this rank's number of micro-batches
  (Megatron's schedule sets it; the plain loop sets the same), so after the DP average of the gradients it
  enters as its mean over the step's micro-batches (and DP ranks), times its coefficient, like the policy
  loss, a mean over the global batch (fillers count as micro-batches there, and add no loss).
- ``gather_sums(sums)`` / ``share(obj)``: the last stage's loss sums / object on every stage of the pipeline
  (identity at PP = 1).

    sched = PlainSchedule(device, backend) if pp == 1 else PipelineSchedule(StageInfo.current(), device, backend)
    items = [MicroBatch(p, extra) for p, extra in zip(sched.pack(mbs), extras)]
    data = sched.forward_backward(ddp_model, items, loss_fn, grad_scale=dp)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.actor.batch import PackedBatch, pack_uniform, uniform_shape
from asyncrl.actor.layer_spec import pack_microbatch, response_logits
from asyncrl.actor.loss import SUM_KEYS
from asyncrl.actor.pipeline import StageInfo, agree_shape, run_schedule

LossFn = Callable[["MicroBatch", torch.Tensor], tuple[torch.Tensor, Any]]
MicroBatchSeqs = tuple[Sequence[Sequence[int]], Sequence[int]]
"""One micro-batch before packing: its sequences (prompt + response ids) and their prompt lengths."""


class MicroBatch:
    """One micro-batch: the packed tokens (every stage) and the loss inputs (where the loss is computed)."""

    def __init__(self, packed: PackedBatch, extra: dict[str, torch.Tensor] | None = None, *, filler: bool = False):
        self.packed = packed
        self.extra = extra
        self.filler = filler
        self.prox: torch.Tensor | None = None
        self.ref: torch.Tensor | None = None


class PlainSchedule:
    """PP = 1: one micro-batch after the other, forward then backward."""

    computes_loss = True

    def __init__(self, device: torch.device, backend: str):
        self.device, self.backend = device, backend

    def pack(self, mbs: Sequence[MicroBatchSeqs]) -> list[PackedBatch]:
        return [pack_microbatch(seqs, prompt_lens, self.backend).to(self.device) for seqs, prompt_lens in mbs]

    def _logits(self, model: torch.nn.Module, item: MicroBatch) -> torch.Tensor:
        return response_logits(model, item.packed, self.backend, filler=item.filler)

    def forward(self, model: torch.nn.Module, items: Sequence[MicroBatch], fn: Callable) -> list[Any]:
        return [fn(it, self._logits(model, it)) for it in items]

    def forward_backward(
        self, model: torch.nn.Module, items: Sequence[MicroBatch], loss_fn: LossFn, *, grad_scale: float
    ) -> list[Any]:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        if items:  # what megatron-core's forward_backward_func sets (no effect on a dense model)
            MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / len(items), device=self.device))
        out = []
        for it in items:
            loss, data = loss_fn(it, self._logits(model, it))
            (loss * grad_scale).backward()
            out.append(data)
        return out

    def gather_sums(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def share(self, obj: Any) -> Any:
        return obj


class PipelineSchedule:
    """PP > 1: megatron-core's 1F1B schedule (forward-only for log-probs) over fixed-shape micro-batches."""

    def __init__(self, stage: StageInfo, device: torch.device, backend: str):
        self.stage, self.device, self.backend = stage, device, backend
        self.computes_loss = stage.is_last

    def pack(self, mbs: Sequence[MicroBatchSeqs]) -> list[PackedBatch]:
        rows, row_len = agree_shape(*uniform_shape([seqs for seqs, _ in mbs]), self.stage, self.device)
        if not mbs:
            return []
        return [p.to(self.device) for p in pack_uniform(mbs, rows=rows, row_len=row_len)]

    def _run(self, model: torch.nn.Module, items: Sequence[MicroBatch], loss_fn: LossFn, *, forward_only: bool):
        if not items:
            return []
        rows, row_len = items[0].packed.input_ids.shape
        return run_schedule(
            model,
            items,
            loss_fn=loss_fn,
            rows=int(rows),
            row_len=int(row_len),
            backend=self.backend,
            forward_only=forward_only,
        )

    def forward(self, model: torch.nn.Module, items: Sequence[MicroBatch], fn: Callable) -> list[Any]:
        def loss_fn(item, logits):
            return torch.zeros((), device=logits.device), fn(item, logits)

        return self._run(model, items, loss_fn, forward_only=True)

    def forward_backward(
        self, model: torch.nn.Module, items: Sequence[MicroBatch], loss_fn: LossFn, *, grad_scale: float
    ) -> list[Any]:
        n = len(items)

        def scaled(item, logits):
            loss, data = loss_fn(item, logits)
            # x n undoes the schedule's division of every micro-batch's loss by the number of micro-batches
            return loss * (grad_scale * n), data

        return self._run(model, items, scaled, forward_only=False)

    def gather_sums(self, sums: dict[str, float]) -> dict[str, float]:
        vec = torch.tensor([sums.get(k, 0.0) for k in SUM_KEYS], dtype=torch.float64, device=self.device)
        dist.broadcast(vec, src=self.stage.last_rank, group=self.stage.group)
        return dict(zip(SUM_KEYS, vec.tolist()))

    def share(self, obj: Any) -> Any:
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=self.stage.last_rank, group=self.stage.group)
        return box[0]
