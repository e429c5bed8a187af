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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, get_args


class ConfigError(ValueError):
    """A configuration problem, always naming the dotted key at fault and how to fix it."""


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _positive(value, key: str) -> None:
    if value is not None:
        _require(value > 0 and math.isfinite(value), key, f"must be a finite number > 0, got {value!r}")


def _non_negative(value, key: str) -> None:
    if value is not None:
        _require(value >= 0 and math.isfinite(value), key, f"must be a finite number >= 0, got {value!r}")


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
    resume: bool = False
    """Resume from this run's newest complete checkpoint (same run id and config hash) if one exists."""
    resume_from: Optional[str] = None
    """A checkpoint directory to start from when this run has no checkpoint of its own yet (any run's)."""
    max_nonfinite_steps: int = 3
    """Consecutive steps with a non-finite loss, grad norm or reward after which the run fails (exit 1)."""
    save_hf: bool = False
    """Also export a HF checkpoint with every actor checkpoint (Miles ``--save-hf``)."""
    eval_before_after: bool = True
    """Run the held-out test set before the first and after the last step (embedded default)."""

    def __post_init__(self):
        _require(0 <= self.seed <= MAX_SEED, "runner.seed", f"must be in [0, {MAX_SEED}], got {self.seed!r}")
        _positive(self.max_steps, "runner.max_steps")
        _non_negative(self.checkpoint_interval, "runner.checkpoint_interval")
        _positive(self.max_nonfinite_steps, "runner.max_nonfinite_steps")


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
    device_memory_gb: float = 80.0
    """Memory of one GPU in GiB: a GPU plan whose actor memory estimate exceeds it is refused (H100/A100 80, H200 141)."""

    def __post_init__(self):
        _positive(self.device_memory_gb, "cluster.device_memory_gb")
        _positive(self.num_nodes, "cluster.num_nodes")
        _positive(self.num_devices_per_node, "cluster.num_devices_per_node")
        _positive(self.store_timeout_s, "cluster.store_timeout_s")
        _positive(self.actor_collective_timeout_s, "cluster.actor_collective_timeout_s")
        _positive(self.broker_handshake_timeout_s, "cluster.broker_handshake_timeout_s")
        if self.broker_host is not None:
            _require(
                bool(self.broker_host.strip()) and self.broker_host not in ("0.0.0.0", "*", "::"),
                "cluster.broker_host",
                f"must be an address the other nodes connect to, got "
                f"{self.broker_host!r} (the broker binds all interfaces by itself when it is unset)",
            )


@dataclass(frozen=True)
class SGLangConfig:
    backend_type: Literal["server", "engine"] = "server"
    """RLinf ``rollout.sglang.backend_type``; only ``server`` is implemented (``engine`` is rejected, naming why)."""
    mem_fraction_static: float = 0.8
    """SGLang ``--mem-fraction-static``."""
    extra_args: list[str] = field(default_factory=list)
    """Extra ``sglang.launch_server`` flags, passed through verbatim."""

    def __post_init__(self):
        _require(
            0.0 < self.mem_fraction_static <= 1.0,
            "rollout.sglang.mem_fraction_static",
            f"must be in (0, 1], got {self.mem_fraction_static!r}",
        )


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""

    def __post_init__(self):
        _non_negative(self.temperature, "rollout.sampling.temperature")
        _require(0.0 < self.top_p <= 1.0, "rollout.sampling.top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(
            self.top_k == -1 or self.top_k >= 1,
            "rollout.sampling.top_k",
            f"must be -1 (off) or >= 1, got {self.top_k!r}",
        )


PauseMode = Literal["retract", "in_place", "drain", "abort"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
"""The ``rollout.pause_mode`` values, the one list: ``drain`` is the trainer's own (no new turns, wait until the
engines run nothing); the others are the engines' ``/pause_generation`` modes (``asyncrl.engine.client``)."""


@dataclass(frozen=True)
class RolloutConfig:
    rollout_backend: Literal["sglang", "cpu"] = "sglang"
    """``sglang`` (SGLang servers on GPUs) or ``cpu`` (the project's CPU engine, same HTTP API)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    pause_mode: PauseMode = "retract"
    """What in-flight requests do during a weight sync (RLinf ``rollout.pause_mode``)."""
    max_running_requests: int = 64
    """Concurrent requests per engine (SGLang ``--max-running-requests``)."""
    update_weights_interval: int = 1
    """Sync weights into the engines every N training steps."""
    tensor_parallel_size: int = 1
    """Devices per engine (SGLang ``--tp-size``); engines = rollout devices / this."""
    model_path: Optional[str] = None
    """Checkpoint the engines load at start; defaults to ``actor.model_path``."""
    port: int = 30000
    """Port of the first engine on a node; engine k on that node uses port + k * 10."""
    start_timeout_s: float = 1800.0
    """How long to wait for an engine to answer ``/model_info`` after launch (cold starts of large models:
    downloads, weight loading, CUDA graph capture)."""
    max_restarts: int = 2
    """Restarts of a dead or hung engine (rollout and eval fleet) before the run fails."""
    health_check_interval_s: float = 1.0
    """How often a rollout rank checks its engine while the worker runs (process alive + ``/health``)."""
    health_check_timeout_s: float = 3.0
    """Timeout of one ``/health`` probe of that check."""
    unhealthy_after_s: float = 8.0
    """An engine whose ``/health`` probes have failed for this long is declared hung, killed and restarted
    (a hang is called within about interval + timeout + this, i.e. 12 s by default)."""
    request_timeout_s: float = 600.0
    """Timeout of one ``/generate`` call."""
    control_timeout_s: float = 60.0
    """Timeout of pause/continue/update/flush calls."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self):
        _positive(self.max_running_requests, "rollout.max_running_requests")
        _positive(self.update_weights_interval, "rollout.update_weights_interval")
        _positive(self.tensor_parallel_size, "rollout.tensor_parallel_size")
        _non_negative(self.max_restarts, "rollout.max_restarts")
        _positive(self.start_timeout_s, "rollout.start_timeout_s")
        _positive(self.request_timeout_s, "rollout.request_timeout_s")
        _positive(self.control_timeout_s, "rollout.control_timeout_s")
        _positive(self.health_check_interval_s, "rollout.health_check_interval_s")
        _positive(self.health_check_timeout_s, "rollout.health_check_timeout_s")
        _positive(self.unhealthy_after_s, "rollout.unhealthy_after_s")
        _require(
            self.health_check_timeout_s < self.unhealthy_after_s,
            "rollout.health_check_timeout_s",
            f"must be < rollout.unhealthy_after_s ({self.unhealthy_after_s!r}), got "
            f"{self.health_check_timeout_s!r}: one slow probe must not count as a hang",
        )
        _require(0 < self.port < 65536, "rollout.port", f"must be a TCP port, got {self.port!r}")


@dataclass(frozen=True)
class ToolConfig:
    retriever: Literal["bm25", "http"] = "bm25"
    """``bm25`` (in process, bm25s) or ``http`` (Search-R1's ``/retrieve`` server)."""
    corpus_path: Optional[str] = None
    """Search-R1 JSONL corpus for the in-process BM25 retriever."""
    retriever_url: Optional[str] = None
    """``http://host:port/retrieve`` of a Search-R1 retrieval server."""
    topk: int = 3
    """Documents per search."""
    max_obs_tokens: int = 500
    """Tool output is cut to this many tokens."""
    timeout_s: float = 30.0
    """Timeout of one retrieval call."""
    max_retries: int = 3
    """Retries (with exponential backoff) before an outage is declared (new turns wait for the retriever)."""
    max_outage_s: float = 300.0
    """How long the HTTP retriever may stay unreachable before the run fails naming its URL (0 = abort the
    trajectory after the retries instead)."""
    retry_backoff_s: float = 0.5
    """First retry delay of the HTTP retriever; doubles after each failed attempt."""

    def __post_init__(self):
        _positive(self.topk, "agentloop.tool.topk")
        _positive(self.max_obs_tokens, "agentloop.tool.max_obs_tokens")
        _positive(self.timeout_s, "agentloop.tool.timeout_s")
        _non_negative(self.max_retries, "agentloop.tool.max_retries")
        _non_negative(self.retry_backoff_s, "agentloop.tool.retry_backoff_s")
        _non_negative(self.max_outage_s, "agentloop.tool.max_outage_s")


@dataclass(frozen=True)
class AgentLoopConfig:
    task_name: Optional[str] = None
    """Agent task (``searchr1``); required in async mode."""
    max_actor_accept_staleness: Optional[int] = None
    """Drop groups staler than this before training (Miles ``--max-weight-staleness``): the engines' current
    weight version minus the group's oldest (stalest trajectory's) version. Unset: measured, not capped."""
    max_turns: int = 2
    """Generate calls per trajectory."""
    max_tokens_per_turn: int = 500
    """``max_new_tokens`` of one generate call."""
    max_total_tokens: int = 4096
    """Prompt + response limit of a trajectory; longer ones are cut cleanly and marked."""
    max_requests_per_engine: Optional[int] = None
    """Generate calls a worker keeps in flight per engine; defaults to ``rollout.max_running_requests``."""
    chat_template: bool = False
    """Wrap prompts in the tokenizer's chat template (instruct models)."""
    heartbeat_interval_s: float = 2.0
    """How often an agent worker heartbeats to the broker."""
    tool: ToolConfig = field(default_factory=ToolConfig)

    def __post_init__(self):
        _non_negative(self.max_actor_accept_staleness, "agentloop.max_actor_accept_staleness")
        _positive(self.max_turns, "agentloop.max_turns")
        _positive(self.max_tokens_per_turn, "agentloop.max_tokens_per_turn")
        _positive(self.max_total_tokens, "agentloop.max_total_tokens")
        _positive(self.max_requests_per_engine, "agentloop.max_requests_per_engine")
        _positive(self.heartbeat_interval_s, "agentloop.heartbeat_interval_s")


@dataclass(frozen=True)
class RolloutBufferConfig:
    max_inflight_groups: Optional[int | Literal["auto"]] = None
    """In-flight limit (engine load). Derived: ceil(max_running_requests x instances x 1.2 / group_size);
    ``"auto"``: the broker starts there and tunes it to the smallest value that keeps the engines saturated."""
    max_concurrent_samples: Optional[int] = None
    """Miles ``--async-max-concurrent-samples``: in-flight cap in trajectories; when set,
    max_inflight_groups defaults to ``value // group_size`` instead."""
    max_buffered_groups: Optional[int] = None
    """Buffer limit (data age): in-flight + buffered < this. Derived: 2 x data.rollout_batch_size."""
    async_data_buffer_capacity_factor: Optional[float] = None
    """Miles ``--async-data-buffer-capacity-factor``: the buffer holds floor(factor x data.rollout_batch_size)
    groups; sets max_buffered_groups (unset: 2.0, the derived 2 x B). Setting both is an error."""
    max_dropped_groups_per_step: Optional[int] = None
    """Stop the run past this many drops in one step. Derived: 10 x data.rollout_batch_size."""
    submission_granularity: Optional[Literal["group", "sample"]] = None
    """When a finished unit frees an in-flight slot (Miles ``--rollout-submission-granularity``).
    Derived: ``sample`` in async mode, ``group`` otherwise."""
    unused_groups: Literal["drop", "retry"] = "drop"
    """Aborted or too-stale groups: ``drop`` (prompt returns next epoch) or ``retry`` (re-queued now)
    (Miles ``--async-unused-samples-handler``)."""
    dynamic_sampling_filter_path: Optional[str] = None
    """``module:function(group) -> None | reason`` run at put time; a reason drops the group."""
    sample_filter_path: Optional[str] = None
    """``module:function(groups) -> groups`` run on the assembled batch (Miles ``--rollout-sample-filter-path``)."""
    custom_data_buffer_path: Optional[str] = None
    """``module:Class`` replacing the built-in DataBuffer (Miles ``--custom-async-data-buffer-path``)."""
    no_data_warning_s: float = 30.0
    """Warn ``No completed rollout groups for 30.0s`` when the actor waits that long for nothing."""
    worker_heartbeat_timeout_s: float = 15.0
    """A worker silent for this long is declared dead; its in-flight groups are re-issued."""

    def __post_init__(self):
        if self.max_inflight_groups != "auto":
            _positive(self.max_inflight_groups, "rollout_buffer.max_inflight_groups")
        for name in ("max_concurrent_samples", "max_buffered_groups", "max_dropped_groups_per_step"):
            _positive(getattr(self, name), f"rollout_buffer.{name}")
        _positive(self.async_data_buffer_capacity_factor, "rollout_buffer.async_data_buffer_capacity_factor")
        _positive(self.no_data_warning_s, "rollout_buffer.no_data_warning_s")
        _positive(self.worker_heartbeat_timeout_s, "rollout_buffer.worker_heartbeat_timeout_s")


@dataclass(frozen=True)
class DataConfig:
    rollout_batch_size: int = 8
    """Groups (prompts) trained per step."""
    train_path: Optional[str] = None
    """Search-R1 parquet or JSONL of training prompts."""
    test_path: Optional[str] = None
    """Held-out prompts for evaluation."""
    shuffle: bool = True
    """Seeded shuffle per epoch."""
    max_prompt_tokens: int = 4096
    """Prompts longer than this (as the agent loop sends them) are skipped by the broker with a counted warning
    and ``data/skipped_long_prompts``."""

    def __post_init__(self):
        _positive(self.rollout_batch_size, "data.rollout_batch_size")
        _positive(self.max_prompt_tokens, "data.max_prompt_tokens")


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
    off_policy_correction: Literal["none", "tis", "decoupled"] = "none"
    """``none`` (rollout log-prob is the old log-prob, the RLinf default), ``tis`` (truncated
    importance sampling vs the recomputed policy), ``decoupled`` (AReaL's decoupled PPO)."""
    tis_cap: float = 2.0
    """Truncation of the importance weight under ``tis``/``decoupled``."""

    def __post_init__(self):
        _positive(self.group_size, "algorithm.group_size")
        _require(
            0 <= self.clip_ratio_low < 1, "algorithm.clip_ratio_low", f"must be in [0, 1), got {self.clip_ratio_low!r}"
        )
        _non_negative(self.clip_ratio_high, "algorithm.clip_ratio_high")
        if self.dual_clip is not None:
            _require(self.dual_clip > 1, "algorithm.dual_clip", f"must be > 1, got {self.dual_clip!r}")
        _non_negative(self.kl_coef, "algorithm.kl_coef")
        _positive(self.tis_cap, "algorithm.tis_cap")


@dataclass(frozen=True)
class ActorConfig:
    model_path: str = "runs/tiny/model"
    """HF checkpoint (config.json, safetensors, tokenizer) the actor starts from."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
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
        _positive(self.recompute_num_layers, "actor.recompute_num_layers")
        _positive(self.tensor_model_parallel_size, "actor.tensor_model_parallel_size")
        _positive(self.pipeline_model_parallel_size, "actor.pipeline_model_parallel_size")
        _positive(self.lr, "actor.lr")
        _require(
            0.0 <= self.min_lr <= self.lr,
            "actor.min_lr",
            f"must be in [0, actor.lr = {self.lr!r}], got {self.min_lr!r}",
        )
        _non_negative(self.lr_warmup_steps, "actor.lr_warmup_steps")
        _non_negative(self.grad_clip, "actor.grad_clip")
        _positive(self.max_tokens_per_microbatch, "actor.max_tokens_per_microbatch")


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

    def __post_init__(self):
        _positive(self.bucket_bytes, "sync.bucket_bytes")
        _positive(self.join_timeout_s, "sync.join_timeout_s")
        _positive(self.broadcast_timeout_s, "sync.broadcast_timeout_s")
        _positive(self.step_timeout_s, "sync.step_timeout_s")


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
        _positive(self.eval_interval, "eval.eval_interval")
        _non_negative(self.eval_num_gpus, "eval.eval_num_gpus")
        _positive(self.eval_num_gpus_per_engine, "eval.eval_num_gpus_per_engine")
        _non_negative(self.eval_keep_snapshots, "eval.eval_keep_snapshots")
        _positive(self.eval_max_in_flight, "eval.eval_max_in_flight")
        _positive(self.eval_wait_timeout_s, "eval.eval_wait_timeout_s")
        _non_negative(self.max_samples, "eval.max_samples")
        _positive(self.eval_reload_timeout_s, "eval.eval_reload_timeout_s")


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


@dataclass(frozen=True)
class PrepareConfig:
    """The embedded default's artefacts, made on first use and cached (``runs/tiny/...``)."""

    enabled: bool = False
    """Make missing data, tokenizer, tiny checkpoint and warm start under ``dir`` before the run."""
    dir: str = "runs/tiny"
    """Layout: ``dir/data/{corpus,train,test}.jsonl``, ``dir/model`` (random), ``dir/model_sft`` (warm start)."""
    seed: int = 0
    num_entities: int = 200
    """Synthetic knowledge-base size (entities with facts)."""
    vocab_size: int = 1024
    """Tokenizer size. Small on purpose: made-up names split into syllable pieces shared by all
    names, so copying a name is learned once for all of them (measured: with 4096, where most
    names are single tokens, the warm start needed ~1.5x the steps to reach the same reward)."""
    hidden_size: int = 128
    num_layers: int = 4
    sft_steps: int = 300
    """Supervised warm-start steps on synthetic demonstrations."""
    sft_lr: float = 3e-3
    sft_batch_size: int = 32
    sft_correct_fraction: float = 0.6
    """Fraction of demonstrations that search and copy the right answer (the rest answer wrongly)."""
    sft_wrong_copy_fraction: float = 0.2
    """Fraction that search, then answer a wrong name; the rest (1 - correct - wrong_copy) answer at
    once without searching."""
    sft_context_loss_weight: float = 0.3
    """Weight of the next-token loss on prompt and tool tokens (the demos' generated tokens weigh 1):
    the retrieved documents repeat names, which teaches the tiny model to copy much sooner."""
    num_threads: int = 0
    """CPU threads of the warm start (0 = every core this process may use: the other ranks only
    wait for it)."""

    def __post_init__(self):
        _require(0 <= self.seed <= MAX_SEED, "prepare.seed", f"must be in [0, {MAX_SEED}], got {self.seed!r}")
        _non_negative(self.sft_steps, "prepare.sft_steps")
        _non_negative(self.num_threads, "prepare.num_threads")
        _positive(self.sft_lr, "prepare.sft_lr")
        _positive(self.sft_batch_size, "prepare.sft_batch_size")
        _positive(self.num_entities, "prepare.num_entities")
        _positive(self.vocab_size, "prepare.vocab_size")
        _positive(self.hidden_size, "prepare.hidden_size")
        _positive(self.num_layers, "prepare.num_layers")
        _require(
            0.0 <= self.sft_correct_fraction <= 1.0,
            "prepare.sft_correct_fraction",
            f"must be in [0, 1], got {self.sft_correct_fraction!r}",
        )
        _require(
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
