"""The torchrun entry: config -> validation -> role -> role body. Runs on every rank.

Contract
- Every rank loads and validates the same TOML (+ ``key=value`` overrides); a bad config fails
  here, on every rank, before any process starts (exit code 2, the error names the key).
- ``--dry-run`` prints the resolved config (derived values marked) and the rank -> role -> device
  plan on each node's first process, then exits 0 on every rank; with a node rank in the environment
  (``GROUP_RANK`` as torchrun sets it, ``NODE_RANK``, ``SLURM_NODEID``) also that node's own rows.
- Otherwise each rank takes its role from ``cluster.component_placement`` and calls its body in
  ``asyncrl.runner.roles`` with a ``RankContext``. Children (broker, engines) are supervised by
  ``asyncrl.cluster.process``: SIGTERM/Ctrl-C stop them; if any rank fails, torchrun stops the
  others and their children go with them.

    torchrun --nproc_per_node 2 launch/train.py configs/tiny.toml [key=value ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.cluster.placement import Placement, parse_placement
from asyncrl.config import Config, ConfigError, load_config, validate
from asyncrl.config.derive import explain
from asyncrl.config.loader import to_dict

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
    return p.parse_args(argv)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items())
        return "{ " + items + " }" if items else "{}"
    return repr(v)


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else f'"{k}"'


def render_config(cfg: Config) -> str:
    """The resolved config as TOML; derived values carry a ``# derived`` comment."""
    lines: list[str] = []

    def emit(table: dict, path: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) or k in _INLINE_TABLES}
        subs = {k: v for k, v in table.items() if isinstance(v, dict) and k not in _INLINE_TABLES}
        if path:
            lines.append(f"\n[{path}]")
        for k, v in scalars.items():
            key = f"{path}.{k}" if path else k
            mark = "  # derived" if key in cfg.derived else ""
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}{mark}")
        for k, v in subs.items():
            emit(v, f"{path}.{k}" if path else k)

    emit(to_dict(cfg), "")
    return "\n".join(lines).lstrip("\n") + "\n"


# dict-typed settings rendered inline rather than as sub-tables
_INLINE_TABLES = {"component_placement", "eval_prompt_data", "eval_sglang"}


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
            detail = (f"engine {e} ({kind}, TP {len(ranks)}) launcher + agent worker" if r == ranks[0]
                      else f"engine {e} TP rank {ranks.index(r)} (held by the engine's first rank)")
        elif role == "eval":
            tp = cfg.eval.eval_num_gpus_per_engine
            e, ranks = next((i, rs) for i, rs in enumerate(placement.eval_engines(tp)) if r in rs)
            detail = (f"eval fleet engine {e} (TP {tp}) launcher" if r == ranks[0]
                      else f"eval fleet engine {e} TP rank {ranks.index(r)}")
        else:
            detail = "idle (reward is computed in the agent loop)"
        rows.append((node, f"{r:<5} {node:<5} {role:<8} {device:<13} {detail}"))
    return rows


_PLAN_HEADER = "rank  node  role     device        detail"


def render_plan(cfg: Config, placement: Placement) -> str:
    rows = [_PLAN_HEADER] + [row for _, row in _plan_rows(cfg, placement)]
    mode = "async" if cfg.runner.async_mode else "sync"
    head = (f"# plan: {placement.world_size} ranks, mode {mode}, {len(placement.engines)} engine(s), "
            f"actor TP {cfg.actor.tensor_model_parallel_size} x PP {cfg.actor.pipeline_model_parallel_size} "
            f"x DP {len(placement.actor_ranks) // (cfg.actor.tensor_model_parallel_size * cfg.actor.pipeline_model_parallel_size)}")
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
        raise ConfigError(f"node rank {node}: the job has {placement.world_size} ranks on {num_nodes} node(s) "
                          f"(cluster.num_devices_per_node / LOCAL_WORLD_SIZE per node); no rank runs on node {node}")
    roles = sorted({row.split()[2] for row in rows})
    return f"# this node: node {node}, {len(rows)} ranks, roles {', '.join(roles)}\n" + "\n".join(
        [_PLAN_HEADER, *rows]) + "\n"


def _print_dry_run(args: argparse.Namespace, cfg: Config, placement: Placement) -> None:
    """Printed by each node's first process (or the one process outside torchrun)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    print(f"# resolved config of {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    print(render_config(cfg))
    print(render_plan(cfg, placement))
    print("\n".join(f"# {line}" for line in explain(cfg)) + "\n")
    node = node_rank_from_env()
    if node is not None:
        print(render_node_plan(cfg, placement, node))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s rank{rank} %(name)s] %(message)s",
                        datefmt="%H:%M:%S")
    try:
        cfg = load_config(args.config, args.overrides)
        warnings = validate(cfg)
        from asyncrl.config.validate import job_world_size

        world = job_world_size(cfg)
        placement = parse_placement(cfg.cluster.component_placement, world_size=world,
                                    engine_tp=cfg.rollout.tensor_parallel_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        for w in warnings:
            print(f"config warning: {w}", file=sys.stderr)
    if args.dry_run:
        try:
            _print_dry_run(args, cfg, placement)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return 0
    if "MASTER_ADDR" not in os.environ:
        print("launch/train.py: run it under torchrun, e.g. "
              f"torchrun --nproc_per_node {world} launch/train.py {args.config}", file=sys.stderr)
        return 2
    ctx = RankContext(cfg=cfg, config_path=str(args.config), overrides=list(args.overrides), rank=rank,
                      world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")), placement=placement,
                      run_dir=Path(cfg.logging.run_dir))
    from asyncrl.cluster import process
    from asyncrl.runner import roles

    process.install_signal_handlers(cfg.cluster.shutdown_grace_s)
    try:
        return roles.run_role(ctx)
    finally:
        process.stop_all(cfg.cluster.shutdown_grace_s)
