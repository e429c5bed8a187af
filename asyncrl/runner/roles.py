"""Role bodies: what each torchrun rank does once the launcher gave it a role.

Contract (who starts whom, who waits for whom; every wait has a timeout)
- global rank 0 prepares the embedded default's artefacts if they are missing (``prepare``) and
  publishes ``prepared``; every other rank waits for that key.
- actor ranks form their own default process group (Megatron's world = the actor ranks only);
  actor rank 0 spawns the broker process, publishes ``broker/address``, waits for every engine's
  ``engine/<i>/url``, runs the step loop (``asyncrl.trainer.step_loop``) and at the end tells the broker
  to shut down and publishes ``shutdown``.
- actor rank 0 binds the broker on loopback (one host), on all interfaces or ``cluster.broker_host``
  (several nodes) and publishes a routable address (``asyncrl.cluster.addresses``). What it does alone
  (start-up, evals, batch waits) runs as leader phases (``asyncrl.trainer.leader_phases``): the other actor ranks
  wait on the store, and ``cluster.actor_collective_timeout_s`` bounds only real collectives.
- every rollout rank makes a round trip to the broker (``broker_handshake``, within
  ``cluster.broker_handshake_timeout_s``); the first rank of each engine then checks its tool URL,
  launches its engine child (SGLang server or the CPU engine), publishes its URL, and runs the agent
  worker until the broker says shutdown; the worker supervises the engine (``EngineWatch``): a restarted
  engine is announced under ``engine/<i>/restarts`` and takes work once actor rank 0 published
  ``engine/<i>/synced`` >= that count (it re-joined the weight-sync group and pushed the current weights;
  ``asyncrl.sync.recovery``).
- the first rank of each dedicated eval-fleet engine (``eval`` placement key) launches it, publishes
  ``eval_engine/<i>/url`` (actor rank 0 waits for them) and keeps it up until ``shutdown``
  (``run_eval_engine``).
- other ranks (an engine's other TP ranks, reward-only ranks) wait for ``shutdown``.
- every rank watches the heartbeats of the actor ranks other than itself, each from its first beat to the run's
  end, and fails the job, naming the rank, when one stops for ``cluster.actor_unresponsive_after_s``
  (``leader.watch_actor_ranks``).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from asyncrl.agent.envs import get_env, tool_specs
from asyncrl.agent.tools import check_retriever
from asyncrl.agent.worker import EngineWatch, run_worker
from asyncrl.broker.client import BrokerPing
from asyncrl.broker.client import broker_handshake as round_trip
from asyncrl.cluster import process
from asyncrl.cluster.addresses import host_endpoint, num_nodes_from_env
from asyncrl.cluster.auth import share_secret
from asyncrl.cluster.discovery import SHUTDOWN_KEY, Discovery, read_count, restarts_key, synced_key
from asyncrl.config.eval_engine import eval_engine_config
from asyncrl.config.render import render_config
from asyncrl.engine.launch import EngineSupervisor, engine_port
from asyncrl.eval import fleet as eval_fleet
from asyncrl.runner.prepare import prepare_if_needed
from asyncrl.trainer.leader_phases import LeaderPhases, watch_actor_ranks

log = logging.getLogger("asyncrl.roles")

PHASES = "actor_phases/"
"""The store prefix of the actor group's leader phases and of actor rank 0's heartbeat."""

PREPARE_WAIT_S = 3 * 3600.0
"""How long the other ranks wait for global rank 0's preparation. Measured: 700 warm-start steps took over
30 min single-threaded on 2 cores shared with four other jobs (~3 min at 0.25 s a step on 2 idle cores); a rank 0 that
dies fails the job through torchrun anyway, so this bounds only a hung preparation."""


def local_address() -> str:
    """This host's address for the other ranks to connect to: 127.0.0.1 when every rank is on this host,
    else a routable address (never 127.x; ``asyncrl.cluster.addresses``)."""
    return host_endpoint(num_nodes=num_nodes_from_env(1), what="this rank's servers").advertise_host


def run_role(ctx) -> int:
    cfg = ctx.cfg
    disc = Discovery.from_env(timeout_s=cfg.cluster.store_timeout_s)
    share_secret(disc, rank=ctx.rank)  # before any child starts: the broker and the engines inherit it
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        t0 = time.time()
        prepare_if_needed(cfg)
        ctx.timings["prepare"] = time.time() - t0
        (ctx.run_dir / "config.resolved.toml").write_text(render_config(cfg))
        disc.publish("prepared", "1")
    else:
        disc.lookup("prepared", timeout_s=max(cfg.cluster.store_timeout_s, PREPARE_WAIT_S))
    role = ctx.role
    if role == "actor":
        return run_actor(ctx, disc)
    stop_watch = _watch_actor_ranks(cfg, range(len(ctx.placement.actor_ranks)))
    try:
        if role == "rollout":
            return run_rollout(ctx, disc)
        if role == "eval":
            return run_eval_engine(ctx, disc)
        return run_idle(ctx, disc)
    finally:
        stop_watch()


def _base_cmd(ctx) -> list[str]:
    return [ctx.config_path, *ctx.overrides]


TRAINER_MODULE = "asyncrl.trainer.step_loop"
"""The step loop; importing it imports megatron-core (measured 8-15 CPU-seconds on the embedded default)."""


def _import_in_background(module: str) -> threading.Thread:
    """Start importing ``module`` on a thread, so that its import overlaps the start-up waits (the broker's
    bind, the engines' start) instead of following them. An import that fails there fails again, with its
    own traceback, where the module is imported for use (``sys.modules`` keeps no half-imported module)."""
    t = threading.Thread(target=importlib.import_module, args=(module,), name=f"import {module}", daemon=True)
    t.start()
    return t


def run_actor(ctx, disc: Discovery) -> int:
    cfg = ctx.cfg
    if cfg.rollout.rollout_backend != "sglang":  # the CPU actor: megatron-core's fallbacks are the plan, not news
        warnings.filterwarnings("ignore", r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning)
    # lazy: torch and (through trainer.step_loop) megatron-core take seconds to import and only actor ranks use
    # them; rollout, eval and idle ranks and --dry-run never do
    preload = _import_in_background(TRAINER_MODULE)
    import torch.distributed as dist

    actor_ranks = ctx.placement.actor_ranks
    actor_rank = actor_ranks.index(ctx.rank)
    backend = "nccl" if cfg.rollout.rollout_backend == "sglang" else "gloo"
    if backend == "nccl":  # GPU jobs: global rank r drives its node's device local_rank
        import torch

        torch.cuda.set_device(ctx.local_rank)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(disc.prefix + "actor_world", disc.raw_store),
        rank=actor_rank,
        world_size=len(actor_ranks),
        timeout=timedelta(seconds=cfg.cluster.actor_collective_timeout_s),
    )
    phases = _actor_phases(cfg, disc, actor_rank)
    stop_watch = _watch_actor_ranks(cfg, [r for r in range(len(actor_ranks)) if r != actor_rank])
    broker = None
    try:
        # leader-only: the others wait on the store, not in a collective (engines may take long to start)
        started = phases.run("start the broker and wait for the engines", lambda: _leader_startup(ctx, disc))
        broker, address, engine_urls, eval_urls = started if actor_rank == 0 else (None, None, [], [])
        t0 = time.time()
        preload.join()
        from asyncrl.trainer.step_loop import run_training  # lazy: see above; imported by now (_import_in_background)

        log.info("step loop imported (%.1fs waited for it after start-up)", time.time() - t0)

        return run_training(
            ctx,
            broker_address=address,
            engine_urls=engine_urls,
            broker_child=broker,
            actor_rank=actor_rank,
            eval_engine_urls=eval_urls,
            phases=phases,
            discovery=disc,
        )
    finally:
        stop_watch()
        phases.close()
        if actor_rank == 0:
            disc.publish(SHUTDOWN_KEY, "1")
        dist.destroy_process_group()


def _actor_phases(cfg, disc: Discovery, actor_rank: int):
    """The actor group's leader-only phases and this rank's heartbeat (``asyncrl.trainer.leader_phases``), on this run's
    store (the heartbeat thread on a client of its own)."""
    return LeaderPhases(
        disc.sub(PHASES).store,
        rank=actor_rank,
        heartbeat_store=Discovery.from_env(timeout_s=cfg.cluster.store_timeout_s).sub(PHASES).store,
        dead_after_s=cfg.cluster.actor_unresponsive_after_s,
    )


def _watch_actor_ranks(cfg, ranks) -> Callable[[], object]:
    """Fail the job when the heartbeat of one of the actor ranks ``ranks`` stops (``leader.watch_actor_ranks``): every
    rank watches every actor rank but itself, on a store client of its own. Returns the watch's ``stop``, for the
    role's ``finally`` (a watch still inside a store call when the process exits aborts it)."""
    ranks = list(ranks)
    if not ranks:
        return lambda: None
    store = Discovery.from_env(timeout_s=cfg.cluster.store_timeout_s).sub(PHASES).store
    grace = cfg.cluster.shutdown_grace_s
    return watch_actor_ranks(
        store,
        ranks=ranks,
        dead_after_s=cfg.cluster.actor_unresponsive_after_s,
        on_dead=lambda message: process.fail_rank(message, grace),
    ).stop


def _leader_startup(ctx, disc: Discovery):
    """Actor rank 0: spawn the broker, publish its address, wait for every engine (and eval-fleet) URL."""
    cfg = ctx.cfg
    broker, address = _spawn_broker(ctx, disc)
    engine_urls = [
        disc.lookup(f"engine/{i}/url", timeout_s=cfg.rollout.start_timeout_s + 60)
        for i in range(len(ctx.placement.engines))
    ]
    log.info("broker at %s; engines %s", address, engine_urls)
    eval_urls: list[str] = []
    if cfg.eval.eval_num_gpus:
        eval_urls = eval_fleet.lookup_fleet_urls(cfg, disc)
        log.info("eval fleet engines %s", eval_urls)
    return broker, address, engine_urls, eval_urls


def _spawn_broker(ctx, disc: Discovery):
    """The broker child bound on loopback (one host), on all interfaces or on ``cluster.broker_host`` (several
    nodes); its routable address is published as ``broker/address``. Returns (child, address)."""
    cfg = ctx.cfg
    ep = host_endpoint(num_nodes=num_nodes_from_env(cfg.cluster.num_nodes), configured_host=cfg.cluster.broker_host)
    addr_file = ctx.run_dir / "broker.address"
    addr_file.unlink(missing_ok=True)
    # it defers SIGTERM while this rank lives (a preemption's SIGTERM reaches it too; the checkpoint needs it)
    broker = process.spawn_child(
        "broker",
        [
            sys.executable,
            "-m",
            "asyncrl.runner.broker_process",
            "--bind",
            f"tcp://{ep.bind_host}:0",
            "--address-file",
            str(addr_file),
            "--parent-pid",
            str(os.getpid()),
            *_base_cmd(ctx),
        ],
        log_dir=ctx.run_dir / "logs",
        console_stdout=True,
        stop_signal=signal.SIGINT,
    )
    process.wait_until(
        addr_file.is_file, timeout_s=cfg.cluster.store_timeout_s, what="the broker to bind", child=broker
    )
    process.fail_fast_on_exit(broker, what="the broker", grace_s=cfg.cluster.shutdown_grace_s)
    port = addr_file.read_text().strip().rsplit(":", 1)[1]
    address = f"tcp://{ep.advertise_host}:{port}"
    process.fail_fast_on_hang(
        broker,
        what="the broker",
        probe=BrokerPing(address),
        hung_after_s=cfg.cluster.broker_unhealthy_after_s,
        grace_s=cfg.cluster.shutdown_grace_s,
    )
    disc.publish("broker/address", address)
    return broker, address


def broker_handshake(ctx, disc: Discovery) -> str:
    """A rollout rank's start-up round trip to the broker (``cluster.broker_handshake_timeout_s``); its address."""
    address = disc.lookup("broker/address")
    round_trip(
        address,
        timeout_s=ctx.cfg.cluster.broker_handshake_timeout_s,
        who=f"{ctx.role} rank {ctx.rank} on {os.uname().nodename}",
    )
    log.info("broker at %s answered rank %d", address, ctx.rank)
    return address


def run_rollout(ctx, disc: Discovery) -> int:
    cfg = ctx.cfg
    e = ctx.placement.engine_of(ctx.rank)
    ranks = ctx.placement.engines[e]
    broker_address = broker_handshake(ctx, disc)  # every rollout rank, before the engine's (long) start
    if ctx.rank != ranks[0]:
        return run_idle(ctx, disc)
    model_path = Path(cfg.rollout.model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"rollout.model_path: no HF checkpoint (config.json) at {str(model_path)!r}")
    if "search" in tool_specs(cfg, get_env(cfg.agentloop.task_name or "searchr1")):
        check_retriever(cfg.agentloop.tool, role=f"rollout rank {ctx.rank} (engine {e})")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.cluster.num_devices_per_node)
    base_gpu = ranks[0] % per_node
    host = local_address()
    sup = EngineSupervisor.from_config(
        cfg,
        engine_index=e,
        local_engine_index=ctx.local_rank,
        base_gpu_id=base_gpu,
        host="127.0.0.1" if host == "127.0.0.1" else "0.0.0.0",
        advertise_host=host,
        run_dir=ctx.run_dir,
    )
    sup.start()
    try:
        disc.publish(f"engine/{e}/url", sup.url)
        watch = EngineWatch.from_config(
            cfg,
            sup,
            announce=lambda n: disc.publish(restarts_key(e), str(n)),
            synced=lambda n: read_count(disc, synced_key(e)) >= n,
        )
        run_worker(
            cfg,
            broker_address=broker_address,
            engine_urls=[sup.url],
            tokenizer_path=str(model_path),
            worker_id=f"engine{e}",
            watch=watch,
        )
    finally:
        sup.stop()
    return 0


def run_idle(ctx, disc: Discovery) -> int:
    while True:
        try:
            disc.lookup(SHUTDOWN_KEY, timeout_s=60)
            return 0
        except TimeoutError:
            log.info("rank %d (%s) idle, waiting for shutdown", ctx.rank, ctx.role)
            time.sleep(0.1)


def run_eval_engine(ctx, disc: Discovery) -> int:
    """The role of an ``eval`` rank: the first rank of each fleet engine runs it until ``shutdown``."""
    cfg = ctx.cfg
    engines = ctx.placement.eval_engines(cfg.eval.eval_num_gpus_per_engine)
    i = next(k for k, ranks in enumerate(engines) if ctx.rank in ranks)
    ranks = engines[i]
    if ctx.rank != ranks[0]:
        return run_idle(ctx, disc)
    ecfg = eval_engine_config(cfg)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.cluster.num_devices_per_node)
    host = local_address()
    port = engine_port(cfg, ctx.local_rank)  # local ranks are unique on a node: no clash with rollout engines
    bind = "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0"
    # the same launch path as a rollout engine: clean environment, CUDA_VISIBLE_DEVICES = its devices
    sup = EngineSupervisor.from_config(
        ecfg,
        engine_index=i,
        base_gpu_id=ranks[0] % per_node,
        run_dir=ctx.run_dir,
        host=bind,
        advertise_host=host,
        port=port,
        name=f"eval_engine{i}",
    )
    sup.start()
    try:
        disc.publish(eval_fleet.URL_KEY.format(i), sup.url)
        log.info("eval fleet engine %d at %s (ranks %s)", i, sup.url, list(ranks))
        while True:
            try:
                disc.lookup(SHUTDOWN_KEY, timeout_s=2.0)
                return 0
            except TimeoutError:
                sup.check()  # a crashed engine is restarted (it reloads the next snapshot anyway)
    finally:
        sup.stop()
