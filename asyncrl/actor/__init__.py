"""The Megatron actor (issue 6). Light to import: the submodules pull in torch/megatron.

- ``megatron_actor.Actor``: GPTModel from a HF checkpoint, GRPO/PPO training step, log-probs, HF export in
  buckets, checkpoints (see its module contract for which ranks call what).
- ``loss``: pure loss functions (GRPO advantages, PPO clip low/high + dual clip, KL k1/k3,
  off-policy correction none/tis/decoupled, aggregation weights, metrics).
- ``batch``: Groups -> samples (``Sample``; its fields in ``SAMPLE_FIELDS``, from the broker's record
  declaration), DP split balanced by tokens, token-budget micro-batches, packing.
- ``scatter``: rank 0 sends each DP rank its share of the samples (flat tensors laid out by ``SAMPLE_FIELDS``).
- ``logprobs``: vocab-parallel log-probs and entropy.
- ``pipeline``: pipeline parallelism: Megatron's 1F1B / forward-only schedule on fixed-shape
  micro-batches, the HF export of every stage gathered onto global rank 0.
- ``layer_spec``: the attention the model runs (TransformerEngine, fused SDPA per packed sequence, or
  Megatron's unfused reference), the model inputs of a packed batch, activation recompute.
- ``memory``: the per-rank memory estimate (pure) that ``--dry-run`` prints and checks.
- ``model`` / ``convert`` / ``weights``: HF config -> GPTModel (dense or Qwen3-MoE), HF <-> Megatron names
  and TP shards, loading (each EP rank its experts) and bucketed export; ``python -m asyncrl.actor.convert_cli``
  for users.
- ``moe``: mixture of experts: filler micro-batches (every DP rank runs as many), routing metrics (``moe/*``).
- ``schedule``: how micro-batches run through the model, one interface for PP = 1 (plain loop) and PP > 1.
- ``optim``: Megatron's DDP, Adam and the learning-rate schedule.
- ``checkpoint``: the checkpoint layout and its one owner (``CheckpointManager``: atomic saves sealed by a manifest
  of checksums, verified resume, retention), offline HF <-> actor conversion; ``checkpoint_state``: the actor's
  state in a checkpoint.
- ``synthetic``: deterministic synthetic groups and configs for tests and benchmarks.
"""
