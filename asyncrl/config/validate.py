"""Cross-field validation: one pass, run on every rank before any worker starts. Pure.

Errors raise ``ConfigError`` naming the dotted key, the bad value and the fix. Warnings are
returned as strings (the launcher prints them once, on global rank 0) and the run continues.

    warnings = validate(cfg, world_size=2)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from asyncrl.config.eval_engine import eval_engine_config, fleet_size, parse_flags
from asyncrl.config.placement import is_loopback, parse_devices, parse_placement
from asyncrl.config.schema import PAUSE_MODES, Config, ConfigError


def job_world_size(cfg: Config) -> int:
    """torchrun's WORLD_SIZE when launched by it, else nodes x devices per node from the config."""
    env = os.environ.get("WORLD_SIZE")
    if env:
        return int(env)
    return cfg.cluster.num_nodes * cfg.cluster.num_devices_per_node


def _component_devices(cfg: Config, name: str) -> set[int]:
    out: set[int] = set()
    for key, spec in cfg.cluster.component_placement.items():
        if name in [n.strip() for n in key.split(",")]:
            out |= set(parse_devices(spec, f"cluster.component_placement.{key}"))
    return out


def validate(cfg: Config, *, world_size: int | None = None) -> list[str]:
    """Raise ``ConfigError`` (naming the key) for a config that cannot run; the warnings for one that runs badly.
    The checks run in a fixed order, so the first problem of a config is always the one reported."""
    world = job_world_size(cfg) if world_size is None else world_size
    _validate_mode(cfg)
    placement = parse_placement(
        cfg.cluster.component_placement, world_size=world, engine_tp=cfg.rollout.tensor_parallel_size
    )
    _validate_parallelism(cfg, placement)
    _validate_recompute(cfg)
    _validate_buffer(cfg)
    _validate_broker_host(cfg, world)
    warnings = _validate_paths_tools_eval(cfg, placement)
    return warnings + _warn_limits(cfg) + _warn_store_nodes(cfg, placement)


def _warn_store_nodes(cfg: Config, placement) -> list[str]:
    """Under ``sync.catchup = "pull"`` a restarted engine loads the weight store by its path (written by actor rank
    0): engines on other nodes than actor rank 0 need it on a filesystem they mount at the same path."""
    if cfg.sync.catchup != "pull" or not placement.actor_ranks:
        return []
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.cluster.num_devices_per_node)
    leader_node = min(placement.actor_ranks) // per_node
    remote = sorted({r[0] // per_node for r in placement.engines if r[0] // per_node != leader_node})
    if not remote:
        return []
    where = cfg.sync.store_dir or f"{cfg.logging.run_dir}/weight_store"
    return [
        f"sync.catchup = 'pull': engines on node(s) {remote} load restarted engines' weights from {where!r} "
        f"(sync.store_dir), written on node {leader_node}: it must be on a filesystem every node mounts at that path"
    ]


def _validate_mode(cfg: Config) -> None:
    r = cfg.runner
    if r.async_mode:
        shared = _component_devices(cfg, "actor") & _component_devices(cfg, "rollout")
        if shared:
            raise ConfigError(
                f"cluster.component_placement: runner.async_mode = true needs the actor and the rollout on "
                f'separate devices, but both use {sorted(shared)}; e.g. actor = "0-7", "rollout,reward" = "8-15"'
            )
        ok_backend = cfg.rollout.rollout_backend == "cpu" or (
            cfg.rollout.rollout_backend == "sglang" and cfg.rollout.sglang.backend_type == "server"
        )
        if not ok_backend:
            raise ConfigError(
                f"rollout.sglang.backend_type: runner.async_mode = true needs the SGLang server backend "
                f"(weight sync pauses generation over HTTP), got rollout_backend = "
                f"{cfg.rollout.rollout_backend!r}, backend_type = {cfg.rollout.sglang.backend_type!r}; "
                f'set rollout.sglang.backend_type = "server"'
            )
        if not cfg.agentloop.task_name:
            raise ConfigError('agentloop.task_name: required when runner.async_mode = true (e.g. "searchr1")')
        if cfg.rollout.pause_mode == "abort":
            raise ConfigError(
                "rollout.pause_mode: 'abort' would kill every in-flight request at each weight sync and is "
                'rejected in async mode; use "retract" (default), "in_place" or "drain"'
            )
    elif cfg.rollout.pause_mode not in PAUSE_MODES:  # pragma: no cover - Literal catches it
        raise ConfigError(f"rollout.pause_mode: must be one of {PAUSE_MODES}")
    if cfg.rollout.sglang.backend_type != "server":
        raise ConfigError(
            'rollout.sglang.backend_type: only "server" is implemented (SGLang runs as an HTTP server beside each '
            'rollout rank, in both modes); the in-process "engine" backend is not; set backend_type = "server"'
        )


def _validate_parallelism(cfg: Config, placement) -> None:
    """The actor's grids as megatron-core's ``initialize_model_parallel`` forms them: TP x PP divides the actor
    ranks (DP = the quotient), and so does the experts' grid, expert TP x EP x PP, where the experts' TP is the
    actor's TP (its default; the actor keeps it): expert-DP = actor ranks / (TP x EP x PP). Whether the model has
    experts, and how many EP must divide, is checked where the model is read (``launcher.check_models``)."""
    a = cfg.actor
    n_actor = len(placement.actor_ranks)
    tp, pp, ep = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.expert_model_parallel_size
    if n_actor % (tp * pp):
        raise ConfigError(
            f"actor.tensor_model_parallel_size: TP {tp} x PP {pp} = {tp * pp} does not divide the {n_actor} actor devices"
        )
    if n_actor % (tp * ep * pp):
        raise ConfigError(
            f"actor.expert_model_parallel_size: TP {tp} x EP {ep} x PP {pp} = {tp * ep * pp} does not divide the "
            f"{n_actor} actor devices (megatron-core's expert grid: the experts' TP is actor.tensor_model_parallel_size)"
        )


def _validate_buffer(cfg: Config) -> None:
    rb, B = cfg.rollout_buffer, cfg.data.rollout_batch_size
    if rb.async_data_buffer_capacity_factor is not None and "rollout_buffer.max_buffered_groups" not in cfg.derived:
        raise ConfigError(
            f"rollout_buffer.async_data_buffer_capacity_factor: set together with rollout_buffer.max_buffered_groups "
            f"= {rb.max_buffered_groups}; both size the buffer (the factor sets max_buffered_groups = floor(factor x "
            f"rollout_batch_size)): set only one"
        )
    if rb.max_buffered_groups < B:
        raise ConfigError(
            f"rollout_buffer.max_buffered_groups: {rb.max_buffered_groups} is below data.rollout_batch_size "
            f"= {B}, so a batch could never be assembled; raise it to at least {2 * B} (the default 2 x B)"
        )
    if rb.max_inflight_groups == "auto" and rb.max_buffered_groups <= B:
        raise ConfigError(
            f'rollout_buffer.max_inflight_groups = "auto": it tunes within [1, max_buffered_groups - '
            f"rollout_batch_size], empty with max_buffered_groups = {rb.max_buffered_groups} and "
            f"data.rollout_batch_size = {B}; raise rollout_buffer.max_buffered_groups to at least {2 * B}"
        )
    gs = cfg.algorithm.group_size
    if (
        rb.submission_granularity == "sample"
        and rb.max_concurrent_samples is not None
        and rb.max_concurrent_samples < gs
    ):
        raise ConfigError(
            f"rollout_buffer.max_concurrent_samples: {rb.max_concurrent_samples} is below algorithm.group_size = {gs}: "
            f'under submission_granularity = "sample" a group goes out once {gs} trajectory slots are free, so '
            f"nothing would ever be issued; raise it to at least {gs}"
        )
    if rb.max_dropped_groups_per_step < 1:  # pragma: no cover - __post_init__ catches it
        raise ConfigError("rollout_buffer.max_dropped_groups_per_step: must be >= 1")


def _validate_paths_tools_eval(cfg: Config, placement) -> list[str]:
    r = cfg.runner
    warnings: list[str] = []
    if r.resume_from is not None and not (Path(r.resume_from) / "meta.json").is_file():
        raise ConfigError(f"runner.resume_from: {r.resume_from!r} is not an actor checkpoint (no meta.json)")
    # the retriever's settings are required only by an environment that uses the search tool: checked with the
    # environment (asyncrl.agent.envs.registry.check_agent), which this floor cannot import
    if cfg.eval.eval_num_gpus and cfg.eval.eval_function_path:
        raise ConfigError(
            "eval.eval_function_path: an external eval backend and a dedicated fleet (eval.eval_num_gpus) "
            "each select a backend; set only one"
        )
    _validate_fleet(cfg, placement)
    warnings += _validate_eval(cfg)
    warnings += _warn_open_sglang(cfg)
    if (cfg.eval.eval_num_gpus or cfg.eval.eval_function_path) and cfg.eval.eval_interval is None:
        raise ConfigError("eval.eval_interval: required with a dedicated fleet or an external eval backend")
    if cfg.algorithm.off_policy_correction != "none" and not r.async_mode:
        warnings.append(
            f"algorithm.off_policy_correction = {cfg.algorithm.off_policy_correction!r} in synchronous mode: "
            f"data is on-policy up to engine/actor numerics; the correction only guards that mismatch"
        )
    warnings += _warn_correction_params(cfg)

    return warnings


# the algorithm keys each correction reads (beyond off_policy_correction): any other one set is ignored
_CORRECTION_KEYS = {
    "tis_cap": ("tis", "decoupled", "token_mis", "seq_mis"),
    "geo_mask_low": ("geo_mask",),
    "geo_mask_high": ("geo_mask",),
    "icepop_low": ("icepop",),
    "icepop_high": ("icepop",),
    "dppo_mask_low": ("dppo",),
    "dppo_mask_high": ("dppo",),
    "m2po_tau": ("m2po",),
}


def _warn_correction_params(cfg: Config) -> list[str]:
    """A warning per correction bound set away from its default that the chosen correction does not read."""
    a, default = cfg.algorithm, type(cfg.algorithm)()
    used = a.off_policy_correction
    return [
        f"algorithm.{key} = {getattr(a, key)!r} is ignored: algorithm.off_policy_correction = {used!r} does not "
        f"read it (it is read by {', '.join(by)})"
        for key, by in _CORRECTION_KEYS.items()
        if used not in by and getattr(a, key) != getattr(default, key)
    ]


def _warn_limits(cfg: Config) -> list[str]:
    rb, B = cfg.rollout_buffer, cfg.data.rollout_batch_size
    warnings: list[str] = []
    natural_bound = rb.max_buffered_groups / B
    cap = cfg.agentloop.max_actor_accept_staleness
    if cap is not None and cap < natural_bound:
        warnings.append(
            f"agentloop.max_actor_accept_staleness = {cap} is below the staleness the buffer limit produces "
            f"on its own (max_buffered_groups / rollout_batch_size = {natural_bound:g}): the oldest groups of "
            f"every batch will be dropped; raise it to at least {natural_bound:g} or lower max_buffered_groups"
        )
    if rb.max_inflight_groups != "auto" and rb.max_buffered_groups < rb.max_inflight_groups + B:
        warnings.append(
            f"rollout_buffer.max_buffered_groups = {rb.max_buffered_groups} < max_inflight_groups "
            f"({rb.max_inflight_groups}) + rollout_batch_size ({B}): when generation is the bottleneck, buffered "
            f"groups take budget from in-flight ones and the engines run short of work"
        )
    sample_budget = rb.submission_granularity == "sample" and rb.max_concurrent_samples is not None
    if (
        sample_budget
        and isinstance(rb.max_inflight_groups, int)
        and "rollout_buffer.max_inflight_groups" not in cfg.derived
    ):
        warnings.append(
            f"rollout_buffer.max_inflight_groups = {rb.max_inflight_groups} is ignored: under submission_granularity "
            f'= "sample" the in-flight limit counts trajectories, max_concurrent_samples = {rb.max_concurrent_samples}'
        )
    if rb.max_buffered_groups < 2 * B:
        warnings.append(
            f"rollout_buffer.max_buffered_groups = {rb.max_buffered_groups} < 2 x rollout_batch_size ({2 * B}): "
            f"when training is the bottleneck the next batch can only start after this one is handed off"
        )
    return warnings


def _warn_open_sglang(cfg: Config) -> list[str]:
    """SGLang 0.5.23 installs its ``--api-key`` check in single-tokenizer mode only (``http_server.py``)."""
    flags = parse_flags(list(cfg.rollout.sglang.extra_args))
    n = flags.get("tokenizer_worker_num")
    if cfg.rollout.rollout_backend != "sglang" or n in (None, True, False) or str(n).strip() in ("", "1"):
        return []
    return [
        f"rollout.sglang.extra_args: --tokenizer-worker-num {n}: SGLang (0.5.23) checks no --api-key with "
        f"several tokenizer workers, so the engines take requests from anyone who reaches their port"
    ]


def _validate_broker_host(cfg: Config, world: int) -> None:
    """``cluster.broker_host``: a loopback address cannot serve a job of several nodes."""
    host = cfg.cluster.broker_host
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.cluster.num_devices_per_node)
    num_nodes = -(-world // per_node)
    if host and num_nodes > 1 and is_loopback(host) and not is_loopback(os.environ.get("MASTER_ADDR", "node0")):
        raise ConfigError(
            f"cluster.broker_host: {host!r} is a loopback address but the job has {num_nodes} nodes; the rollout "
            f"ranks on the other nodes could not reach the broker: give an address of node 0 they reach, or unset it"
        )


def _validate_recompute(cfg: Config) -> None:
    """``actor.recompute_method`` / ``recompute_num_layers`` only mean something with full recompute; routing replay
    sets one micro-batch's experts at a time, so a layer's recompute must follow its forward (PP = 1)."""
    a = cfg.actor
    if a.recompute_granularity == "full":
        if a.moe_routing_replay and a.pipeline_model_parallel_size > 1:
            raise ConfigError(
                "actor.moe_routing_replay: not with full activation recompute at "
                f"actor.pipeline_model_parallel_size = {a.pipeline_model_parallel_size} (the pipeline recomputes a "
                "micro-batch's layers after later micro-batches' forwards, which replay their own experts); "
                'use actor.recompute_granularity = "selective" or "none"'
            )
        return
    for key in ("recompute_method", "recompute_num_layers"):
        if getattr(a, key) is not None:
            raise ConfigError(
                f'actor.{key}: {getattr(a, key)!r} is only used with actor.recompute_granularity = "full" '
                f'(got {a.recompute_granularity!r}); remove it or set recompute_granularity = "full"'
            )


def _validate_fleet(cfg: Config, placement) -> None:
    """The dedicated eval fleet: its size, its devices (the ``eval`` placement key) and its engine settings."""
    e = cfg.eval
    n_dev = len(placement.eval_ranks)
    if not e.eval_num_gpus:
        if n_dev:
            raise ConfigError(
                f"cluster.component_placement.eval: {n_dev} devices are placed for a dedicated eval fleet but "
                f"eval.eval_num_gpus = 0; set eval.eval_num_gpus = {n_dev} or remove the 'eval' key"
            )
        return
    fleet_size(e)
    if n_dev != e.eval_num_gpus:
        raise ConfigError(
            f"cluster.component_placement.eval: {n_dev} devices are placed for the eval fleet but "
            f'eval.eval_num_gpus = {e.eval_num_gpus}; they must match (e.g. eval = "2" for one device)'
        )
    eval_engine_config(cfg)  # the eval.eval_sglang overrides resolve


def _validate_eval(cfg: Config) -> list[str]:
    """The periodic eval (Miles' three backends and the snapshot pipeline)."""
    e, r = cfg.eval, cfg.runner
    warnings: list[str] = []
    if e.eval_interval is None:
        return warnings
    if e.eval_function_path and ":" not in e.eval_function_path:
        raise ConfigError(f"eval.eval_function_path: expected 'module:Class', got {e.eval_function_path!r}")
    if e.eval_function_path or e.eval_num_gpus:  # both evaluate a snapshot, from exactly one source
        what = "an external eval backend" if e.eval_function_path else "a dedicated eval fleet"
        if not e.eval_hf_dir and not r.save_hf:
            raise ConfigError(
                f"eval.eval_hf_dir: {what} needs a weight snapshot source: set eval.eval_hf_dir "
                "(a fresh HF export per eval point, tmpfs recommended) or runner.save_hf = true (reuse the "
                "periodic HF checkpoints)"
            )
        if not e.eval_hf_dir:
            ci = r.checkpoint_interval
            if not ci or e.eval_interval % ci:
                raise ConfigError(
                    f"eval.eval_interval: reusing the periodic HF checkpoints (runner.save_hf, no eval.eval_hf_dir) "
                    f"needs eval.eval_interval = {e.eval_interval} to be a multiple of runner.checkpoint_interval "
                    f"= {ci}; change either, or set eval.eval_hf_dir for a fresh export per eval point"
                )
        if e.eval_function_path:
            return warnings
    # shared engines and the fleet run the agent loop's greedy eval
    where = "on the dedicated fleet" if e.eval_num_gpus else "on the shared engines"
    if not cfg.agentloop.task_name:
        raise ConfigError(
            f"agentloop.task_name: the periodic eval {where} (eval.eval_interval) runs "
            'the agent loop and needs a task (e.g. "searchr1")'
        )
    if not e.eval_prompt_data and not cfg.data.test_path:
        raise ConfigError(
            "eval.eval_prompt_data: eval.eval_interval is set but there is nothing to evaluate: give "
            'eval.eval_prompt_data = { name = "path.jsonl" } or data.test_path'
        )
    if e.eval_hf_dir and not e.eval_num_gpus:
        warnings.append(
            f"eval.eval_hf_dir = {e.eval_hf_dir!r} is ignored: the eval runs on the shared rollout engines "
            f"(no snapshot); it is used with eval.eval_function_path"
        )
    return warnings


# ---------------------------------------------------------------- what the run reads, checked before any process starts
def _hooks(cfg: Config) -> list[tuple[str, str]]:
    """(dotted key, ``module:attr``) of every user hook the config names."""
    rb, e, lg = cfg.rollout_buffer, cfg.eval, cfg.logging
    return [
        (k, v)
        for k, v in (
            ("rollout_buffer.dynamic_sampling_filter_path", rb.dynamic_sampling_filter_path),
            ("rollout_buffer.sample_filter_path", rb.sample_filter_path),
            ("rollout_buffer.custom_data_buffer_path", rb.custom_data_buffer_path),
            ("eval.eval_function_path", e.eval_function_path),
            ("logging.custom_rollout_log_function_path", lg.custom_rollout_log_function_path),
            ("logging.custom_eval_rollout_log_function_path", lg.custom_eval_rollout_log_function_path),
        )
        if v
    ]


def _read_paths(cfg: Config) -> list[tuple[str, str, str]]:
    """(dotted key, path, "model" | "file") of every input the run reads."""
    out = [("actor.model_path", cfg.actor.model_path, "model")]
    if cfg.rollout.model_path:
        out.append(("rollout.model_path", cfg.rollout.model_path, "model"))
    if cfg.data.train_path:
        out.append(("data.train_path", cfg.data.train_path, "file"))
    if cfg.data.test_path:
        out.append(("data.test_path", cfg.data.test_path, "file"))
    tool = cfg.agentloop.tool
    if cfg.agentloop.task_name and tool.retriever == "bm25" and tool.corpus_path:
        out.append(("agentloop.tool.corpus_path", tool.corpus_path, "file"))
    for name, path in cfg.eval.eval_prompt_data.items():
        out.append((f"eval.eval_prompt_data.{name}", path, "file"))
    return out


def _made_by_preparation(cfg: Config, path: str) -> bool:
    """With ``prepare.enabled`` everything under ``prepare.dir`` is produced on first run (data, tokenizer,
    model, warm start; see ``runner/prepare.py``), so it cannot be required before preparation."""
    if not cfg.prepare.enabled:
        return False
    root, p = Path(cfg.prepare.dir).resolve(), Path(path).resolve()
    return p == root or root in p.parents


def check_inputs(cfg: Config) -> None:
    """Every path the run reads exists and every ``module:attr`` hook imports, before any process starts.
    Raises ``ConfigError`` naming the dotted key. Paths under ``prepare.dir`` are skipped when
    ``prepare.enabled`` (preparation makes them; the parts that load them report a missing one with its path).
    ``logging.wandb`` needs the package (``check_wandb``).
    Not part of ``validate`` (which stays pure and I/O-free): the launcher calls both."""
    for key, path, kind in _read_paths(cfg):
        if _made_by_preparation(cfg, path):
            continue
        p = Path(path)
        if kind == "model":
            if not p.is_dir():
                raise ConfigError(
                    f"{key}: {path!r} is not a directory (a HF checkpoint: config.json, *.safetensors, tokenizer files)"
                )
            if not (p / "config.json").is_file():
                raise ConfigError(f"{key}: {path!r} has no config.json; is it a HF checkpoint directory?")
        elif not p.is_file():
            raise ConfigError(f"{key}: {path!r} does not exist or is not a file")
    check_hooks(cfg)
    check_wandb(cfg)


def check_hooks(cfg: Config) -> None:
    """Every ``module:attr`` hook the config names imports and is callable (``ConfigError`` naming the key): run by
    the dry run too, before anything starts (the broker's ``check_custom_buffer`` then checks the buffer's contract)."""
    for key, spec in _hooks(cfg):
        import_hook(spec, key)


def check_wandb(cfg: Config) -> None:
    """``logging.wandb`` (unless off or ``mode = "disabled"``): the package is installed and wandb's own rules accept
    the settings (``wandb.Settings`` checks them as ``wandb.init`` would at the run's start: project name, tags)."""
    w = cfg.logging.wandb
    if w is None or w.mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            'logging.wandb: wandb is not installed: pip install asyncrl[wandb] (or set logging.wandb.mode = "disabled")'
        )
    try:
        import wandb
    except Exception as e:  # a broken install
        raise ConfigError(f"logging.wandb: wandb does not import: {type(e).__name__}: {e}") from None
    named = (("project", "project"), ("entity", "entity"), ("name", "run_name"), ("group", "run_group"))
    for key, setting in (*named, ("tags", "run_tags")):
        value = getattr(w, key)
        try:
            wandb.Settings(**{setting: tuple(value) if key == "tags" else value})
        except Exception as e:  # wandb's UsageError, pydantic's ValidationError
            why = "; ".join(d["msg"] for d in e.errors()) if hasattr(e, "errors") else str(e)
            raise ConfigError(f"logging.wandb.{key}: wandb rejects {value!r}: {why}") from None


def resolve_hook(spec: str, key: str):
    """``module:attr`` -> the attribute (``attr`` may be dotted); ``ConfigError`` naming ``key`` when it cannot be
    imported. The one resolver of every hook setting (the broker and the runner call it at their start too)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{key}: expected 'module:attr' (e.g. 'my_pkg.filters:drop_easy'), got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module's own error (a SyntaxError, a failing import inside it)
        raise ConfigError(f"{key}: cannot import module {module!r} of {spec!r}: {type(e).__name__}: {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {module!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj


def import_hook(spec: str, key: str):
    """``resolve_hook`` of a hook that must be callable (a function or a class)."""
    obj = resolve_hook(spec, key)
    if not callable(obj):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return obj
