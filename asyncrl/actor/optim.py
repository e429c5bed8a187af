"""The actor's optimizer: Megatron's DDP wrapper, Adam (Megatron's, distributed or not) and the learning-rate
schedule (linear warmup, then constant or cosine down to ``actor.min_lr`` over ``runner.max_steps``).

    ddp, optimizer, scheduler = build_optimizer(cfg, model, torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from asyncrl.cluster.megatron_cpu import cuda_as_cpu
from asyncrl.config.schema import Config


def build_optimizer(cfg: Config, model: torch.nn.Module, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """``(ddp, optimizer, scheduler)`` for ``model`` (gradients reduced in fp32; clipping at ``actor.grad_clip``)."""
    acfg = cfg.actor
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=acfg.use_distributed_optimizer
    )
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=acfg.lr,
        min_lr=acfg.min_lr,
        weight_decay=acfg.weight_decay,
        adam_beta1=acfg.adam_beta1,
        adam_beta2=acfg.adam_beta2,
        adam_eps=acfg.adam_eps,
        clip_grad=acfg.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=acfg.use_distributed_optimizer,
    )
    with cuda_as_cpu():
        optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    decay_steps = max(cfg.runner.max_steps, acfg.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if acfg.lr_warmup_steps else acfg.lr,
        max_lr=acfg.lr,
        min_lr=acfg.min_lr,
        lr_warmup_steps=acfg.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=acfg.lr_schedule,
        start_wd=acfg.weight_decay,
        end_wd=acfg.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler
