"""The Megatron actor: a GPTModel from a HF checkpoint, trained with GRPO/PPO on broker Groups.

Contract
- Process group: the actor ranks are the default ``torch.distributed`` world (the launcher calls
  ``init_process_group`` on the actor ranks only; tests do it under torchrun). ``Actor(cfg)``
  initialises Megatron's model parallelism on that world: TP = ``actor.tensor_model_parallel_size``,
  PP = ``actor.pipeline_model_parallel_size``, DP = world / (TP * PP); TP * PP must divide the
  actor ranks and PP must divide the number of layers (split evenly; HF layer index = stage offset
  + local index). On a machine without CUDA the shims of ``asyncrl.cluster.megatron_cpu`` are
  applied and everything runs in fp32 on gloo.
- Every public method is collective: **all actor ranks call it, in the same order**.
  ``train_step(groups)``: only global rank 0's ``groups`` are used (others pass ``None``); rank 0
  turns them into samples (GRPO advantages, global aggregation weights), splits them across DP
  ranks balancing tokens, and sends each rank only its replica's share (``asyncrl.actor.scatter``).
  Each rank packs its share into micro-batches of at most
  ``actor.max_tokens_per_microbatch`` tokens, accumulates gradients, and Megatron's DDP all-reduces
  them; one optimizer step (Adam, warmup + constant/cosine, clipping) follows unless the loss or
  the grad norm is non-finite (then the step is skipped with a warning and
  ``train/skipped_steps`` counts it). A batch without any trained token makes no update
  (``train/empty_batch``). A DP rank that gets no sample still joins every collective. Every rank
  returns the same metrics dict. Log-probs are computed at ``rollout.sampling.temperature``.
- Pipeline parallelism (PP > 1): the first stage holds the embedding, the last the final norm and
  output layer (with tied embeddings, Megatron's copy of the word embeddings, kept equal through
  the embedding-group gradient all-reduce). Log-probs and the training step go through
  megatron-core's ``get_forward_backward_func()`` (1F1B; forward-only for log-probs,
  ``asyncrl.actor.pipeline``) with p2p on gloo; each step's token-budget micro-batches are packed
  to one ``[rows, row_len]`` shape agreed over the pipeline group. The loss is computed on the last
  stage and its sums are broadcast to the other stages; the grad norm (clipping, the finite check)
  is Megatron's, over the model-parallel (TP x PP) group. PP = 1 keeps the plain per-micro-batch
  loop. ``compute_logprobs`` results are broadcast from the last stage, so every rank gets them.
- Attention and recompute: ``actor.attention_backend`` (``auto``: TransformerEngine on CUDA when
  it imports, else fused SDPA per packed sequence; on CPU too) and ``actor.recompute_*`` are
  resolved by ``asyncrl.actor.spec``; every micro-batch reaches the model in the layout that
  module gives (``thd`` with the sequences as segments for the fused backends).
- ``version`` is the weight version: the number of ``train_step`` calls so far (a skipped step
  still counts: the version names the step, the weights are simply unchanged), restored on resume.
- ``iter_hf_buckets(bucket_bytes)``: a generator of buckets (lists of ``(hf_name, full tensor)``,
  vocab padding stripped, at most ``bucket_bytes`` each unless one tensor is larger). Collective:
  **every actor rank must iterate it to the end**. Global rank 0 receives every full tensor, in
  the same order and buckets at any TP/PP, and is the one that sends them on (weight sync, HF
  export). At PP = 1 every rank receives the same full tensors; at PP > 1 each stage's TP-rank-0 /
  DP-rank-0 sends its stage's full tensors to global rank 0 point to point, stage by stage, and
  the other ranks receive only their own stage's.
- Checkpoints (``save_checkpoint`` / ``load_checkpoint``, collective): per-TP-rank model and
  optimizer files, per stage at PP > 1 (``asyncrl.actor.checkpoint``); resuming needs the same
  TP and PP (and DP with the distributed optimizer); a model-only checkpoint loads at any PP.

Example (on every actor rank, after ``dist.init_process_group``)::

    actor = Actor(cfg)
    metrics = actor.train_step(groups if dist.get_rank() == 0 else None)
    for bucket in actor.iter_hf_buckets(cfg.sync.bucket_bytes): ...
    actor.save_checkpoint(run_dir / "checkpoints" / "step_000010", step=10)
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from asyncrl.actor import checkpoint as ckpt_io
from asyncrl.actor.batch import (
    PackedBatch,
    Sample,
    groups_to_samples,
    make_microbatches,
    microbatch_extras,
    pack,
    pack_uniform,
    uniform_shape,
)
from asyncrl.actor.logprobs import logprobs_from_logits
from asyncrl.actor.loss import SUM_KEYS, finalize_metrics, policy_loss
from asyncrl.actor.model import (
    actor_spec,
    build_gpt_model,
    check_parallel_sizes,
    layer_offset,
    padded_vocab_size,
)
from asyncrl.actor.pipeline import StageInfo, agree_shape, gather_to_rank0, run_schedule
from asyncrl.actor.scatter import scatter_samples
from asyncrl.actor.spec import attention_path, model_inputs, recompute_settings, resolve_attention, te_available
from asyncrl.actor.weights import (
    is_tied_output_copy,
    iter_hf_buckets,
    iter_hf_tensors,
    load_hf_into_model,
    local_params,
)
from asyncrl.broker.types import Group
from asyncrl.cluster.megatron_cpu import apply_cpu_shims, cuda_as_cpu
from asyncrl.config.schema import Config
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors
from asyncrl.sync.bucketing import iter_buckets

log = logging.getLogger(__name__)


class Actor:
    def __init__(self, cfg: Config):
        if not dist.is_initialized():
            raise RuntimeError("Actor needs torch.distributed initialised on the actor ranks (the launcher does it)")
        apply_cpu_shims()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.cfg = cfg
        acfg = cfg.actor
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.tp = acfg.tensor_model_parallel_size
        self.pp = acfg.pipeline_model_parallel_size
        if self.world % self.tp:
            raise ValueError(f"actor.tensor_model_parallel_size={self.tp} must divide the {self.world} actor ranks")
        if self.world % (self.tp * self.pp):
            raise ValueError(
                f"actor.tensor_model_parallel_size={self.tp} x actor.pipeline_model_parallel_size={self.pp} "
                f"must divide the {self.world} actor ranks"
            )
        self.dp = self.world // (self.tp * self.pp)
        self.spec = actor_spec(acfg.model_path)
        check_parallel_sizes(self.spec, tp=self.tp, pp=self.pp)
        self.model_path = Path(acfg.model_path)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp)
        elif (
            ps.get_tensor_model_parallel_world_size() != self.tp
            or ps.get_pipeline_model_parallel_world_size() != self.pp
        ):
            raise RuntimeError("Megatron model parallelism is already initialised with other TP/PP sizes")
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.runner.seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.layer_offset = layer_offset(self.spec, pp=self.pp, pp_rank=self.pp_rank)
        self.stage: StageInfo | None = StageInfo.current() if self.pp > 1 else None
        self.padded_vocab = padded_vocab_size(self.spec.vocab_size, self.tp)
        self.vocab_start = self.tp_rank * (self.padded_vocab // self.tp)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        # Log-probs (and entropy) are those of the sampling distribution: logits / temperature, as
        # the engines report them (before top-p/top-k), so the PPO ratio compares like with like.
        self.temperature = cfg.rollout.sampling.temperature if cfg.rollout.sampling.temperature > 0 else 1.0
        self.dtype = torch.bfloat16 if (acfg.params_dtype == "bf16" and torch.cuda.is_available()) else torch.float32
        cuda = torch.cuda.is_available()
        self.attention = resolve_attention(acfg.attention_backend, cuda=cuda, te_available=cuda and te_available())
        self.recompute = recompute_settings(
            acfg.recompute_granularity,
            acfg.recompute_method,
            acfg.recompute_num_layers,
            layers_per_stage=self.spec.num_layers // self.pp,
        )
        if self.rank == 0:
            log.info(
                "actor attention: %s; recompute: %s",
                attention_path(self.attention, dtype=self.dtype, device=self.device),
                self.recompute or "none",
            )

        self.model = self._build_and_load()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=acfg.use_distributed_optimizer
        )
        self.ddp = DistributedDataParallel(self.model.config, ddp_cfg, self.model)
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=acfg.lr,
            min_lr=acfg.min_lr,
            weight_decay=acfg.weight_decay,
            adam_beta1=acfg.adam_beta1,
            adam_beta2=acfg.adam_beta2,
            adam_eps=acfg.adam_eps,
            clip_grad=acfg.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=acfg.use_distributed_optimizer,
        )
        with cuda_as_cpu():
            self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        decay_steps = max(cfg.runner.max_steps, acfg.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
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
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = self._build_and_load()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self._version = 0
        self._step = 0
        self.num_skipped_steps = 0

    # ------------------------------------------------------------------ model
    def _build_and_load(self) -> torch.nn.Module:
        model = build_gpt_model(
            self.spec,
            tp=self.tp,
            pp=self.pp,
            params_dtype=self.dtype,
            attention_backend=self.attention,
            recompute=self.recompute,
        )
        model.to(self.device)
        load_hf_into_model(
            model,
            self.model_path,
            self.spec,
            tp_rank=self.tp_rank,
            tp=self.tp,
            layer_offset=self.layer_offset,
            pp=self.pp,
        )
        return model

    @property
    def version(self) -> int:
        return self._version

    @property
    def step(self) -> int:
        return self._step

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _logprobs(self, model, packed: PackedBatch, *, with_entropy: bool):
        packed = packed.to(self.device)
        args, kwargs = model_inputs(packed, self.attention)
        return self._logprobs_of(model(*args, **kwargs), packed, with_entropy=with_entropy)

    def _logprobs_of(self, logits: torch.Tensor, packed: PackedBatch, *, with_entropy: bool):
        """Response-token log-probs (and entropies) of a packed micro-batch's logits (vocab-parallel)."""
        return logprobs_from_logits(
            logits,
            packed,
            vocab_start=self.vocab_start,
            true_vocab=self.spec.vocab_size,
            tp_group=self.tp_group,
            tp=self.tp,
            with_entropy=with_entropy,
            temperature=self.temperature,
        )

    def _policy_loss(self, logp, ent, x: dict[str, torch.Tensor], prox, ref):
        """The configured PPO/GRPO loss of one micro-batch (``x``: its ``_extras``)."""
        a = self.cfg.algorithm
        return policy_loss(
            logp,
            behav_logp=x["behav"],
            prox_logp=prox,
            advantages=x["adv"],
            agg_weight=x["agg"],
            mask=x["mask"],
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            dual_clip=a.dual_clip,
            off_policy_correction=a.off_policy_correction,
            tis_cap=a.tis_cap,
            entropy=ent,
            entropy_coef=a.entropy_coef,
            ref_logp=ref,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
        )

    # ------------------------------------------------------------------ data
    def _distribute(self, groups: Sequence[Group] | None) -> list[Sample]:
        """This DP rank's samples: rank 0 builds the batch's and sends each rank its share (``scatter``)."""
        samples = None
        if self.rank == 0:
            if groups is None:
                raise ValueError("train_step: actor rank 0 must be given the batch (a list of Group)")
            a = self.cfg.algorithm
            samples = groups_to_samples(
                groups, normalize_adv_by_std=a.normalize_adv_by_std, loss_agg_mode=a.loss_agg_mode
            )
        return scatter_samples(samples, dp=self.dp, dp_rank=self.dp_rank, device=self.device)

    def _microbatches(self, samples: list[Sample]) -> list[tuple[PackedBatch, dict[str, torch.Tensor]]]:
        out = []
        for idx in make_microbatches([s.num_tokens for s in samples], self.cfg.actor.max_tokens_per_microbatch):
            mb = [samples[i] for i in idx]
            packed = pack([s.tokens for s in mb], [s.prompt_len for s in mb])
            out.append((packed, self._extras(mb)))
        return out

    def _extras(self, mb: list[Sample]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in microbatch_extras(mb).items()}

    # ------------------------------------------------------------------ pipeline (PP > 1)
    def _pack_uniform(self, mbs: list[tuple[list[list[int]], list[int]]]) -> tuple[list[PackedBatch], int, int]:
        """Micro-batches packed to the one ``[rows, row_len]`` shape the whole pipeline agrees on."""
        assert self.stage is not None
        rows, row_len = agree_shape(*uniform_shape([seqs for seqs, _ in mbs]), self.stage, self.device)
        if not mbs:
            return [], rows, row_len
        packed = [p.to(self.device) for p in pack_uniform(mbs, rows=rows, row_len=row_len)]
        return packed, rows, row_len

    def _pp_logprobs(self, model, packed: list[PackedBatch], rows: int, row_len: int, *, with_entropy: bool):
        """Forward-only schedule: ``[(logp, ent)]`` per micro-batch on the last stage, ``[]`` elsewhere."""

        def loss_fn(item, logits):
            return torch.zeros((), device=logits.device), self._logprobs_of(
                logits, item.packed, with_entropy=with_entropy
            )

        with torch.no_grad():
            return run_schedule(
                model,
                [_Item(p) for p in packed],
                loss_fn=loss_fn,
                rows=rows,
                row_len=row_len,
                backend=self.attention,
                forward_only=True,
            )

    def _accumulate_grads_pp(self, samples: list[Sample]) -> tuple[dict[str, float], int, int]:
        """Forward/backward of this DP rank's samples through the pipeline (1F1B).

        Returns the loss sums (broadcast from the last stage, so every stage has them), the number
        of real tokens and of micro-batches.
        """
        assert self.stage is not None
        a = self.cfg.algorithm
        idxs = make_microbatches([s.num_tokens for s in samples], self.cfg.actor.max_tokens_per_microbatch)
        mbs = [[samples[i] for i in idx] for idx in idxs]
        packed, rows, row_len = self._pack_uniform([([s.tokens for s in mb], [s.prompt_len for s in mb]) for mb in mbs])
        items = [_Item(p, self._extras(mb) if self.stage.is_last else None) for p, mb in zip(packed, mbs)]
        if a.off_policy_correction != "none":
            for it, lp in zip(items, self._pp_logprobs(self.model, packed, rows, row_len, with_entropy=False)):
                it.prox = lp[0].float()
        if self.ref_model is not None:
            for it, lp in zip(items, self._pp_logprobs(self.ref_model, packed, rows, row_len, with_entropy=False)):
                it.ref = lp[0].float()
        n_mb = len(items)

        def loss_fn(item, logits):
            logp, ent = self._logprobs_of(logits, item.packed, with_entropy=True)
            out = self._policy_loss(logp, ent, item.extra, item.prox, item.ref)
            # As at PP=1 (x DP: DDP averages over DP ranks); x n_mb undoes the schedule's
            # division of every micro-batch's loss by the number of micro-batches.
            return out.loss * (self.dp * n_mb), out.sums

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        data = run_schedule(
            self.ddp, items, loss_fn=loss_fn, rows=rows, row_len=row_len, backend=self.attention, forward_only=False
        )
        sums: dict[str, float] = defaultdict(float)
        for d in data:
            for k, v in d.items():
                sums[k] += v
        vec = torch.tensor([sums.get(k, 0.0) for k in SUM_KEYS], dtype=torch.float64, device=self.device)
        dist.broadcast(vec, src=self.stage.last_rank, group=self.stage.group)
        return dict(zip(SUM_KEYS, vec.tolist())), sum(p.num_tokens for p in packed), n_mb

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], *, with_entropy: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Log-probs (and entropies) of each sequence's tokens after its prompt, current weights.

        Collective; every rank passes the same inputs and gets the full result (float32, CPU).
        """
        lens = [len(s) for s in sequences]
        out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if self.stage is not None:
            return self._compute_logprobs_pp(sequences, prompt_lens, with_entropy=with_entropy)
        for idx in make_microbatches(lens, self.cfg.actor.max_tokens_per_microbatch):
            packed = pack([sequences[i] for i in idx], [prompt_lens[i] for i in idx])
            logp, ent = self._logprobs(self.model, packed, with_entropy=with_entropy)
            for k in range(len(idx)):
                sel = packed.seq_of_token == k
                out.append(
                    (
                        logp[sel.to(logp.device)].float().cpu(),
                        None if ent is None else ent[sel.to(ent.device)].float().cpu(),
                    )
                )
        return out

    def _compute_logprobs_pp(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], *, with_entropy: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        assert self.stage is not None
        idxs = make_microbatches([len(s) for s in sequences], self.cfg.actor.max_tokens_per_microbatch)
        packed, rows, row_len = self._pack_uniform(
            [([list(sequences[i]) for i in idx], [prompt_lens[i] for i in idx]) for idx in idxs]
        )
        results = self._pp_logprobs(self.model, packed, rows, row_len, with_entropy=with_entropy)
        out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for idx, p, (logp, ent) in zip(idxs, packed, results):  # empty except on the last stage
            for k in range(len(idx)):
                sel = (p.seq_of_token == k).to(logp.device)
                out.append((logp[sel].float().cpu(), None if ent is None else ent[sel].float().cpu()))
        payload: list[Any] = [out]
        dist.broadcast_object_list(payload, src=self.stage.last_rank, group=self.stage.group)
        return payload[0]

    def _accumulate_grads(self, samples: list[Sample]) -> tuple[dict[str, float], int, int]:
        """Forward/backward of this DP rank's samples, micro-batch by micro-batch (PP = 1)."""
        a = self.cfg.algorithm
        mbs = self._microbatches(samples)
        prox: list[torch.Tensor | None] = [None] * len(mbs)
        ref: list[torch.Tensor | None] = [None] * len(mbs)
        with torch.no_grad():
            for i, (packed, _) in enumerate(mbs):
                if a.off_policy_correction != "none":
                    prox[i] = self._logprobs(self.model, packed, with_entropy=False)[0].float()
                if self.ref_model is not None:
                    ref[i] = self._logprobs(self.ref_model, packed, with_entropy=False)[0].float()

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: dict[str, float] = defaultdict(float)
        num_seq_tokens = 0
        for i, (packed, x) in enumerate(mbs):
            logp, ent = self._logprobs(self.ddp, packed, with_entropy=True)
            out = self._policy_loss(logp, ent, x, prox[i], ref[i])
            # DDP averages gradients over DP ranks; the aggregation weights are already global.
            (out.loss * self.dp).backward()
            for k, v in out.sums.items():
                sums[k] += v
            num_seq_tokens += packed.num_tokens
        return sums, num_seq_tokens, len(mbs)

    def train_step(self, groups: Sequence[Group] | None, *, step: int | None = None) -> dict[str, float]:
        """One optimizer step on a batch of groups (see the module contract)."""
        t0 = time.perf_counter()
        samples = self._distribute(groups)
        if self.stage is None:
            sums, num_seq_tokens, num_mbs = self._accumulate_grads(samples)
        else:
            sums, num_seq_tokens, num_mbs = self._accumulate_grads_pp(samples)
        # DP all-reduce of the grad buffers, plus the TP all-reduce of replicated weights whose
        # gradient is partial per TP rank (Qwen3's q/k norms), and (PP > 1, tied embeddings) the
        # embedding-group all-reduce that keeps the last stage's copy of the embeddings in sync.
        finalize_model_grads([self.ddp])

        keys = SUM_KEYS  # fixed order: a rank without samples still joins the all-reduce
        # on the actor's device: NCCL (GPU jobs) only reduces CUDA tensors
        vec = torch.tensor(
            [sums.get(k, 0.0) for k in keys] + [float(num_seq_tokens)], dtype=torch.float64, device=self.device
        )
        if self.dp > 1:
            dist.all_reduce(vec, group=self.dp_group)
        total = dict(zip(keys, vec[:-1].tolist()))
        global_tokens = vec[-1].item()
        loss_ok = torch.tensor([1.0 if all(math.isfinite(v) for v in total.values()) else 0.0], device=self.device)
        dist.all_reduce(loss_ok, op=dist.ReduceOp.MIN)

        grad_norm = float("nan")
        applied = False
        empty = total["num_tokens"] == 0
        if empty:  # nothing to train on: no update (Adam's momentum would still move the weights)
            log.warning("actor step %d: the batch has no trained token; no update", self._step + 1)
            grad_norm = 0.0
            self.optimizer.zero_grad()
        elif loss_ok.item() == 1.0:
            with cuda_as_cpu():
                self.optimizer.prepare_grads()
                grad_norm = float(self.optimizer.get_grad_norm())
            if math.isfinite(grad_norm):
                self.scheduler.step(increment=1)
                with cuda_as_cpu():
                    ok, gn, _ = self.optimizer.step()
                applied = bool(ok)
                if gn is not None:
                    grad_norm = float(gn)
        if not applied and not empty:
            self.num_skipped_steps += 1
            self.optimizer.zero_grad()
            log.warning(
                "actor step %d skipped: non-finite %s (skipped so far: %d)",
                self._step + 1,
                "loss" if loss_ok.item() != 1.0 else "gradient norm",
                self.num_skipped_steps,
            )
        self._step = step if step is not None else self._step + 1
        self._version += 1
        dt = time.perf_counter() - t0
        m = finalize_metrics(total)
        m.update(
            {
                "train/grad_norm": grad_norm,
                "train/lr": self.lr,
                "train/tokens_per_s": global_tokens / dt if dt > 0 else 0.0,
                "train/num_seq_tokens": global_tokens,
                "train/num_microbatches": float(num_mbs),
                "train/step_skipped": 0.0 if applied or empty else 1.0,
                "train/empty_batch": 1.0 if empty else 0.0,
                "train/skipped_steps": float(self.num_skipped_steps),
                "time/training": dt,
            }
        )
        return m

    def iter_hf_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in buckets (collective: every actor rank iterates it all)."""
        if self.stage is None:
            yield from iter_hf_buckets(
                self.model, self.spec, bucket_bytes, tp_group=self.tp_group, tp=self.tp, dtype=dtype
            )
            return
        own = iter_hf_tensors(
            self.model, self.spec, tp_group=self.tp_group, tp=self.tp, dtype=dtype, layer_offset=self.layer_offset
        )
        yield from iter_buckets(gather_to_rank0(own, self.stage, self.device), bucket_bytes)

    def export_hf(self, directory: str | Path) -> Path:
        """The current weights as a loadable HF checkpoint: ``model.safetensors`` plus the HF side files
        (config, tokenizer) of ``actor.model_path``. Collective: every actor rank iterates the buckets;
        global rank 0 alone writes (``runner.save_hf`` exports and the eval snapshots use this)."""
        d = Path(directory)
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.iter_hf_buckets(self.cfg.sync.bucket_bytes):
            if self.rank == 0:
                tensors.update(bucket)
        if self.rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            save_safetensors(tensors, d / "model.safetensors")
            ckpt_io.copy_hf_side_files(self.model_path, d)
        return d

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path, *, step: int | None = None) -> Path:
        """Model, optimizer, scheduler, RNG, step and weight version (collective)."""
        d = Path(directory)
        if self.rank == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.dp_rank == 0:
            shard = {name: p.detach() for name, p in local_params(self.model, self.layer_offset)}
            save_safetensors(shard, d / ckpt_io.model_file(self.tp_rank, self.pp_rank, self.pp))
            if not self.cfg.actor.use_distributed_optimizer:
                _atomic_save(self.optimizer.state_dict(), d / ckpt_io.optim_file(self.tp_rank, self.pp_rank, self.pp))
        if self.cfg.actor.use_distributed_optimizer:  # each DP rank holds its own shard of the state
            _atomic_save(self._optimizer_shard_state(), d / ckpt_io.optim_shard_file(self.rank))
        torch.save(_rng_state(), d / ckpt_io.rng_file(self.rank))
        if self.cfg.runner.save_hf:
            self.export_hf(d / "hf_export")
        if self.rank == 0:
            (d / "sched.json").write_text(json.dumps(self.scheduler.state_dict()) + "\n")
            ckpt_io.copy_hf_side_files(self.model_path, d / "hf")
            ckpt_io.write_meta(
                d,
                {
                    "step": self._step if step is None else int(step),
                    "weight_version": self._version,
                    "tp": self.tp,
                    "pp": self.pp,
                    "dp": self.dp,
                    "padded_vocab_size": self.padded_vocab,
                    "num_skipped_steps": self.num_skipped_steps,
                    "has_optimizer": True,
                    "distributed_optimizer": self.cfg.actor.use_distributed_optimizer,
                    "model_path": str(self.model_path),
                },
            )
        dist.barrier()
        return d

    def _sub_optimizers(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _optimizer_shard_state(self) -> list[dict[str, Any]]:
        """This rank's torch optimizer state and main (fp32) params, per Megatron sub-optimizer."""
        return [
            {
                "inner": o.optimizer.state_dict(),
                "main": [p.detach().cpu().clone() for g in o.optimizer.param_groups for p in g["params"]],
            }
            for o in self._sub_optimizers()
        ]

    @torch.no_grad()
    def _load_optimizer_shard_state(self, states: list[dict[str, Any]]) -> None:
        subs = self._sub_optimizers()
        if len(states) != len(subs):
            raise ValueError(f"optimizer checkpoint has {len(states)} sub-optimizers, the actor {len(subs)}")
        for o, st in zip(subs, states):
            o.optimizer.load_state_dict(st["inner"])
            params = [p for g in o.optimizer.param_groups for p in g["params"]]
            for p, t in zip(params, st["main"], strict=True):
                p.copy_(t.to(p.device, p.dtype))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote (or the model of a converted checkpoint)."""
        d = Path(directory)
        meta = ckpt_io.read_meta(d)
        if int(meta["tp"]) != self.tp:
            raise ValueError(
                f"checkpoint {str(d)!r} has TP={meta['tp']} but actor.tensor_model_parallel_size={self.tp}: "
                "convert it with `python -m asyncrl.actor.convert_cli actor-to-hf` and start from the HF export"
            )
        pp_saved = int(meta.get("pp", 1))
        if self.pp == 1 and pp_saved == 1:
            shard = SafetensorsReader(d / ckpt_io.model_file(self.tp_rank)).to_dict()
        else:  # this stage's tensors, from whichever stage file holds them (any saved PP)
            names = [n for n, _ in local_params(self.model, self.layer_offset)]
            shard = ckpt_io.read_model_tensors(d, self.tp_rank, pp_saved, names)
        with torch.no_grad():
            for name, p in local_params(self.model, self.layer_offset):
                if name not in shard and is_tied_output_copy(name, self.spec):
                    name = "embedding.word_embeddings.weight"  # a checkpoint saved at PP=1
                if name not in shard:
                    raise KeyError(f"checkpoint {str(d)!r} lacks {name}")
                p.copy_(shard[name].to(p.dtype))
        if meta.get("has_optimizer") and pp_saved != self.pp:
            raise ValueError(
                f"checkpoint {str(d)!r} has PP={pp_saved} but actor.pipeline_model_parallel_size={self.pp}: "
                "its optimizer state cannot be resumed; convert it with `python -m asyncrl.actor.convert_cli "
                "actor-to-hf` and start from the HF export"
            )
        if meta.get("has_optimizer"):
            dopt = bool(meta.get("distributed_optimizer", False))
            if dopt != self.cfg.actor.use_distributed_optimizer or (dopt and meta.get("dp") != self.dp):
                raise ValueError(
                    f"checkpoint {str(d)!r} was saved with distributed_optimizer={dopt}, dp={meta.get('dp')}; "
                    f"actor.use_distributed_optimizer={self.cfg.actor.use_distributed_optimizer}, dp={self.dp} "
                    "cannot resume its optimizer state"
                )
            if dopt:
                shard = torch.load(d / ckpt_io.optim_shard_file(self.rank), map_location="cpu", weights_only=False)
                self._load_optimizer_shard_state(shard)
            else:
                state = torch.load(
                    d / ckpt_io.optim_file(self.tp_rank, self.pp_rank, self.pp), map_location="cpu", weights_only=False
                )
                with cuda_as_cpu():
                    self.optimizer.load_state_dict(state)
            # Megatron's load_state_dict *adds* the saved step count to the current one
            self.scheduler.num_steps = 0
            self.scheduler.load_state_dict(json.loads((d / "sched.json").read_text()))
            rng = d / ckpt_io.rng_file(self.rank)
            if rng.is_file() and meta.get("dp") == self.dp:
                _set_rng_state(torch.load(rng, weights_only=False))
            else:
                log.warning(
                    "checkpoint %s: no RNG state for rank %d (or another DP size): RNG not restored", d, self.rank
                )
        self._step = int(meta["step"])
        self._version = int(meta["weight_version"])
        self.num_skipped_steps = int(meta.get("num_skipped_steps", 0))
        dist.barrier()
        return meta


class _Item:
    """One pipeline micro-batch: the packed tokens (every stage) and the loss inputs (last stage)."""

    def __init__(self, packed: PackedBatch, extra: dict[str, torch.Tensor] | None = None):
        self.packed = packed
        self.extra = extra
        self.prox: torch.Tensor | None = None
        self.ref: torch.Tensor | None = None


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is a dependency; keep the checkpoint usable without it
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
