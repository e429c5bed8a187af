"""The torchrun entry: config -> validation -> role -> role body. Runs on every rank.

Contract
- Every rank loads and validates the same TOML (+ ``key=value`` overrides); a bad config fails
  here, on every rank, before any process starts (exit code 2, the error names the key).
- ``--dry-run`` prints the resolved config (derived values marked) and the rank -> role -> device
  plan (with the experts' grid for an MoE model: EP x expert-DP, expert TP = TP) and the actor's per-rank
  memory estimate (an MoE model's dense part and the rank's ``num_experts / EP`` experts) on each node's first process, then exits 0 on every
  rank; with a node rank in the environment (``GROUP_RANK`` as torchrun sets it, ``NODE_RANK``,
  ``SLURM_NODEID``) also that node's own rows.
- A model the actor cannot run (``actor.model_path``: a ``model_type`` other than qwen2, qwen3, llama, qwen3_moe,
  or a feature ``asyncrl.models.spec.require`` refuses), or the CPU engine cannot (``rollout.model_path``), is a
  config error too, dry run or not, naming the key and the field (``check_models``); so are the expert settings
  the actor's model does not fit: ``actor.expert_model_parallel_size`` not dividing its ``num_experts``, or EP > 1,
  ``actor.moe_aux_loss_coeff`` or ``actor.moe_routing_replay`` set for a dense model (MoE models only, never accepted
  and ignored). The model
  is read from ``actor.model_path``'s config.json, or known by name (``asyncrl.actor.memory.known_shape``).
- A GPU job (``rollout.rollout_backend = "sglang"``) whose actor estimate exceeds
  ``cluster.device_memory_gb`` (times ``asyncrl.actor.memory.USABLE_FRACTION``) is refused like a
  bad config, dry run or not; the error names the keys that shrink it.
- Otherwise each rank takes its role from ``cluster.component_placement`` and calls its body in
  ``asyncrl.runner.roles`` with a ``RankContext``. Children (broker, engines) are supervised by
  ``asyncrl.cluster.process``: SIGTERM/Ctrl-C stop them; if any rank fails, torchrun stops the
  others and their children go with them; if torchrun itself dies (SIGKILL), every rank notices
  its parent is gone (``start_parent_watchdog``), stops its children and exits.
- ``runner.resume`` is decided before any process starts (``asyncrl.trainer.resume.check_resume``): rank 0 logs
  the decision (resuming which checkpoint, or starting at step 1); one it cannot honour is a config error (exit 2)
  naming the checkpoint directory.
- A rank stopped by a preemption (``Preempted``: its checkpoint is written) writes ``<run dir>/preempted.json``
  (step, checkpoint, signal) and exits ``PREEMPT_EXIT_CODE`` (75); torchrun turns that into its own exit 1, so the
  Slurm script (``launch/slurm/searchr1.sbatch``) reads the file to requeue the job.
- Every rank first keeps its freed heap memory for reuse (``asyncrl.cluster.malloc``: no page faults
  re-touching each step's activations; the warm start ran ~15% faster a step, measured).

    torchrun --nproc_per_node 2 launch/train.py configs/tiny.toml [key=value ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.actor.memory import GIB, USABLE_FRACTION, ModelShape, estimate_actor_memory, known_shape
from asyncrl.agent.envs import check_agent
from asyncrl.broker.buffer_plugin import check_custom_buffer
from asyncrl.cluster import process
from asyncrl.cluster.malloc import retain_freed_memory
from asyncrl.config import Config, ConfigError, load_config, validate
from asyncrl.config.derive import explain
from asyncrl.config.flags import flag_answer, unknown_flags
from asyncrl.config.placement import Placement, parse_placement
from asyncrl.config.render import render_config
from asyncrl.config.validate import check_hooks, check_inputs, job_world_size
from asyncrl.models.spec import ACTOR, CPU_ENGINE, ModelSpec, require
from asyncrl.runner import roles
from asyncrl.trainer.guards import PREEMPT_EXIT_CODE, PREEMPTED_MARKER, Preempted, ignore_preempt_signal
from asyncrl.trainer.resume import check_resume, check_run_dir

log = logging.getLogger("asyncrl.launcher")


@dataclass
class RankContext:
    """What a role body needs to know about this rank and the job."""

    cfg: Config
    config_path: str
    overrides: list[str]
    rank: int
    world_size: int
    local_rank: int
    placement: Placement
    run_dir: Path
    started_at: float = field(default_factory=time.time)
    """When this rank's launcher started (the summary reports wall time from here)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in one-off phases (``prepare``), for the summary."""

    @property
    def role(self) -> str:
        return self.placement.role_of(self.rank)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/train.py", description="asyncrl trainer (run under torchrun)")
    p.add_argument("config", help="TOML config, e.g. configs/tiny.toml")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides (TOML literals)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan, then exit")
    argv = sys.argv[1:] if argv is None else argv
    flags = unknown_flags(argv, [o for a in p._actions for o in a.option_strings])
    if flags:  # a Miles flag or a key written as a flag: answered with the override it means (exit 2)
        p.error(
            "settings are key.sub=value overrides after the TOML, not flags:\n  "
            + "\n  ".join(flag_answer(*f) for f in flags)
        )
    return p.parse_intermixed_args(argv)  # key=value overrides before or after --dry-run


def _plan_rows(cfg: Config, placement: Placement) -> list[tuple[int, str]]:
    """(node, row) of every rank of the plan table."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.cluster.num_devices_per_node)
    gpu = cfg.rollout.rollout_backend == "sglang"
    rows = []
    for r in range(placement.world_size):
        role = placement.role_of(r)
        node, local = divmod(r, per_node)
        device = f"cuda:{local}" if gpu else f"cpu (rank {r})"
        detail = ""
        if role == "actor":
            i = placement.actor_ranks.index(r)
            detail = f"actor rank {i}/{len(placement.actor_ranks)}"
            if i == 0:
                detail += " + broker process + weight-sync rank 0"
        elif role == "rollout":
            e = placement.engine_of(r)
            ranks = placement.engines[e]
            kind = "SGLang server" if gpu else "CPU engine"
            detail = (
                f"engine {e} ({kind}, TP {len(ranks)}) launcher + agent worker"
                if r == ranks[0]
                else f"engine {e} TP rank {ranks.index(r)} (held by the engine's first rank)"
            )
        elif role == "eval":
            tp = cfg.eval.eval_num_gpus_per_engine
            e, ranks = next((i, rs) for i, rs in enumerate(placement.eval_engines(tp)) if r in rs)
            detail = (
                f"eval fleet engine {e} (TP {tp}) launcher"
                if r == ranks[0]
                else f"eval fleet engine {e} TP rank {ranks.index(r)}"
            )
        else:
            detail = "idle (reward is computed in the agent loop)"
        rows.append((node, f"{r:<5} {node:<5} {role:<8} {device:<13} {detail}"))
    return rows


_PLAN_HEADER = "rank  node  role     device        detail"


def render_plan(cfg: Config, placement: Placement, *, num_experts: int = 0) -> str:
    """The plan table under its head line; ``num_experts`` (of the actor's model; 0: dense or not known) adds the
    experts' grid and their count on a rank (the grid alone with EP > 1 and a model not known yet)."""
    rows = [_PLAN_HEADER] + [row for _, row in _plan_rows(cfg, placement)]
    mode = "async" if cfg.runner.async_mode else "sync"
    tp, pp = cfg.actor.tensor_model_parallel_size, cfg.actor.pipeline_model_parallel_size
    dp = len(placement.actor_ranks) // (tp * pp)
    head = (
        f"# plan: {placement.world_size} ranks, mode {mode}, {len(placement.engines)} engine(s), "
        f"actor TP {tp} x PP {pp} x DP {dp}"
    )
    ep = cfg.actor.expert_model_parallel_size
    if num_experts or ep > 1:  # EP > 1 with a model not read yet (made by prepare): the grid without the count
        head += f"; experts EP {ep} x expert-DP {dp // ep} (expert TP = TP {tp})"
    if num_experts:
        head += f": {num_experts // ep} of the {num_experts} experts of each MoE layer on a rank"
    return head + "\n" + "\n".join(rows) + "\n"


def node_rank_from_env() -> int | None:
    """This node's rank as torchrun (``GROUP_RANK``), a launcher script (``NODE_RANK``) or Slurm (``SLURM_NODEID``)
    sets it; None when none is set."""
    for key in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if os.environ.get(key, "").strip():
            try:
                return int(os.environ[key])
            except ValueError:
                raise ConfigError(f"{key}: expected a node rank (integer), got {os.environ[key]!r}") from None
    return None


def render_node_plan(cfg: Config, placement: Placement, node: int) -> str:
    """The plan rows of one node: what this node's ranks run and on which devices."""
    rows = [row for n, row in _plan_rows(cfg, placement) if n == node]
    if not rows:
        num_nodes = max(n for n, _ in _plan_rows(cfg, placement)) + 1
        raise ConfigError(
            f"node rank {node}: the job has {placement.world_size} ranks on {num_nodes} node(s) "
            f"(cluster.num_devices_per_node / LOCAL_WORLD_SIZE per node); no rank runs on node {node}"
        )
    roles = sorted({row.split()[2] for row in rows})
    return (
        f"# this node: node {node}, {len(rows)} ranks, roles {', '.join(roles)}\n"
        + "\n".join([_PLAN_HEADER, *rows])
        + "\n"
    )


def _print_dry_run(args: argparse.Namespace, cfg: Config, placement: Placement, memory_line: str) -> None:
    """Printed by each node's first process (or the one process outside torchrun)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    print(f"# resolved config of {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    print(render_config(cfg))
    shape, _ = _model_shape(cfg.actor.model_path)
    print(render_plan(cfg, placement, num_experts=shape.num_experts if shape else 0))
    print(memory_line)
    print("\n".join(f"# {line}" for line in explain(cfg)) + "\n")
    node = node_rank_from_env()
    if node is not None:
        print(render_node_plan(cfg, placement, node))


def _model_shape(model_path: str) -> tuple[ModelShape | None, str]:
    p = Path(model_path) / "config.json"
    if p.is_file():
        try:
            return ModelShape.from_hf_config(json.loads(p.read_text())), str(p)
        except (ValueError, KeyError, TypeError) as e:  # unreadable: the estimate is skipped, loading reports it
            log.warning("actor memory not estimated: %s is not a usable HF config (%s: %s)", p, type(e).__name__, e)
            return None, ""
    shape = known_shape(model_path)
    return shape, ("the known shape of " + Path(model_path).name if shape else "")


def check_models(cfg: Config) -> None:
    """A model the actor or the CPU engine cannot run is a config error before any process starts (dry run or not),
    naming the key and the field: a ``model_type`` outside the family both run (qwen2, qwen3, llama), any other
    field ``ModelSpec`` refuses, or what only that consumer lacks (``asyncrl.models.spec.require``). The actor
    always loads ``actor.model_path``; ``rollout.model_path`` is checked for the CPU engine only (SGLang runs
    many more families). Paths without a config.json yet (made by ``prepare``, or downloaded later) are left to
    the loaders, which report them; the expert settings are checked against the actor's model where its shape is
    known (its config.json, or a public model known by name), see ``check_experts``."""
    checks = [("actor.model_path", cfg.actor.model_path, ACTOR)]
    if cfg.rollout.rollout_backend == "cpu":
        checks.append(("rollout.model_path", cfg.rollout.model_path or cfg.actor.model_path, CPU_ENGINE))
    for key, path, consumer in checks:
        if not (Path(path) / "config.json").is_file():
            continue
        try:  # the consumer's own loader reads it the same way, and would fail the same way, later
            require(ModelSpec.from_pretrained(path), consumer)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{key}: {e}") from None
    if cfg.rollout.rollout_backend == "sglang":
        _check_sglang_moe(cfg.rollout.model_path or cfg.actor.model_path)
    shape, source = _model_shape(cfg.actor.model_path)
    if shape is not None:
        check_experts(cfg, shape, source)


def _check_sglang_moe(path: str) -> None:
    """SGLang 0.5.23 builds every layer of a Qwen3-MoE sparse, whatever ``mlp_only_layers`` or
    ``decoder_sparse_step`` say: a dense layer's MLP weights are dropped by its loader and the layer runs experts
    that were never loaded (docs/sglang_differences.md). Such a model is refused for the SGLang backend."""
    if not (Path(path) / "config.json").is_file():
        return
    try:
        spec = ModelSpec.from_pretrained(path)
    except (ValueError, KeyError, TypeError):
        return  # SGLang serves families ModelSpec does not read; its own loader judges them
    if spec.is_moe and len(spec.moe_layers) != spec.num_layers:
        dense = [i for i in range(spec.num_layers) if not spec.is_moe_layer(i)]
        raise ConfigError(
            f"rollout.model_path: {spec.source} is a {spec.model_type} with dense layers {dense} "
            f"(mlp_only_layers / decoder_sparse_step): SGLang 0.5.23 builds every layer sparse and drops a dense "
            f"layer's MLP weights, so it would serve another model (docs/sglang_differences.md)"
        )


def check_experts(cfg: Config, shape: ModelShape, source: str) -> None:
    """The expert settings against the actor's model (``source`` names where its shape was read): EP must divide
    ``num_experts`` (megatron-core places ``num_experts / EP`` experts on each rank of an EP group); an MoE model trains
    at TP 1 only (megatron-core needs sequence parallelism for MoE at TP > 1, which the actor does not use); EP > 1,
    ``actor.moe_aux_loss_coeff`` and ``actor.moe_routing_replay`` are for MoE models only. The grid (TP x EP x PP
    dividing the actor ranks) needs no model and is ``asyncrl.config.validate``'s."""
    a = cfg.actor
    ep = a.expert_model_parallel_size
    if shape.num_experts and shape.num_experts % ep:
        raise ConfigError(
            f"actor.expert_model_parallel_size: EP {ep} does not divide the {shape.num_experts} experts of "
            f"{source} (each rank of an EP group holds num_experts / EP of them)"
        )
    if shape.num_experts and a.tensor_model_parallel_size > 1:  # the actor's own check (actor.model.check_trainable)
        raise ConfigError(
            f"actor.tensor_model_parallel_size: TP {a.tensor_model_parallel_size} with the mixture-of-experts model "
            f"{source}: megatron-core trains MoE layers at TP > 1 only with sequence parallelism, which the actor does "
            "not use; set it to 1 and split the experts with actor.expert_model_parallel_size"
        )
    if not shape.num_experts and ep > 1:
        raise ConfigError(
            f"actor.expert_model_parallel_size: EP {ep} is for MoE models only; {source} is a dense model "
            f"(no num_experts); remove it (default 1)"
        )
    if not shape.num_experts and a.moe_aux_loss_coeff is not None:
        raise ConfigError(
            f"actor.moe_aux_loss_coeff: {a.moe_aux_loss_coeff} is for MoE models only (the router's "
            f"load-balancing loss); {source} is a dense model (no num_experts); remove it"
        )
    if not shape.num_experts and a.moe_routing_replay:
        raise ConfigError(
            f"actor.moe_routing_replay: routing replay is for MoE models only; {source} is a dense model "
            f"(no num_experts, no routed experts to replay); remove it"
        )


def actor_memory(cfg: Config, placement: Placement) -> str:
    """The actor's per-rank memory estimate as a line; raises ConfigError when a GPU plan cannot fit."""
    a = cfg.actor
    shape, source = _model_shape(a.model_path)
    if shape is None:
        return (
            f"# actor memory: not estimated (no usable config.json in actor.model_path = {a.model_path!r} "
            "and not a known model)"
        )
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    gpu = cfg.rollout.rollout_backend == "sglang"
    est = estimate_actor_memory(
        shape,
        tp=tp,
        pp=pp,
        dp=max(1, len(placement.actor_ranks) // (tp * pp)),
        ep=a.expert_model_parallel_size,
        bf16=gpu and a.params_dtype == "bf16",
        microbatch_tokens=a.max_tokens_per_microbatch,
        row_len=min(a.max_tokens_per_microbatch, cfg.agentloop.max_total_tokens),
        distributed_optimizer=a.use_distributed_optimizer,
        ref_model=cfg.algorithm.kl_coef > 0,
        attention="unfused" if a.attention_backend == "unfused" else "fused",
        recompute_granularity=a.recompute_granularity,
        recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers,
    )
    line = f"# actor memory ({source}, {a.max_tokens_per_microbatch} tokens per micro-batch): {est.render()}"
    budget = cfg.cluster.device_memory_gb * USABLE_FRACTION
    if not gpu:
        return line + " [CPU run: not checked against a device]"
    if est.total / GIB > budget:
        parallel = "actor.tensor_model_parallel_size / actor.pipeline_model_parallel_size" + (
            " / actor.expert_model_parallel_size" if shape.num_experts else ""
        )
        raise ConfigError(
            f"actor memory estimate {est.total / GIB:.1f} GiB per rank ({est.render()}) exceeds "
            f"{USABLE_FRACTION:g} x cluster.device_memory_gb = {budget:.1f} GiB; lower "
            f'actor.max_tokens_per_microbatch, set actor.recompute_granularity = "full", raise '
            f"{parallel}, set actor.use_distributed_optimizer = true, or set cluster.device_memory_gb to the real GPU size"
        )
    return line + f" [fits {budget:.1f} GiB = {USABLE_FRACTION:g} x cluster.device_memory_gb]"


def _inputs_ok(cfg: Config, rank: int) -> bool:
    """The paths, the hooks, the run directory (nothing of another run written into) and the resume decision (rank 0
    logs it); False after printing a config error."""
    try:
        check_inputs(cfg)
        check_run_dir(cfg)  # read only, every rank
        resume_line = check_resume(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return False
    if rank == 0:
        log.info("%s", resume_line)
    return True


def _preempted(run_dir: Path, e: Preempted) -> int:
    """Write ``<run_dir>/PREEMPTED_MARKER`` (atomically): this job stopped for a preemption with its checkpoint
    written (the Slurm script requeues the job on it; torchrun reports a rank's exit 75 as its own 1); say so and
    return ``PREEMPT_EXIT_CODE``."""
    tmp = run_dir / f"{PREEMPTED_MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"step": e.step, "checkpoint": e.path, "signal": e.signame}) + "\n")
    tmp.replace(run_dir / PREEMPTED_MARKER)
    print(
        f'asyncrl: {e}; exit {PREEMPT_EXIT_CODE}; resume with runner.resume = "auto" (or true) and the same '
        f"logging.run_dir",
        file=sys.stderr,
        flush=True,
    )
    return PREEMPT_EXIT_CODE


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s rank{rank} %(name)s] %(message)s", datefmt="%H:%M:%S")
    # megatron-core logs at INFO every parameter name of each gradient bucket (a line per tensor: hundreds for a real
    # model), its whole optimizer and DDP configs and each scheduler value read back on resume; its warnings stay
    logging.getLogger("megatron").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    retain_freed_memory()  # before the first step's allocations: the warm start and the actor reuse their memory
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(rank)
    try:
        cfg = load_config(args.config, args.overrides)
        warnings = validate(cfg)
        world = job_world_size(cfg)
        placement = parse_placement(
            cfg.cluster.component_placement, world_size=world, engine_tp=cfg.rollout.tensor_parallel_size
        )
        check_models(cfg)  # before the memory estimate, which reads the same config.json
        memory_line = actor_memory(cfg, placement)
        check_hooks(cfg)  # every module:attr imports, and the environment, its tools and reward: dry run or not
        agent_lines = check_custom_buffer(cfg) + check_agent(cfg)  # the buffer meets a contract
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        for w in warnings:
            print(f"config warning: {w}", file=sys.stderr)
    if args.dry_run:
        try:
            _print_dry_run(args, cfg, placement, memory_line + "".join(f"\n# {x}" for x in agent_lines))
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return 0
    if "MASTER_ADDR" not in os.environ:
        print(
            "launch/train.py: run it under torchrun, e.g. "
            f"torchrun --nproc_per_node {world} launch/train.py {args.config}",
            file=sys.stderr,
        )
        return 2
    if not _inputs_ok(cfg, rank):  # before any process (broker, engine) starts; not on --dry-run (no data needed)
        return 2
    ctx = RankContext(
        cfg=cfg,
        config_path=str(args.config),
        overrides=list(args.overrides),
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        placement=placement,
        run_dir=Path(cfg.logging.run_dir),
    )
    process.install_signal_handlers(cfg.cluster.shutdown_grace_s)
    ignore_preempt_signal()  # the actor ranks' step loop handles it (checkpoint, then exit 75)
    process.start_parent_watchdog(grace_s=cfg.cluster.shutdown_grace_s)  # a SIGKILLed torchrun takes us along
    try:
        return roles.run_role(ctx)
    except Preempted as e:
        return _preempted(ctx.run_dir, e)
    finally:
        process.stop_all(cfg.cluster.shutdown_grace_s)
