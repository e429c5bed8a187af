# long: the actor's one class, read top to bottom: set-up, the step, log-probs, the weights' ways out
"""The Megatron actor: a GPTModel from a HF checkpoint, trained with GRPO/PPO on broker Groups.

Contract
- Process group: the actor ranks are the default ``torch.distributed`` world (the launcher calls
  ``init_process_group`` on the actor ranks only; tests do it under torchrun). ``Actor(cfg)``
  initialises Megatron's model parallelism on that world: TP = ``actor.tensor_model_parallel_size``,
  PP = ``actor.pipeline_model_parallel_size``, DP = world / (TP * PP); TP * PP must divide the
  actor ranks and PP must divide the number of layers (split evenly; HF layer index = stage offset
  + local index). A mixture-of-experts model (``asyncrl.actor.model``) splits its experts over EP =
  ``actor.expert_model_parallel_size`` ranks of the DP dimension (TP * EP * PP must divide the actor ranks,
  EP the number of experts; EP > 1 for a dense model, or MoE training at TP > 1, is a ValueError naming
  the key). On a machine without CUDA the shims of ``asyncrl.cluster.megatron_cpu`` are
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
  A MoE model's load-balancing loss (megatron-core's ``aux_loss``) is in the gradient
  (``asyncrl.actor.schedule``) and its routing reported (``moe/...``, ``asyncrl.actor.moe``). With
  ``actor.moe_routing_replay``, every forward of the step (old, reference, training) and ``compute_logprobs`` given
  ``routed_experts`` replay the engine's experts of each sample (``asyncrl.actor.moe.replay_routing``), cleared after.
- Pipeline parallelism (PP > 1): the first stage holds the embedding, the last the final norm and
  output layer (with tied embeddings, Megatron's copy of the word embeddings, kept equal through
  the embedding-group gradient all-reduce). Log-probs and the training step go through
  megatron-core's ``get_forward_backward_func()`` (1F1B; forward-only for log-probs,
  ``asyncrl.actor.pipeline``) with p2p on gloo; each step's token-budget micro-batches are packed
  to one ``[rows, row_len]`` shape agreed over the pipeline group. The loss is computed on the last
  stage and its sums are broadcast to the other stages; the grad norm (clipping, the finite check)
  is Megatron's, over the model-parallel (TP x PP) group. One step and one log-prob path serve every PP:
  they call the actor's schedule (``asyncrl.actor.schedule``: ``PlainSchedule`` micro-batch by micro-batch at
  PP = 1, ``PipelineSchedule`` at PP > 1). ``compute_logprobs`` results are broadcast from the last stage, so
  every rank gets them.
- Attention and recompute: ``actor.attention_backend`` (``auto``: TransformerEngine on CUDA when
  it imports, else fused SDPA per packed sequence; on CPU too) and ``actor.recompute_*`` are
  resolved by ``asyncrl.actor.layer_spec``; every micro-batch reaches the model in the layout that
  module gives (``thd`` with the sequences as segments for the fused backends).
- ``version`` is the weight version: the number of ``train_step`` calls so far (a skipped step
  still counts: the version names the step, the weights are simply unchanged), restored on resume.
- ``iter_hf_buckets(bucket_bytes)``: a generator of buckets (lists of ``(hf_name, full tensor)``,
  vocab padding stripped, at most ``bucket_bytes`` each unless one tensor is larger). Collective:
  **every actor rank must iterate it to the end**. Global rank 0 receives every full tensor, in
  the same order and buckets at any TP/PP, and is the one that sends them on (weight sync, HF
  export). At PP = 1 every rank receives the same full tensors; at PP > 1 each stage's TP-rank-0 /
  DP-rank-0 sends its stage's full tensors to global rank 0 point to point, stage by stage, and
  the other ranks receive only their own stage's. Every rank of an EP group receives every expert
  (broadcast from its EP rank, ``asyncrl.actor.weights``).
- Checkpoints (``save_checkpoint`` / ``load_checkpoint``, collective): the actor's state in one checkpoint
  directory, laid out by ``asyncrl.actor.checkpoint`` (per-TP-rank model and optimizer files, per stage at
  PP > 1, per EP rank at EP > 1); resuming needs the same TP, PP and EP (and DP with the distributed
  optimizer); a model-only checkpoint loads at any PP and EP. The run's checkpoints (step directories, markers, broker state) are the
  ``CheckpointManager``'s. The optimizer and its schedule are built by ``asyncrl.actor.optim``.

Example (on every actor rank, after ``dist.init_process_group``)::

    actor = Actor(cfg)
    metrics = actor.train_step(groups if dist.get_rank() == 0 else None)
    for bucket in actor.iter_hf_buckets(cfg.sync.bucket_bytes): ...
    actor.save_checkpoint(run_dir / "checkpoints" / "step_000010", step=10)
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from asyncrl.actor import checkpoint_state as ckpt_io
from asyncrl.actor.batch import (
    PackedBatch,
    Sample,
    groups_to_samples,
    make_microbatches,
    microbatch_extras,
)
from asyncrl.actor.corrections import CorrectionParams
from asyncrl.actor.layer_spec import attention_path, recompute_settings, resolve_attention, te_available
from asyncrl.actor.logprobs import logprobs_from_logits
from asyncrl.actor.loss import SUM_KEYS, finalize_metrics, policy_loss
from asyncrl.actor.model import (
    actor_spec,
    build_gpt_model,
    check_parallel_sizes,
    check_trainable,
    layer_offset,
    padded_vocab_size,
)
from asyncrl.actor.moe import RoutingStats, clear_routing_replay, filler_sample, fillers_needed, routing_to_replay
from asyncrl.actor.optim import build_optimizer
from asyncrl.actor.pipeline import StageInfo, gather_to_rank0
from asyncrl.actor.scatter import scatter_samples
from asyncrl.actor.schedule import MicroBatch, PipelineSchedule, PlainSchedule
from asyncrl.actor.weights import (
    ExpertShards,
    iter_hf_buckets,
    iter_hf_tensors,
    load_hf_into_model,
)
from asyncrl.broker.types import Group
from asyncrl.cluster.megatron_cpu import apply_cpu_shims, cuda_as_cpu
from asyncrl.config.schema import Config
from asyncrl.models.safetensors_io import save_safetensors
from asyncrl.sync.bucketing import iter_buckets

log = logging.getLogger(__name__)


class Actor:
    def __init__(self, cfg: Config):
        if not dist.is_initialized():
            raise RuntimeError("Actor needs torch.distributed initialised on the actor ranks (the launcher does it)")
        apply_cpu_shims()
        self.cfg = cfg
        self.spec = actor_spec(cfg.actor.model_path)
        self.model_path = Path(cfg.actor.model_path)
        self._init_parallel()
        self._init_compute()
        self.model = self._build_and_load()
        self.routing = RoutingStats(self.model, self.spec, self.device) if self.spec.is_moe else None
        self.ddp, self.optimizer, self.scheduler = build_optimizer(cfg, self.model, self.dtype)
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = self._build_and_load()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.schedule: PlainSchedule | PipelineSchedule = (
            PlainSchedule(self.device, self.attention)
            if self.stage is None
            else PipelineSchedule(self.stage, self.device, self.attention)
        )
        self._version = 0
        self._step = 0
        self.num_skipped_steps = 0
        a = cfg.algorithm
        self.correction_params = CorrectionParams(
            **{f: getattr(a, f) for f in CorrectionParams.__dataclass_fields__}
        )  # the algorithm keys of the same names

    def _init_parallel(self) -> None:
        """Megatron's model parallelism on the actor world (TP x PP, DP = the rest, EP within DP); this rank's
        coordinates."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.tp = self.cfg.actor.tensor_model_parallel_size
        self.pp = self.cfg.actor.pipeline_model_parallel_size
        self.ep = self.cfg.actor.expert_model_parallel_size
        if self.world % self.tp:
            raise ValueError(f"actor.tensor_model_parallel_size={self.tp} must divide the {self.world} actor ranks")
        if self.world % (self.tp * self.pp * self.ep):
            raise ValueError(
                f"actor.tensor_model_parallel_size={self.tp} x actor.expert_model_parallel_size={self.ep} x "
                f"actor.pipeline_model_parallel_size={self.pp} must divide the {self.world} actor ranks"
            )
        self.dp = self.world // (self.tp * self.pp)
        check_parallel_sizes(self.spec, tp=self.tp, pp=self.pp, ep=self.ep)
        check_trainable(self.spec, tp=self.tp)
        sizes = (self.tp, self.pp, self.ep)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=self.tp,
                pipeline_model_parallel_size=self.pp,
                expert_model_parallel_size=self.ep,
            )
        elif sizes != (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        ):
            raise RuntimeError("Megatron model parallelism is already initialised with other TP/PP/EP sizes")
        tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.runner.seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.layer_offset = layer_offset(self.spec, pp=self.pp, pp_rank=self.pp_rank)
        self.experts = ExpertShards.current(self.spec)
        self.stage: StageInfo | None = StageInfo.current() if self.pp > 1 else None
        self.padded_vocab = padded_vocab_size(self.spec.vocab_size, self.tp)
        self.vocab_start = self.tp_rank * (self.padded_vocab // self.tp)

    def _init_compute(self) -> None:
        """Device, dtype, sampling temperature, attention path and activation recompute."""
        acfg, cuda = self.cfg.actor, torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # Log-probs (and entropy) are those of the sampling distribution: logits / temperature, as
        # the engines report them (before top-p/top-k), so the PPO ratio compares like with like.
        temperature = self.cfg.rollout.sampling.temperature
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = torch.bfloat16 if (acfg.params_dtype == "bf16" and cuda) else torch.float32
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

    # ------------------------------------------------------------------ model
    def _build_and_load(self) -> torch.nn.Module:
        model = build_gpt_model(
            self.spec,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            moe_aux_loss_coeff=self.cfg.actor.moe_aux_loss_coeff,
            moe_routing_replay=self.cfg.actor.moe_routing_replay,
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
            experts=self.experts,
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

    def _policy_loss(self, item: MicroBatch, logp, ent):
        """The configured PPO/GRPO loss of one micro-batch: ``logp`` and ``ent`` of its response tokens under the
        current weights; ``item`` carries the rest (``extra``: its ``_extras``; ``prox``, ``ref``: its recomputed
        and reference log-probs, where used)."""
        a, x = self.cfg.algorithm, item.extra
        assert x is not None, "the loss is computed where the loss inputs are"
        return policy_loss(
            logp,
            behav_logp=x["behav"],
            prox_logp=item.prox,
            advantages=x["adv"],
            agg_weight=x["agg"],
            mask=x["mask"],
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            dual_clip=a.dual_clip,
            off_policy_correction=a.off_policy_correction,
            tis_cap=a.tis_cap,
            correction_params=self.correction_params,
            seq=x["seq"],
            staleness=x["staleness"],
            max_token_staleness=a.max_token_staleness,
            entropy=ent,
            entropy_coef=a.entropy_coef,
            ref_logp=item.ref,
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

    def _extras(self, mb: list[Sample]) -> dict[str, torch.Tensor]:
        """The loss inputs of a micro-batch; token staleness against the version the step starts from."""
        return {k: v.to(self.device) for k, v in microbatch_extras(mb, actor_version=self._version).items()}

    # ------------------------------------------------------------------ the step (one path for every PP)
    def _train_items(self, samples: list[Sample]) -> list[MicroBatch]:
        """This DP rank's micro-batches in the schedule's shape (``schedule.pack``), with their loss inputs where the
        loss is computed (PP > 1: packed to the pipeline-wide shape; the loss inputs on the last stage only); for a
        MoE model followed by fillers up to the DP ranks' largest count (``asyncrl.actor.moe``)."""
        idxs = make_microbatches([s.num_tokens for s in samples], self.cfg.actor.max_tokens_per_microbatch)
        mbs = [[samples[i] for i in idx] for idx in idxs]
        real = len(mbs)
        if self.spec.is_moe and self.dp > 1:
            mbs += [[filler_sample()] for _ in range(fillers_needed(real, self.dp_group, self.device))]
        packed = self.schedule.pack([([s.tokens for s in mb], [s.prompt_len for s in mb]) for mb in mbs])
        if self.cfg.actor.moe_routing_replay:
            packed = [routing_to_replay(p, [s.routed_experts for s in mb], self.spec) for p, mb in zip(packed, mbs)]
        extras = [self._extras(mb) if self.schedule.computes_loss else None for mb in mbs]
        return [MicroBatch(p, x, filler=i >= real) for i, (p, x) in enumerate(zip(packed, extras))]

    @torch.no_grad()
    def _old_logprobs(self, items: list[MicroBatch]) -> None:
        """The recomputed (proximal) log-probs of the current weights and the reference model's, when used."""

        def logp(item: MicroBatch, logits: torch.Tensor):
            return self._logprobs_of(logits, item.packed, with_entropy=False)

        if self.cfg.algorithm.off_policy_correction != "none":
            for it, lp in zip(items, self.schedule.forward(self.model, items, logp)):
                it.prox = lp[0].float()
        if self.ref_model is not None:
            for it, lp in zip(items, self.schedule.forward(self.ref_model, items, logp)):
                it.ref = lp[0].float()

    def _loss(self, item: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logp, ent = self._logprobs_of(logits, item.packed, with_entropy=True)
        out = self._policy_loss(item, logp, ent)
        return out.loss, out.sums

    def _accumulate_grads(self, samples: list[Sample]) -> tuple[dict[str, float], int, int]:
        """Forward/backward of this DP rank's samples through the schedule: the loss sums (every stage has them),
        the number of real tokens and of micro-batches."""
        items = self._train_items(samples)
        self._old_logprobs(items)
        if self.routing is not None:
            self.routing.begin_step()
            if self.cfg.actor.moe_routing_replay:
                self.routing.count_replay([it.packed for it in items if not it.filler])
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        # DDP averages gradients over DP ranks; the aggregation weights are already global: x dp.
        data = self.schedule.forward_backward(self.ddp, items, self._loss, grad_scale=self.dp)
        sums: dict[str, float] = defaultdict(float)
        for d in data:
            for k, v in d.items():
                sums[k] += v
        real = [it for it in items if not it.filler]
        return self.schedule.gather_sums(sums), sum(it.packed.num_tokens for it in real), len(real)

    def _reduce_sums(self, sums: dict[str, float], num_seq_tokens: int) -> tuple[dict[str, float], float, bool]:
        """The loss sums and sequence tokens over DP ranks, and whether every actor rank's loss is finite."""
        keys = SUM_KEYS  # fixed order: a rank without samples still joins the all-reduce
        # on the actor's device: NCCL (GPU jobs) only reduces CUDA tensors
        vec = torch.tensor(
            [sums.get(k, 0.0) for k in keys] + [float(num_seq_tokens)], dtype=torch.float64, device=self.device
        )
        if self.dp > 1:
            dist.all_reduce(vec, group=self.dp_group)
        total = dict(zip(keys, vec[:-1].tolist()))
        loss_ok = torch.tensor([1.0 if all(math.isfinite(v) for v in total.values()) else 0.0], device=self.device)
        dist.all_reduce(loss_ok, op=dist.ReduceOp.MIN)
        return total, vec[-1].item(), loss_ok.item() == 1.0

    def _update(self, *, empty: bool, loss_ok: bool) -> tuple[float, bool]:
        """The optimizer step unless the batch is empty or the loss / grad norm is non-finite: (grad norm, applied)."""
        if empty:  # nothing to train on: no update (Adam's momentum would still move the weights)
            log.warning("actor step %d: the batch has no trained token; no update", self._step + 1)
            self.optimizer.zero_grad()
            return 0.0, False
        grad_norm, applied = float("nan"), False
        if loss_ok:
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
        if not applied:
            self.num_skipped_steps += 1
            self.optimizer.zero_grad()
            log.warning(
                "actor step %d skipped: non-finite %s (skipped so far: %d)",
                self._step + 1,
                "gradient norm" if loss_ok else "loss",
                self.num_skipped_steps,
            )
        return grad_norm, applied

    def train_step(self, groups: Sequence[Group] | None, *, step: int | None = None) -> dict[str, float]:
        """One optimizer step on a batch of groups (see the module contract)."""
        t0 = time.perf_counter()
        sums, num_seq_tokens, num_mbs = self._accumulate_grads(self._distribute(groups))
        clear_routing_replay(self.model, self.ref_model)
        # DP all-reduce of the grad buffers, plus the TP all-reduce of replicated weights whose
        # gradient is partial per TP rank (Qwen3's q/k norms), and (PP > 1, tied embeddings) the
        # embedding-group all-reduce that keeps the last stage's copy of the embeddings in sync.
        finalize_model_grads([self.ddp])
        total, global_tokens, loss_ok = self._reduce_sums(sums, num_seq_tokens)
        empty = total["num_tokens"] == 0
        grad_norm, applied = self._update(empty=empty, loss_ok=loss_ok)
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
        if self.routing is not None:
            m.update(self.routing.metrics(num_mbs, tp=self.tp, pp=self.pp))
        return m

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def compute_logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        *,
        with_entropy: bool = False,
        routed_experts: Sequence[torch.Tensor | None] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Log-probs (and entropies) of each sequence's tokens after its prompt, current weights (``routed_experts``:
        each sequence's experts to replay, as ``Sample.routed_experts``, with ``actor.moe_routing_replay``).
        Collective; every rank passes the same inputs and gets the full result (float32, CPU)."""
        idxs = make_microbatches([len(s) for s in sequences], self.cfg.actor.max_tokens_per_microbatch)
        packed = self.schedule.pack(
            [([list(sequences[i]) for i in idx], [prompt_lens[i] for i in idx]) for idx in idxs]
        )
        if routed_experts is not None and self.cfg.actor.moe_routing_replay:
            packed = [routing_to_replay(p, [routed_experts[i] for i in idx], self.spec) for p, idx in zip(packed, idxs)]

        def logp(item: MicroBatch, logits: torch.Tensor):
            return self._logprobs_of(logits, item.packed, with_entropy=with_entropy)

        results = self.schedule.forward(self.model, [MicroBatch(p) for p in packed], logp)
        out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for idx, p, (lp, ent) in zip(idxs, packed, results):  # empty except where the loss is computed
            for k in range(len(idx)):
                sel = (p.seq_of_token == k).to(lp.device)
                out.append((lp[sel].float().cpu(), None if ent is None else ent[sel].float().cpu()))
        clear_routing_replay(self.model)
        return self.schedule.share(out)

    def iter_hf_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in buckets (collective: every actor rank iterates it all)."""
        shards = {"tp_group": self.tp_group, "tp": self.tp, "dtype": dtype, "experts": self.experts}
        if self.stage is None:
            yield from iter_hf_buckets(self.model, self.spec, bucket_bytes, **shards)
            return
        own = iter_hf_tensors(self.model, self.spec, layer_offset=self.layer_offset, **shards)
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
        """Model, optimizer, scheduler, RNG, step and weight version (collective; ``asyncrl.actor.checkpoint``)."""
        return ckpt_io.save_actor_state(self, directory, step=self._step if step is None else int(step))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote (or the model of a converted checkpoint); its meta (collective)."""
        meta = ckpt_io.load_actor_state(self, directory)
        self._step = int(meta["step"])
        self._version = int(meta["weight_version"])
        self.num_skipped_steps = int(meta.get("num_skipped_steps", 0))
        return meta
