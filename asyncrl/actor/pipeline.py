"""Pipeline parallelism for the actor: Megatron's schedule on fixed-shape micro-batches, and the
HF export of every stage gathered onto global rank 0.

Contract
- ``StageInfo.current()`` (collective over the actor world, once): this rank's pipeline stage, the
  pipeline group, the global rank of this pipeline's last stage, and each stage's *leader* (the
  global rank at TP rank 0, DP rank 0 of that stage; stage 0's leader is global rank 0).
- ``run_schedule(model, items, loss_fn=, rows=, row_len=, backend=, forward_only=)``: megatron-core's
  ``get_forward_backward_func()`` (1F1B; forward-only for log-probs) over ``items`` (each has a
  ``.packed`` ``PackedBatch`` of exactly ``[rows, row_len]`` and a ``.filler`` flag). Every stage of one pipeline calls it
  with the same number of items and the same shape (they hold the same data); the model is called
  through ``asyncrl.actor.layer_spec.response_logits`` for the attention ``backend``, and activations travel
  between stages as ``[row_len, rows, hidden]`` tensors (``[rows * row_len, 1, hidden]`` in the
  fused backends' thd layout) over gloo p2p. ``loss_fn(item, logits)`` (the ``[T, V_local]`` logits of the
  positions predicting response tokens) runs on the last stage only and returns ``(loss, data)``: the loss is backpropagated as given
  (the schedule's division by the number of micro-batches is undone by the caller, see
  ``Actor``); the returned list holds each micro-batch's ``data`` on the last stage and is empty
  elsewhere. Gradients accumulate in the DDP buffers; nothing is all-reduced here.
- ``gather_to_rank0(own, info)``: ``own`` is this rank's stream of its stage's full HF tensors;
  global rank 0 gets stage 0's then every later stage's (sent by the stage leader, point to point,
  in model order), i.e. the whole model in the PP=1 order; every other rank gets its own stage's.
  Collective: every actor rank must iterate it to the end.

Small control tensors and receive buffers go on ``device`` (the actor's: CUDA under NCCL).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.actor.layer_spec import p2p_shape, response_logits

# Lazy imports here: megatron-core is imported inside the functions that use it; its import takes seconds
# and probes CUDA, and this module's pure parts (and --dry-run, the tests of them) must import without it.


@dataclass(frozen=True)
class StageInfo:
    pp: int
    pp_rank: int
    is_last: bool
    group: Any
    """The pipeline group of this rank (same TP and DP coordinates, all stages)."""
    last_rank: int
    """Global rank of this pipeline's last stage."""
    leaders: tuple[int, ...]
    """Global rank of stage s's TP-rank-0 / DP-rank-0 member, for every stage s."""

    @classmethod
    def current(cls) -> StageInfo:
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        coords = [None] * dist.get_world_size()
        mine = (pp_rank, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())
        dist.all_gather_object(coords, mine)
        leaders = tuple(coords.index((s, 0, 0)) for s in range(pp))
        if leaders[0] != 0:  # Megatron's rank order puts stage 0, TP 0, DP 0 on global rank 0
            raise RuntimeError(f"pipeline stage 0's leader is global rank {leaders[0]}, expected 0")
        return cls(
            pp=pp,
            pp_rank=pp_rank,
            is_last=ps.is_pipeline_last_stage(),
            group=ps.get_pipeline_model_parallel_group(),
            last_rank=ps.get_pipeline_model_parallel_last_rank(),
            leaders=leaders,
        )


def agree_shape(rows: int, row_len: int, info: StageInfo, device: torch.device | str = "cpu") -> tuple[int, int]:
    """The pipeline-wide ``(rows, row_len)`` (max over the stages: they must use one shape)."""
    t = torch.tensor([rows, row_len], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.group)
    return int(t[0]), int(t[1])


def run_schedule(
    model: torch.nn.Module,
    items: Sequence[Any],
    *,
    loss_fn: Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]],
    rows: int,
    row_len: int,
    backend: str,
    forward_only: bool,
) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not items:
        return []

    def forward_step(data_iterator, m):
        item = next(data_iterator)
        # first stage: embeds input_ids; later stages: the received activations (set by the schedule)
        return response_logits(m, item.packed, backend, filler=item.filler), functools.partial(loss_fn, item)

    seq_length, micro_batch_size = p2p_shape(rows, row_len, backend)
    fb = get_forward_backward_func()
    return list(
        fb(
            forward_step_func=forward_step,
            data_iterator=iter(items),
            model=[model],
            num_microbatches=len(items),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    )


def gather_to_rank0(
    own: Iterator[tuple[str, torch.Tensor]], info: StageInfo, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    rank = dist.get_rank()
    if rank == 0:
        yield from own
        for src in info.leaders[1:]:
            while True:
                header: list[Any] = [None]
                dist.recv_object_list(header, src=src)
                if header[0] is None:  # end of that stage
                    break
                name, shape, dtype = header[0]
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src=src)
                yield name, t
    elif info.pp_rank > 0 and rank == info.leaders[info.pp_rank]:
        for name, t in own:
            dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=0)
            dist.send(t.contiguous(), dst=0)
            yield name, t
        dist.send_object_list([None], dst=0)
    else:
        yield from own
