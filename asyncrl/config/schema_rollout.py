"""The config's rollout-side sections: the engines (``rollout``, ``rollout.sglang``, ``rollout.sampling``),
the agent loop and its tools (``agentloop``, ``agentloop.tools``), the broker's limits (``rollout_buffer``)
and the prompts (``data``). Part of the schema (``schema.py`` re-exports every class; see its contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from asyncrl.config.checks import non_negative, positive, require


@dataclass(frozen=True)
class SGLangConfig:
    backend_type: Literal["server", "engine"] = "server"
    """RLinf ``rollout.sglang.backend_type``; only ``server`` is implemented (``engine`` is rejected, naming why)."""
    mem_fraction_static: float = 0.8
    """SGLang ``--mem-fraction-static``."""
    extra_args: list[str] = field(default_factory=list)
    """Extra ``sglang.launch_server`` flags, passed through verbatim."""

    def __post_init__(self):
        require(
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
        non_negative(self.temperature, "rollout.sampling.temperature")
        require(0.0 < self.top_p <= 1.0, "rollout.sampling.top_p", f"must be in (0, 1], got {self.top_p!r}")
        require(
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
        positive(self.max_running_requests, "rollout.max_running_requests")
        positive(self.update_weights_interval, "rollout.update_weights_interval")
        positive(self.tensor_parallel_size, "rollout.tensor_parallel_size")
        non_negative(self.max_restarts, "rollout.max_restarts")
        positive(self.start_timeout_s, "rollout.start_timeout_s")
        positive(self.request_timeout_s, "rollout.request_timeout_s")
        positive(self.control_timeout_s, "rollout.control_timeout_s")
        positive(self.health_check_interval_s, "rollout.health_check_interval_s")
        positive(self.health_check_timeout_s, "rollout.health_check_timeout_s")
        positive(self.unhealthy_after_s, "rollout.unhealthy_after_s")
        require(
            self.health_check_timeout_s < self.unhealthy_after_s,
            "rollout.health_check_timeout_s",
            f"must be < rollout.unhealthy_after_s ({self.unhealthy_after_s!r}), got "
            f"{self.health_check_timeout_s!r}: one slow probe must not count as a hang",
        )
        require(0 < self.port < 65536, "rollout.port", f"must be a TCP port, got {self.port!r}")


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
        positive(self.topk, "agentloop.tool.topk")
        positive(self.max_obs_tokens, "agentloop.tool.max_obs_tokens")
        positive(self.timeout_s, "agentloop.tool.timeout_s")
        non_negative(self.max_retries, "agentloop.tool.max_retries")
        non_negative(self.retry_backoff_s, "agentloop.tool.retry_backoff_s")
        non_negative(self.max_outage_s, "agentloop.tool.max_outage_s")


@dataclass(frozen=True)
class PythonToolConfig:
    """The sandboxed ``python`` tool (``asyncrl.agent.tools.python_sandbox``): limits of one call's subprocess."""

    timeout_s: float = 10.0
    """Wall-clock limit of one call (its process group is killed)."""
    cpu_s: int = 10
    """CPU-time limit (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS)."""
    max_output_bytes: int = 8192
    """stdout + stderr kept; past it the program is killed and the observation says so."""
    max_concurrent: Optional[int] = None
    """Calls running at once per worker (unset: the CPU count)."""
    file_size_mb: int = 64
    """Largest file a program may write (RLIMIT_FSIZE) in its temporary directory."""
    network_isolation: Literal["auto", "userns", "netns", "socket-guard"] = "auto"
    """How the network is cut off: ``auto`` takes the strongest this machine allows (a network namespace inside a
    user namespace, a bare network namespace, else a guard on Python's sockets) and logs which."""

    def __post_init__(self):
        positive(self.file_size_mb, "agentloop.python.file_size_mb")
        positive(self.timeout_s, "agentloop.python.timeout_s")
        positive(self.cpu_s, "agentloop.python.cpu_s")
        positive(self.memory_mb, "agentloop.python.memory_mb")
        positive(self.max_output_bytes, "agentloop.python.max_output_bytes")
        positive(self.max_concurrent, "agentloop.python.max_concurrent")


@dataclass(frozen=True)
class AgentLoopConfig:
    task_name: Optional[str] = None
    """The environment (``searchr1``, ``arith``, or ``module:attr`` of your own: docs/environments.md); required in
    async mode."""
    tools: Optional[list[str]] = None
    """Tools given to the environment, replacing its own list: ``search``, ``python``, ``calculator``,
    ``http:<url>`` (a tool server's), ``module:attr``."""
    reward_path: Optional[str] = None
    """``module:function(item, generated_text) -> float | Score`` replacing the environment's ``score``."""
    tool_timeout_s: float = 30.0
    """Deadline of one tool call for tools without their own (``search`` keeps ``agentloop.tool``'s timeouts and
    retries; ``python`` its ``agentloop.python.timeout_s``). A call past it is an error observation."""
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
    python: PythonToolConfig = field(default_factory=PythonToolConfig)

    def __post_init__(self):
        non_negative(self.max_actor_accept_staleness, "agentloop.max_actor_accept_staleness")
        positive(self.tool_timeout_s, "agentloop.tool_timeout_s")
        positive(self.max_turns, "agentloop.max_turns")
        positive(self.max_tokens_per_turn, "agentloop.max_tokens_per_turn")
        positive(self.max_total_tokens, "agentloop.max_total_tokens")
        positive(self.max_requests_per_engine, "agentloop.max_requests_per_engine")
        positive(self.heartbeat_interval_s, "agentloop.heartbeat_interval_s")


@dataclass(frozen=True)
class RolloutBufferConfig:
    max_inflight_groups: Optional[int | Literal["auto"]] = None
    """In-flight limit (engine load). Derived: ceil(max_running_requests x instances x 1.2 / group_size);
    ``"auto"``: the broker starts there and tunes it to the smallest value that keeps the engines saturated."""
    max_concurrent_samples: Optional[int] = None
    """Miles ``--async-max-concurrent-samples``: in-flight cap in trajectories under ``sample`` granularity (derived
    when this is set in async mode); max_inflight_groups defaults to ``value // group_size`` (the ``group`` cap)."""
    max_buffered_groups: Optional[int] = None
    """Buffer limit (data age): in-flight + buffered < this. Derived: 2 x data.rollout_batch_size."""
    async_data_buffer_capacity_factor: Optional[float] = None
    """Miles ``--async-data-buffer-capacity-factor``: the buffer holds floor(factor x data.rollout_batch_size)
    groups; sets max_buffered_groups (unset: 2.0, the derived 2 x B). Setting both is an error."""
    max_dropped_groups_per_step: Optional[int] = None
    """Stop the run past this many drops in one step. Derived: 10 x data.rollout_batch_size."""
    submission_granularity: Optional[Literal["group", "sample"]] = None
    """When a finished unit frees an in-flight slot (Miles ``--rollout-submission-granularity``): ``group`` counts
    groups (RLinf), ``sample`` trajectories (Miles: each frees its own slot). Derived: ``sample`` when
    max_concurrent_samples is set in async mode, else ``group``."""
    unused_groups: Literal["drop", "retry"] = "drop"
    """Aborted or too-stale groups: ``drop`` (prompt returns next epoch) or ``retry`` (re-queued now)
    (Miles ``--async-unused-samples-handler``)."""
    dynamic_sampling_filter_path: Optional[str] = None
    """``module:function(group) -> None | reason`` run at put time; a reason drops the group."""
    sample_filter_path: Optional[str] = None
    """``module:function(groups) -> groups`` run on the assembled batch (Miles ``--rollout-sample-filter-path``)."""
    custom_data_buffer_path: Optional[str] = None
    """``module:Class`` replacing the built-in DataBuffer (Miles ``--custom-async-data-buffer-path``): Miles' contract
    (``asyncrl.broker.miles_buffer``: async put/get) or a subclass of ``asyncrl.broker.buffer.DataBuffer``."""
    no_data_warning_s: float = 30.0
    """Warn ``No completed rollout groups for 30.0s`` when the actor waits that long for nothing."""
    worker_heartbeat_timeout_s: float = 15.0
    """A worker silent for this long is declared dead; its in-flight groups are re-issued."""

    def __post_init__(self):
        if self.max_inflight_groups != "auto":
            positive(self.max_inflight_groups, "rollout_buffer.max_inflight_groups")
        for name in ("max_concurrent_samples", "max_buffered_groups", "max_dropped_groups_per_step"):
            positive(getattr(self, name), f"rollout_buffer.{name}")
        positive(self.async_data_buffer_capacity_factor, "rollout_buffer.async_data_buffer_capacity_factor")
        positive(self.no_data_warning_s, "rollout_buffer.no_data_warning_s")
        positive(self.worker_heartbeat_timeout_s, "rollout_buffer.worker_heartbeat_timeout_s")


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
        positive(self.rollout_batch_size, "data.rollout_batch_size")
        positive(self.max_prompt_tokens, "data.max_prompt_tokens")
