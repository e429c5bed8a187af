# long: one documented dataclass per config section, every field with its one-line doc
"""The TOML schema: one frozen dataclass per component, every field typed, defaulted and documented.

Contract
- Precedence: dataclass defaults -> TOML -> ``key.sub=value`` overrides (see ``loader``).
- Fields whose default is *derived* from other fields (the seeds' formulas) are ``None`` here and
  filled in by ``derive.resolve``; the resolved config records which keys were derived.
- Bounds of a single field are checked in ``__post_init__`` (``ConfigError`` naming the dotted
  key); rules across fields live in ``validate.validate``.
- This module never imports torch, megatron or sglang: it must stay light to import.

Setting names follow the two seed documents (RLinf's asynchronous agentic RL page and Miles'
fully async page); where Miles names a flag ``--max-weight-staleness`` we keep RLinf's
``agentloop.max_actor_accept_staleness`` (same meaning) and note the alias in the field doc.

The sections live in ``schema.py`` (run, cluster, training, sync, evaluation, logging, preparation) and
``schema_rollout.py`` (engines, agent loop, broker limits, data); this module re-exports them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from asyncrl.config.checks import ConfigError, non_negative, positive, require
from asyncrl.config.schema_rollout import (
    PAUSE_MODES,
    AgentLoopConfig,
    DataConfig,
    PauseMode,
    RolloutBufferConfig,
    RolloutConfig,
    SamplingConfig,
    SGLangConfig,
    ToolConfig,
)

MAX_SEED = 2**63 - 1  # numpy's and torch's generators take seeds in [0, 2**63)


@dataclass(frozen=True)
class RunnerConfig:
    async_mode: bool = False
    """Overlap generation and training (RLinf ``runner.async_mode``). False: they take turns."""
    max_steps: int = 20
    """Training steps to run."""
    seed: int = 1234
    """Seed of everything (data order, init, sampling)."""
    checkpoint_interval: int = 0
    """Save a checkpoint every N steps (0 = only at the end when ``save_at_end``)."""
    save_at_end: bool = False
    """Save a checkpoint after the last step."""
    resume: Union[Literal["auto"], bool] = False
    """``"auto"``: resume from this run's newest complete checkpoint (same run id and config hash) when it has one,
    else start at step 1 (the Slurm script's default); ``true``: resume, and fail naming the checkpoint directory
    when this run has no checkpoint there (and no ``resume_from``); ``false``: start at step 1, refusing a
    checkpoint directory that already holds complete checkpoints (another run's: choose another
    ``logging.run_dir``)."""
    resume_from: Optional[str] = None
    """A checkpoint directory to start from when this run has no checkpoint of its own yet (any run's)."""
    archive_previous: bool = False
    """Start a new run in a run dir (or ``actor.checkpoint_dir``) that holds another run's checkpoints, or resume one
    with a changed config: that run's checkpoints move to ``<checkpoint dir>/previous/<run id>/`` and its metrics,
    TensorBoard events and summary to ``<run_dir>/previous/<run id>/`` (nothing is deleted). Without it such a start
    is refused, naming the run and the differing keys (a previous run with metrics but no checkpoint is archived
    anyway)."""
    max_nonfinite_steps: int = 3
    """Consecutive steps with a non-finite loss, grad norm or reward after which the run fails (exit 1)."""
    save_hf: bool = False
    """Also export a HF checkpoint with every actor checkpoint (Miles ``--save-hf``)."""
    eval_before_after: bool = True
    """Run the held-out test set before the first and after the last step (embedded default)."""

    def __post_init__(self):
        require(0 <= self.seed <= MAX_SEED, "runner.seed", f"must be in [0, {MAX_SEED}], got {self.seed!r}")
        positive(self.max_steps, "runner.max_steps")
        non_negative(self.checkpoint_interval, "runner.checkpoint_interval")
        positive(self.max_nonfinite_steps, "runner.max_nonfinite_steps")


@dataclass(frozen=True)
class ClusterConfig:
    component_placement: dict[str, str] = field(default_factory=lambda: {"actor": "0", "rollout,reward": "1"})
    """Component -> devices, e.g. ``actor = "0-7"``, ``"rollout,reward" = "8-15"``. Global rank r
    uses device r (on CPU a device is just a rank). A ``reward`` entry is always required."""
    num_nodes: int = 1
    """Nodes of the job (used by ``--dry-run`` outside torchrun; torchrun's WORLD_SIZE wins)."""
    num_devices_per_node: int = 2
    """Devices (GPUs, or CPU ranks) per node; torchrun's LOCAL_WORLD_SIZE wins."""
    store_timeout_s: float = 300.0
    """How long a rank waits for another to publish an address in the discovery store."""
    shutdown_grace_s: float = 10.0
    """Grace period between SIGTERM and SIGKILL when tearing children down."""
    actor_collective_timeout_s: float = 1800.0
    """Timeout of each collective of the actor group (gloo/NCCL). Phases where actor rank 0 works alone
    (eval, waiting for a batch, the end of the run) do not count: the other ranks wait for them on the store."""
    broker_host: Optional[str] = None
    """Address (or host name) of node 0 the broker binds on and advertises; unset: loopback on one node,
    all interfaces and a routable address of node 0 on several."""
    broker_handshake_timeout_s: float = 60.0
    """Each rollout rank's start-up round trip to the broker must answer within this (the error names the address)."""
    broker_unhealthy_after_s: float = 15.0
    """Actor rank 0 pings the broker every second on its own connection; a broker that is alive but answered none
    for this long (stopped, deadlocked, starved) fails the rank at once, naming it as hung (a dead broker fails it
    at once). The actor's own requests would notice a hang only at their deadline: up to
    ``rollout.control_timeout_s``, or a whole batch wait."""
    actor_unresponsive_after_s: float = 30.0
    """Every actor rank bumps a heartbeat in the job's store every second for the whole run. When one stops for this
    long (the rank stopped, or a native call holding the GIL), the other ranks fail the job naming that actor rank
    (every rank watches every actor rank but itself, from that rank's first beat). A slow step never trips it (the
    beat runs on its own thread)."""
    device_memory_gb: float = 80.0
    """Memory of one GPU in GiB: a GPU plan whose actor memory estimate exceeds it is refused (H100/A100 80, H200 141)."""

    def __post_init__(self):
        positive(self.device_memory_gb, "cluster.device_memory_gb")
        positive(self.num_nodes, "cluster.num_nodes")
        positive(self.num_devices_per_node, "cluster.num_devices_per_node")
        positive(self.store_timeout_s, "cluster.store_timeout_s")
        positive(self.actor_collective_timeout_s, "cluster.actor_collective_timeout_s")
        positive(self.broker_handshake_timeout_s, "cluster.broker_handshake_timeout_s")
        require(
            self.broker_unhealthy_after_s >= 2.0,
            "cluster.broker_unhealthy_after_s",
            f"must be >= 2 (s; the broker is pinged every second), got {self.broker_unhealthy_after_s!r}",
        )
        require(
            self.actor_unresponsive_after_s >= 3.0,
            "cluster.actor_unresponsive_after_s",
            f"must be >= 3 (s; the heartbeat is bumped every second), got {self.actor_unresponsive_after_s!r}",
        )
        if self.broker_host is not None:
            require(
                bool(self.broker_host.strip()) and self.broker_host not in ("0.0.0.0", "*", "::"),
                "cluster.broker_host",
                f"must be an address the other nodes connect to, got "
                f"{self.broker_host!r} (the broker binds all interfaces by itself when it is unset)",
            )


@dataclass(frozen=True)
class AlgorithmConfig:
    group_size: int = 5
    """Trajectories per prompt (GRPO group)."""
    normalize_adv_by_std: bool = True
    """GRPO: divide the group-centred reward by the group's std."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: Optional[float] = None
    """Dual-clip constant c (> 1) for negative advantages; unset disables it."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    kl_coef: float = 0.0
    """KL penalty to the reference model (0 = no reference model)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0
    off_policy_correction: Literal[
        "none", "tis", "decoupled", "token_mis", "seq_mis", "geo_mask", "icepop", "dppo", "m2po"
    ] = "none"
    """``none`` (rollout log-prob is the old log-prob, the RLinf default), ``tis`` (truncated IS vs the recomputed
    policy), ``decoupled`` (AReaL), masked IS per token / sequence, a geometric-mean sequence mask, IcePop, DPPO
    (prime-rl's default), M2PO: ``asyncrl.actor.corrections``."""
    tis_cap: float = 2.0
    """Upper bound of the importance weight: truncation under ``tis``, the mask under ``decoupled``,
    ``token_mis`` and (on the sequence's product of ratios) ``seq_mis``."""
    geo_mask_low: float = 0.9
    """``geo_mask``: sequences whose geometric-mean ratio is out of [low, high] are dropped."""
    geo_mask_high: float = 1.1
    icepop_low: float = 0.5
    """``icepop``: tokens whose ratio (recomputed / rollout probability) is out of [low, high] are dropped."""
    icepop_high: float = 5.0
    dppo_mask_low: float = 0.2
    """``dppo``: a negative-advantage token whose probability fell by more than this since the rollout is dropped."""
    dppo_mask_high: float = 0.2
    """``dppo``: a positive-advantage token whose probability rose by more than this is dropped."""
    m2po_tau: float = 0.04
    """``m2po``: bound on the mean squared log-ratio of the tokens kept (the largest are dropped until it holds)."""
    max_token_staleness: Optional[int] = None
    """Tokens generated more than this many weight versions before the step are left out of the loss (per token:
    a trajectory can mix versions under ``in_place``/``retract`` pauses); unset: none is. Any correction."""

    def __post_init__(self):
        positive(self.group_size, "algorithm.group_size")
        require(
            0 <= self.clip_ratio_low < 1, "algorithm.clip_ratio_low", f"must be in [0, 1), got {self.clip_ratio_low!r}"
        )
        non_negative(self.clip_ratio_high, "algorithm.clip_ratio_high")
        if self.dual_clip is not None:
            require(self.dual_clip > 1, "algorithm.dual_clip", f"must be > 1, got {self.dual_clip!r}")
        non_negative(self.kl_coef, "algorithm.kl_coef")
        positive(self.tis_cap, "algorithm.tis_cap")
        for lo, hi in (("geo_mask_low", "geo_mask_high"), ("icepop_low", "icepop_high")):  # 1: on-policy
            a, b = getattr(self, lo), getattr(self, hi)
            require(0 < a <= 1 <= b, f"algorithm.{lo}", f"must satisfy 0 < {lo} <= 1 <= {hi}, got {a!r} and {b!r}")
        for key in ("dppo_mask_low", "dppo_mask_high", "m2po_tau"):
            positive(getattr(self, key), f"algorithm.{key}")
        non_negative(self.max_token_staleness, "algorithm.max_token_staleness")


@dataclass(frozen=True)
class ActorConfig:
    model_path: str = "runs/tiny/model"
    """HF checkpoint (config.json, safetensors, tokenizer) the actor starts from."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    """Experts split over this many actor ranks (Megatron's EP; mixture-of-experts models only): each rank of an EP
    group holds ``num_experts / EP`` experts and tokens reach them by all-to-all. The experts' tensor parallelism is
    ``tensor_model_parallel_size``; TP x EP x PP must divide the actor ranks."""
    moe_aux_loss_coeff: Optional[float] = None
    """Weight of the router's load-balancing loss in the training loss (MoE models only); default: the model's
    ``router_aux_loss_coef`` (config.json). 0 reports the loss without training on it."""
    moe_routing_replay: bool = False
    """Routing replay (MoE models only): the engines return every token's routed experts
    (``--enable-return-routed-experts``), the trajectories carry them, and every actor forward that computes
    log-probs or the loss routes each token to the experts the engine chose (megatron-core's routing replay), so
    the actor trains the experts that sampled the tokens. Not with full activation recompute at PP > 1."""
    params_dtype: Literal["fp32", "bf16"] = "bf16"
    """Training dtype; CPU runs always use fp32."""
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Gradient norm clip (0 disables)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch (packed sequences)."""
    use_distributed_optimizer: bool = False
    checkpoint_dir: Optional[str] = None
    """Where checkpoints go; defaults to ``<run_dir>/checkpoints``."""
    keep_checkpoints: int = 3
    """How many of the run's newest complete checkpoints are kept: a save deletes the older ones (0: keep all).
    More than 1 leaves an intact checkpoint to resume from when the newest is found damaged at resume."""
    attention_backend: Literal["auto", "te", "sdpa", "unfused"] = "auto"
    """Core attention: ``auto`` = TransformerEngine on CUDA when it imports, else ``sdpa`` (PyTorch fused
    attention, per packed sequence); ``unfused`` = Megatron's local attention (S x S probabilities, CPU reference)."""
    recompute_granularity: Literal["none", "full", "selective"] = "none"
    """Activation recompute (Megatron ``recompute_granularity``): ``full`` layers or ``selective`` (core attention)."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With ``full``: ``uniform`` (default) checkpoints every ``recompute_num_layers`` layers as one unit;
    ``block`` checkpoints the first ``recompute_num_layers`` layers of each pipeline stage."""
    recompute_num_layers: Optional[int] = None
    """With ``full``: layers per recompute unit (``uniform``) or layers recomputed per stage (``block``); default 1."""

    def __post_init__(self):
        positive(self.recompute_num_layers, "actor.recompute_num_layers")
        positive(self.tensor_model_parallel_size, "actor.tensor_model_parallel_size")
        positive(self.pipeline_model_parallel_size, "actor.pipeline_model_parallel_size")
        positive(self.expert_model_parallel_size, "actor.expert_model_parallel_size")
        if self.moe_aux_loss_coeff is not None:
            non_negative(self.moe_aux_loss_coeff, "actor.moe_aux_loss_coeff")
        positive(self.lr, "actor.lr")
        require(
            0.0 <= self.min_lr <= self.lr,
            "actor.min_lr",
            f"must be in [0, actor.lr = {self.lr!r}], got {self.min_lr!r}",
        )
        non_negative(self.lr_warmup_steps, "actor.lr_warmup_steps")
        non_negative(self.keep_checkpoints, "actor.keep_checkpoints")
        non_negative(self.grad_clip, "actor.grad_clip")
        positive(self.max_tokens_per_microbatch, "actor.max_tokens_per_microbatch")


# Weight store defaults (sync.catchup = "pull"): a base every 8 versions bounds a read to 1 base + 7 deltas; 2 chains
# keep the previous base while the next chain fills.
_STORE_BASE_INTERVAL = 8
_STORE_KEEP_BASES = 2
DELTA_LOADER = "asyncrl.sync.delta_loader.load_delta"
"""The engines' ``--custom-weight-loader`` of the delta sync (``sync.delta``), also its ``load_format``."""


@dataclass(frozen=True)
class SyncConfig:
    bucket_bytes: int = 512 * 1024 * 1024
    """Bytes per broadcast bucket of the weight sync (512 MiB, as slime/Miles)."""
    flattened_bucket: bool = False
    """Send each bucket as one flat tensor (``load_format = "flattened_bucket"``)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend of the weight-sync group; ``auto`` = nccl with CUDA, else gloo."""
    join_timeout_s: float = 120.0
    """An engine that has not joined the weight-sync group by then fails the run."""
    broadcast_timeout_s: float = 600.0
    """Collective timeout of the formed weight-sync group: one bucket's broadcast (not the join)."""
    step_timeout_s: float = 600.0
    """Timeout of each HTTP step of one sync."""
    group_name: str = "weight_update_group"
    topology: Literal["broadcast", "sharded"] = "broadcast"
    """Who sends the weights: ``broadcast``, actor rank 0 alone (TP all-gather, one weight-update group
    ``group_name``); ``sharded``, every TP rank of rank 0's group its own share (gathered to it over TP), each as rank 0
    of its own group ``<group_name>.r<k>``, so rank 0 carries ~1/TP of the bytes; with PP every stage's TP ranks
    send their stage's share, with EP every EP rank of rank 0's expert-data-parallel replica sends its own experts
    (``asyncrl.sync.sharded``; TP, PP, DP and EP actors)."""
    verify_interval: int = 10
    """Read a few parameters back from every engine (``/get_weights_by_name``) after the first sync and every N-th,
    and fail the run when one differs from what the actor sent (0: never)."""
    catchup: Literal["push", "pull"] = "push"
    """How a restarted engine gets the current weights: ``push`` (a full sync through the re-formed group) or ``pull``
    (actor rank 0 writes every synced version to a weight store; the engine loads the latest with
    ``/update_weights_from_disk`` before it takes work: ``asyncrl.sync.catchup``)."""
    store_dir: Optional[str] = None
    """The weight store's directory under ``catchup = "pull"`` (unset: ``<run_dir>/weight_store``); engines load from
    it by path, so on a cluster it must be on a filesystem every engine node mounts at the same path."""
    store_base_interval: int = _STORE_BASE_INTERVAL
    """Under ``catchup = "pull"``: a full base every N stored versions, deltas (changed tensors only) between."""
    store_keep_bases: int = _STORE_KEEP_BASES
    """Under ``catchup = "pull"``: chains (a base and its deltas) kept in the store; older ones are deleted."""
    wire_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of the weights on the wire (``auto``: the actor's own). The CPU engines then hold their weights at
    it too (``--dtype``); SGLang engines at their own ``--dtype`` (bf16 for a bf16 checkpoint)."""
    delta: bool = False
    """Send only the elements that changed since the last sync, checked per tensor on the engine and resent whole
    where the check fails (``asyncrl.sync.delta_sync``; through ``/update_weights_from_tensor`` and a custom weight
    loader instead of the broadcast; docs/weight_sync.md). The sender keeps one copy of the weights at the wire dtype
    in host memory, and so does each engine rank."""
    delta_max_density: float = 0.5
    """A tensor whose changed fraction is above this goes whole (a delta also goes whole where it would not be
    smaller). In (0, 1]."""
    delta_report_dir: Optional[str] = None
    """Where the engines' delta loaders write their reports for the trainer to read: a directory both see (same
    node, or a shared filesystem). Unset: a temporary directory on the trainer's host (engines on its node)."""

    def __post_init__(self):
        positive(self.bucket_bytes, "sync.bucket_bytes")
        positive(self.store_base_interval, "sync.store_base_interval")
        positive(self.store_keep_bases, "sync.store_keep_bases")
        if self.catchup not in ("push", "pull"):
            raise ValueError(f"sync.catchup must be 'push' or 'pull', got {self.catchup!r}")
        if self.catchup == "pull" and self.topology == "sharded":  # no rank holds every tensor to write the store
            raise ValueError('sync.catchup = "pull" needs sync.topology = "broadcast" (actor rank 0 writes the store)')
        if self.catchup == "push" and (
            self.store_dir is not None
            or self.store_base_interval != _STORE_BASE_INTERVAL
            or self.store_keep_bases != _STORE_KEEP_BASES
        ):
            raise ValueError(
                "sync.store_dir / sync.store_base_interval / sync.store_keep_bases are set but sync.catchup is 'push' "
                "(nothing writes the weight store): set sync.catchup = 'pull' or remove them"
            )
        if not 0 < self.delta_max_density <= 1:
            raise ValueError(f"sync.delta_max_density must be in (0, 1], got {self.delta_max_density!r}")
        if self.delta and self.flattened_bucket:
            raise ValueError(
                "sync.flattened_bucket = true has no effect with sync.delta = true (the delta goes through "
                "/update_weights_from_tensor, not the broadcast): set one of them to false"
            )
        if self.topology == "sharded" and (self.delta or self.wire_dtype != "auto"):
            raise ValueError(
                'sync.delta / sync.wire_dtype apply to sync.topology = "broadcast" (the sharded senders send the '
                "actor's own dtype, whole): set topology = 'broadcast' or drop them"
            )
        non_negative(self.verify_interval, "sync.verify_interval")
        positive(self.join_timeout_s, "sync.join_timeout_s")
        positive(self.broadcast_timeout_s, "sync.broadcast_timeout_s")
        positive(self.step_timeout_s, "sync.step_timeout_s")


@dataclass(frozen=True)
class EvalConfig:
    """The evaluation settings of the Miles fully-async page."""

    eval_interval: Optional[int] = None
    """Evaluate every N steps (unset: no periodic eval)."""
    eval_num_gpus: int = 0
    """Dedicated eval fleet size (0 = evaluate on the shared rollout engines)."""
    eval_num_gpus_per_engine: int = 1
    """TP of the eval fleet's engines."""
    eval_function_path: Optional[str] = None
    """``module:Class`` implementing CheckpointEvalFn (external backend)."""
    eval_hf_dir: Optional[str] = None
    """Snapshot staging directory (tmpfs recommended)."""
    eval_prompt_data: dict[str, str] = field(default_factory=dict)
    """Dataset name -> path."""
    eval_overflow_policy: Literal["backpressure", "skip"] = "backpressure"
    """A due point while ``eval_max_in_flight`` snapshots are being evaluated: wait for a slot, or skip it."""
    eval_keep_snapshots: int = 2
    """Retired snapshots kept on disk."""
    eval_max_in_flight: int = 2
    """Snapshots still being evaluated at once."""
    eval_sglang: dict[str, str] = field(default_factory=dict)
    """Per-field overrides of the rollout engines' SGLang settings for the eval fleet."""
    eval_wait_timeout_s: float = 600.0
    """Longest wait for a free eval slot (``backpressure``) and for pending evals at the end of the run."""
    max_samples: int = 0
    """Prompts evaluated per dataset (the first N, in file order) by the before/after and periodic evals; 0 = all."""
    eval_reload_timeout_s: float = 1800.0
    """Timeout of one eval-fleet engine loading a snapshot (``/update_weights_from_disk``)."""

    def __post_init__(self):
        positive(self.eval_interval, "eval.eval_interval")
        non_negative(self.eval_num_gpus, "eval.eval_num_gpus")
        positive(self.eval_num_gpus_per_engine, "eval.eval_num_gpus_per_engine")
        non_negative(self.eval_keep_snapshots, "eval.eval_keep_snapshots")
        positive(self.eval_max_in_flight, "eval.eval_max_in_flight")
        positive(self.eval_wait_timeout_s, "eval.eval_wait_timeout_s")
        non_negative(self.max_samples, "eval.max_samples")
        positive(self.eval_reload_timeout_s, "eval.eval_reload_timeout_s")


@dataclass(frozen=True)
class WandbConfig:
    """``logging.wandb``: the optional Weights & Biases sink (``pip install asyncrl[wandb]``), on actor rank 0 beside
    TensorBoard and metrics.jsonl (same names, same steps; ``asyncrl/trainer/wandb_sink.py``). Off unless the table
    is given; its files go to ``<run_dir>/wandb/``; the resolved config is the wandb run's config."""

    project: str = "asyncrl"
    entity: Optional[str] = None
    """Team or user (unset: wandb's default entity of the API key)."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """``offline`` writes only the local files (``wandb sync`` uploads them later); ``disabled`` turns the sink off."""
    name: Optional[str] = None
    """Name of the wandb run (unset: the run directory's name)."""
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 90.0
    """Deadline of ``wandb.init`` (online: login and run creation); the run fails at its start when it passes."""
    finish_timeout_s: float = 300.0
    """Longest wait for the uploads at the end of the run; what is left stays in the local files for ``wandb sync``."""

    def __post_init__(self):
        require(bool(self.project.strip()), "logging.wandb.project", "must not be empty")
        positive(self.init_timeout_s, "logging.wandb.init_timeout_s")
        positive(self.finish_timeout_s, "logging.wandb.finish_timeout_s")


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, TensorBoard events, logs, checkpoints."""
    tensorboard: bool = True
    jsonl: bool = True
    console: bool = True
    """One fixed-format progress line per step."""
    engine_metrics_interval_s: float = 5.0
    """How often engines' ``/metrics`` are scraped."""
    custom_rollout_log_function_path: Optional[str] = None
    """Miles ``--custom-rollout-log-function-path``: returning True skips the default logging."""
    custom_eval_rollout_log_function_path: Optional[str] = None
    """Miles ``--custom-eval-rollout-log-function-path``."""
    wandb: Optional[WandbConfig] = None
    """Weights & Biases, e.g. ``wandb = { project = "searchr1", mode = "offline" }`` (``WandbConfig``); unset: off."""


SFT_MATMUL_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PrepareConfig:
    """The embedded default's artefacts, made on first use and cached (``runs/tiny/...``)."""

    enabled: bool = False
    """Make missing data, tokenizer, tiny checkpoint and warm start under ``dir`` before the run."""
    dir: str = "runs/tiny"
    """Layout: ``dir/data/{corpus,train,test}.jsonl``, ``dir/model`` (random), ``dir/model_sft`` (warm start)."""
    seed: int = 0
    num_entities: int = 200
    """Synthetic data size: the knowledge base's made-up countries (``searchr1``'s search-QA), or the training
    problems of ``arith`` (``agentloop.task_name`` picks the data: ``asyncrl.embedded.DATA_MODULES``)."""
    vocab_size: int = 1024
    """Tokenizer size. Small on purpose: made-up names split into syllable pieces shared by all
    names, so copying a name is learned once for all of them (measured: with 4096, where most
    names are single tokens, the warm start needed ~1.5x the steps to reach the same reward)."""
    hidden_size: int = 128
    num_layers: int = 4
    arch: Literal["qwen2", "qwen3_moe"] = "qwen2"
    """Family of the tiny checkpoint: ``qwen2`` (dense), or ``qwen3_moe`` (every layer 8 experts of width
    ``hidden_size / 2``, top-2: the embedded run of a mixture-of-experts model, ``configs/tiny_moe.toml``)."""
    sft_steps: int = 300
    """Supervised warm-start steps on synthetic demonstrations."""
    sft_lr: float = 3e-3
    sft_batch_size: int = 32
    sft_correct_fraction: float = 0.6
    """Fraction of demonstrations that search and copy the right answer (the rest answer wrongly)."""
    sft_wrong_copy_fraction: float = 0.2
    """Fraction that search, then answer a wrong name; the rest (1 - correct - wrong_copy) answer at
    once without searching."""
    sft_weight_decay: float = 0.1
    """AdamW's decoupled weight decay in the warm start (every parameter). It keeps the tiny model from memorizing
    the training entities' facts, so it learns to copy them from the retrieved documents instead, which is what
    carries over to held-out questions (measured on the embedded default, 2026-12-05:
    ``docs/first_run_history.md``)."""
    sft_context_loss_weight: float = 0.3
    """Weight of the next-token loss on prompt and tool tokens (the demos' generated tokens weigh 1):
    the retrieved documents repeat names, which teaches the tiny model to copy much sooner."""
    num_threads: int = 0
    """CPU threads of the warm start (0 = chosen at its start: the cores this process may use that the load
    average leaves idle, at least 1; the choice and its reason are logged; the other ranks only wait for it)."""
    sft_matmul_dtype: str = "float32"
    """Precision of the warm start's matrix products: "float32", or "bfloat16" (weights, optimizer, attention,
    norms and the loss stay float32; the linear layers take bfloat16 inputs, accumulating in float32). Only
    worth it where the CPU multiplies bfloat16 natively (AVX512-BF16, AMX-BF16; elsewhere it is emulated and
    slower). Measured on 2 AMD EPYC cores (2026-12-03): the embedded default's warm start 250 s instead of
    300 s, same losses to 0.01, but held-out accuracy after the 60 RL steps 0.36-0.45 (mean 0.41, 4 runs)
    against 0.46-0.57 (mean 0.52) after the float32 warm start: so float32 stays the default."""

    def __post_init__(self):
        require(0 <= self.seed <= MAX_SEED, "prepare.seed", f"must be in [0, {MAX_SEED}], got {self.seed!r}")
        require(
            self.sft_matmul_dtype in SFT_MATMUL_DTYPES,
            "prepare.sft_matmul_dtype",
            f"must be one of {SFT_MATMUL_DTYPES}, got {self.sft_matmul_dtype!r}",
        )
        non_negative(self.sft_steps, "prepare.sft_steps")
        non_negative(self.num_threads, "prepare.num_threads")
        non_negative(self.sft_weight_decay, "prepare.sft_weight_decay")
        positive(self.sft_lr, "prepare.sft_lr")
        positive(self.sft_batch_size, "prepare.sft_batch_size")
        positive(self.num_entities, "prepare.num_entities")
        positive(self.vocab_size, "prepare.vocab_size")
        positive(self.hidden_size, "prepare.hidden_size")
        positive(self.num_layers, "prepare.num_layers")
        require(
            0.0 <= self.sft_correct_fraction <= 1.0,
            "prepare.sft_correct_fraction",
            f"must be in [0, 1], got {self.sft_correct_fraction!r}",
        )
        require(
            0.0 <= self.sft_wrong_copy_fraction <= 1.0 - self.sft_correct_fraction,
            "prepare.sft_wrong_copy_fraction",
            f"must be in [0, 1 - sft_correct_fraction], got {self.sft_wrong_copy_fraction!r}",
        )


@dataclass(frozen=True)
class Config:
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agentloop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    rollout_buffer: RolloutBufferConfig = field(default_factory=RolloutBufferConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    derived: frozenset[str] = field(default_factory=frozenset)
    """Dotted keys whose value was computed by ``derive.resolve`` (not user-set). Not a TOML key."""


__all__ = [
    "ActorConfig",
    "AgentLoopConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "MAX_SEED",
    "PAUSE_MODES",
    "PauseMode",
    "PrepareConfig",
    "RolloutBufferConfig",
    "RolloutConfig",
    "RunnerConfig",
    "SGLangConfig",
    "SamplingConfig",
    "SyncConfig",
    "ToolConfig",
    "WandbConfig",
]
