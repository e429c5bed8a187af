"""The actor's mixture-of-experts bookkeeping: filler micro-batches, and how the routers spread a training step's
tokens over the experts.

Contract
- Filler micro-batches: a MoE layer's token all-to-alls (forward and backward) are collective over its EP group,
  whose ranks are DP ranks with their own samples and so their own number of token-budget micro-batches (maybe
  none); and megatron-core weighs each micro-batch's load-balancing loss by 1 / the rank's number of
  micro-batches, which its schedule assumes equal on every DP rank. ``fillers_needed(local, group, device)``
  (collective over the DP group) is how many micro-batches this rank adds so that every DP rank runs as many as
  the busiest (at any EP: the load-balancing loss's weight, 1 / (DP x that number), does not depend on EP); each
  is ``filler_sample()`` (two tokens, nothing trained) and runs in eval mode
  (``asyncrl.actor.layer_spec.response_logits``): its zero loss still backpropagates through the experts (the
  all-to-alls of the backward), its routers attach no load-balancing loss and count nothing.
- ``RoutingStats(model, spec, device)`` hooks every megatron-core router of ``model`` (a ``TopKRouter`` knows
  its global layer number). A router forward in training mode with gradients on (the training forward, or
  its recomputation under full activation recompute: the first forward of a recomputed layer runs without
  gradients) adds, per MoE layer, the tokens it routed to each expert (padding positions left out).
  Log-prob passes (no gradients) are not counted.
- ``begin_step()`` zeroes those counts and megatron-core's tracker of the load-balancing loss (which its
  routers fill during the training forwards: the unweighted loss of each micro-batch, per layer).
- ``metrics(num_microbatches, tp=, pp=)`` (collective over the actor world, the default group; every rank
  gets the same dict; ``{}`` when no token was routed):

  - ``moe/aux_loss``: the unweighted load-balancing loss, mean over MoE layers and over the step's
    micro-batches on every DP rank (only when the loss is on: ``actor.moe_aux_loss_coeff`` > 0);
  - ``moe/expert_load/max_over_mean`` / ``min_over_mean``: per MoE layer, the tokens routed to its busiest /
    idlest expert over the mean per expert (1.0 = balanced), averaged over the layers; counted over the
    whole step and every DP rank;
  - ``moe/expert_load/expert_<e>``: expert e's share of the routed tokens, all layers (at most 16 experts);
  - ``moe/routing_replayed`` (routing replay on): the share of the step's token positions (real micro-batches,
    padding left out) whose engine experts were replayed, as ``count_replay`` counted them.

  The actor world's all-reduce adds the DP ranks' counts (EP ranks route their own tokens: they are DP ranks
  of the router); pipeline stages hold different layers; TP ranks hold the same counts (divided out).

- Routing replay (``actor.moe_routing_replay``: megatron-core's ``RouterReplay`` on every router):
  ``routing_to_replay(packed, routed, spec)`` puts the samples' engine experts (``Sample.routed_experts``, each
  checked by ``check_routing``: ``num_layers * top-k`` a position, experts of the model or -1) into the packed
  micro-batch (``PackedBatch.routed``);
  ``replay_routing(model, routed)``, before each forward of a packed micro-batch (every forward that computes
  log-probs or the loss goes through ``asyncrl.actor.layer_spec.response_logits``, which gives ``routed``:
  ``[tokens, layers * k]`` in the order megatron-core's router flattens its tokens), gives each of ``model``'s
  routers (this pipeline stage's: a ``TopKRouter`` knows its global layer number) its layer's experts, with the action
  ``REPLAY_FORWARD`` (the replayed experts' router probabilities weigh their outputs, so the router still
  learns). A micro-batch without routing (a filler, ``compute_logprobs``) clears the action: the routers
  choose. A position whose experts are unknown (-1: the last position of a sequence, which the engine does
  not route, and padding) replays experts ``0..k-1``: its output reaches no trained token (the last position
  predicts nothing and no later position of its sequence exists; padding is its own causal block). A sample
  without routing beside samples with it would replay those at all its positions: with the setting on, every
  trajectory carries its rows (the agent asks on every request), and ``moe/routing_replayed`` would show a gap.
  With full activation recompute (PP = 1 only, ``asyncrl.config.validate``) a layer's recompute follows its
  forward, whose experts are still set. ``clear_routing_replay(*models)`` drops the experts and the action
  (after each step).

How the load-balancing loss enters the gradient is megatron-core's (``MoEAuxLossAutoScaler``, scaled by each
schedule: ``asyncrl.actor.schedule``).

    stats = RoutingStats(model, spec, device)
    stats.begin_step(); ...forward/backward...; metrics = stats.metrics(num_microbatches, tp=1, pp=1)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from asyncrl.actor.batch import PackedBatch, Sample, with_routing
from asyncrl.models.spec import ModelSpec

# Lazy imports here: megatron-core is imported inside the functions that use it; its import takes seconds
# and probes CUDA.

MAX_EXPERTS_REPORTED = 16
"""``moe/expert_load/expert_<e>`` is reported for models with at most this many experts."""
_AUX = "load_balancing_loss"
"""megatron-core's tracker name of the ``aux_loss`` load-balancing loss."""


def _replay_routers(model: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]


def replay_routing(model: torch.nn.Module, routed: torch.Tensor | None) -> None:
    """Sets ``model``'s routers to replay ``routed`` (``[tokens, layers * k]``, None: the routers choose; see the
    module contract); no-op without routers that replay."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _replay_routers(model)
    if not routers:
        return
    if routed is None:
        for r in routers:
            r.router_replay.clear_router_replay_action()
        return
    k = routers[0].topk
    rows = routed.reshape(len(routed), -1, k).long()
    fill = torch.arange(k, device=rows.device).expand(rows.shape[0], k)
    for r in routers:
        layer = rows[:, r.layer_number - 1]
        target = torch.where((layer < 0).any(dim=1, keepdim=True), fill, layer)
        r.router_replay.set_target_indices(target)
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def routing_to_replay(packed: PackedBatch, routed: Sequence[torch.Tensor | None], spec: ModelSpec) -> PackedBatch:
    """``packed`` with its sequences' engine routing (``Sample.routed_experts``, each checked by ``check_routing``) to
    replay (``asyncrl.actor.batch.with_routing``)."""
    for r in routed:
        if r is not None:
            check_routing(r, spec)
    return with_routing(packed, routed)


def check_routing(routed: torch.Tensor, spec: ModelSpec) -> None:
    """Raises ValueError unless ``routed`` (``Sample.routed_experts``) holds ``num_layers * top-k`` experts a
    position, each an expert of ``spec`` or -1 (unknown)."""
    width = spec.num_layers * spec.num_experts_per_tok
    if routed.dim() != 2 or routed.shape[1] != width:
        raise ValueError(
            f"routed experts: {tuple(routed.shape)} is not [positions, num_layers * top-k = {width}] "
            f"({spec.source}: {spec.num_layers} layers, top-{spec.num_experts_per_tok})"
        )
    if len(routed) and (int(routed.min()) < -1 or int(routed.max()) >= spec.num_experts):
        raise ValueError(
            f"routed experts: values in [{int(routed.min())}, {int(routed.max())}], not experts of {spec.source} "
            f"(0..{spec.num_experts - 1}, or -1: unknown)"
        )


def clear_routing_replay(*models: torch.nn.Module | None) -> None:
    """Drops the replayed experts and the action of the routers of ``models`` (None: none)."""
    for r in (r for m in models if m is not None for r in _replay_routers(m)):
        r.router_replay.clear_indices()
        r.router_replay.clear_router_replay_action()


def fillers_needed(local: int, group: dist.ProcessGroup, device: torch.device) -> int:
    """Micro-batches this rank adds to its ``local`` ones so that its DP ``group`` runs as many as its busiest rank."""
    t = torch.tensor([local], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item()) - local


def filler_sample() -> Sample:
    """Two tokens, the second one predicted and not trained (mask, weight and advantage 0)."""
    return Sample(
        tokens=torch.zeros(2, dtype=torch.long),
        prompt_len=1,
        loss_mask=torch.zeros(1, dtype=torch.bool),
        rollout_logprobs=torch.zeros(1),
        advantage=0.0,
        agg_weight=torch.zeros(1, dtype=torch.float64),
        weight_versions=torch.full((1,), -1, dtype=torch.int32),
    )


class RoutingStats:
    """Tokens per expert and MoE layer over a training step (see the module contract)."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, device: torch.device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.spec = spec
        self.counts = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64, device=device)
        self.replay = torch.zeros(2, dtype=torch.float64, device=device)  # [replayed positions, positions]
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, args, output) -> None:
        if router.training and torch.is_grad_enabled():
            routing_map = output[1]  # [tokens, experts] bool
            padding = args[1] if len(args) > 1 else None  # megatron-core's padding_mask, [s, b]: True = padding
            if padding is not None:
                routing_map = routing_map[~padding.reshape(-1)]
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0).to(self.counts)

    def count_replay(self, batches: Sequence[PackedBatch]) -> None:
        """The step's real micro-batches' positions, and those replayed (``PackedBatch.routed``: a row with an
        expert, not all -1; padding left out)."""
        for p in batches:
            routed = p.routed if p.routed is None or p.padding is None else p.routed[~p.padding]
            known = 0 if routed is None else int((routed >= 0).any(dim=-1).sum())
            self.replay += torch.tensor([known, p.num_tokens], dtype=torch.float64, device=self.replay.device)

    def begin_step(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.replay.zero_()
        clear_aux_losses_tracker()

    def metrics(self, num_microbatches: int, *, tp: int, pp: int) -> dict[str, float]:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        layers = self.spec.num_layers
        tracked = get_moe_layer_wise_logging_tracker().get(_AUX)
        aux = torch.zeros(layers, dtype=torch.float64, device=self.counts.device)
        if tracked is not None:
            aux += tracked["values"][:layers].to(aux)
        flags = torch.tensor(
            [float(num_microbatches), 1.0 if tracked is not None else 0.0], dtype=torch.float64, device=aux.device
        )
        vec = torch.cat([self.counts.flatten(), aux, self.replay, flags])
        dist.all_reduce(vec)  # the actor world; every rank adds the same number of values
        vec /= tp
        counts = vec[: layers * self.spec.num_experts].view(layers, -1)[list(self.spec.moe_layers)]
        aux, (replayed, positions, num_mbs, aux_on) = vec[layers * self.spec.num_experts : -4], vec[-4:].tolist()
        if counts.sum() == 0:
            return {}
        out = summarize(counts, aux_sum=float(aux.sum()) if aux_on else None, num_microbatches=num_mbs / pp)
        if positions:  # counted on every TP rank and pipeline stage alike: the ratio is the step's
            out["moe/routing_replayed"] = replayed / positions
        return out


def summarize(counts: torch.Tensor, *, aux_sum: float | None, num_microbatches: float) -> dict[str, float]:
    """The metrics of ``[moe layers, experts]`` token counts (at least one token) and the load-balancing loss
    summed over layers and micro-batches (None: the loss is off). Pure."""
    per_layer = counts[counts.sum(dim=1) > 0]
    mean = per_layer.mean(dim=1)
    out = {
        "moe/expert_load/max_over_mean": float((per_layer.max(dim=1).values / mean).mean()),
        "moe/expert_load/min_over_mean": float((per_layer.min(dim=1).values / mean).mean()),
    }
    if aux_sum is not None:
        out["moe/aux_loss"] = aux_sum / (num_microbatches * counts.shape[0])
    if counts.shape[1] <= MAX_EXPERTS_REPORTED:
        share = counts.sum(dim=0) / counts.sum()
        out.update({f"moe/expert_load/expert_{e}": float(s) for e, s in enumerate(share)})
    return out
