"""Launch and supervise one rollout engine: an SGLang server (GPU) or the CPU engine, same API.

Contract
- Two pure command builders, one supervisor: ``sglang_command`` (``python -m
  sglang.launch_server ...``) and ``cpu_engine_command`` (``python -m asyncrl.cpu_engine.server
  ...``) turn the typed ``Config`` into argv; ``engine_command`` picks by
  ``rollout.rollout_backend``. Nothing here imports sglang or CUDA.
- ``EngineSupervisor`` starts the command as a child of the engine's first rank (through
  ``asyncrl.cluster.process.spawn_child``: own process group, log in ``<run_dir>/logs/``, dies with
  its parent), waits until ``GET /model_info`` answers (``EngineLaunchError`` after
  ``rollout.start_timeout_s``, with the last lines of the log; at once if the child dies), restarts
  a crashed engine at most ``rollout.max_restarts`` times (``check()``), and stops it with
  SIGTERM, a grace period, then SIGKILL.
- A restarted engine is back at the checkpoint's weights and initial weight version and has left
  the weight-update group: ``restarts`` tells the caller to re-join the group and re-sync.
- Supervision while the worker runs (``asyncrl.agent.worker`` drives it from its event loop):
  ``probe()`` is one ``asyncrl.engine.liveness.liveness`` check (a paused engine is live, never hung; engines are
  started with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``: that module says why); ``HealthTracker`` (pure,
  there too) turns probe results into a verdict: dead (the process exited) at once, hung once probes have failed
  for ``rollout.unhealthy_after_s``; ``relaunch(reason)`` SIGKILLs what is left (a SIGSTOPped engine
  cannot handle SIGTERM) and spawns a fresh child (counting against ``rollout.max_restarts``,
  ``EngineLaunchError`` naming the engine and the reason beyond it); ``wait_ready()`` blocks until
  it answers, so the caller can run it on a thread while it spawned from the main thread.
- Environment (``engine_environment``, pure, the one place it is made): an engine is not a torchrun
  rank. Every variable torchrun's agent sets for its ranks (``LAUNCHER_VARIABLES``,
  ``TORCHELASTIC_*``) is removed: SGLang builds its own ``init_process_group("tcp://...")`` even
  at TP=1, and an inherited ``TORCHELASTIC_USE_AGENT_STORE=True`` makes it the client of a store
  nobody hosts (it hangs until the start timeout). A GPU engine gets ``CUDA_VISIBLE_DEVICES`` =
  exactly its devices (the node-local indices ``base_gpu_id ..`` mapped through the parent's own
  ``CUDA_VISIBLE_DEVICES``) and ``--base-gpu-id 0``; the CPU engine gets ``OMP_NUM_THREADS=1``.
  Rollout engines and the eval fleet both start through ``EngineSupervisor.from_config``.

    sup = EngineSupervisor.from_config(cfg, engine_index=0, base_gpu_id=8, run_dir="runs/x")
    sup.start()             # blocks until /model_info answers
    sup.url                 # "http://host:30000"
    sup.check()             # in the rank's loop: restarts a crashed engine or raises
    sup.relaunch("hung: /health failed for 10 s"); sup.wait_ready()   # the worker's watcher
    sup.stop()
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from asyncrl.cluster import auth
from asyncrl.cluster.auth import redacted
from asyncrl.cluster.ports import free_port
from asyncrl.cluster.process import Child, ChildFailed, spawn_child, stop_child, tail_file, wait_until
from asyncrl.config.schema import DELTA_LOADER, Config
from asyncrl.engine.blocking import EngineStepError, get_text
from asyncrl.engine.liveness import HEALTH_GENERATION_ENV, liveness

log = logging.getLogger("asyncrl.engine.launch")

INITIAL_WEIGHT_VERSION = "0"  # the actor's version before its first step; versions are integers
PORT_STRIDE = 10  # engine k on a node listens on rollout.port + k * PORT_STRIDE (config doc)


# What torchrun's elastic agent exports to each rank (torch 2.13 local_elastic_agent.py), plus the
# TORCHELASTIC_* prefix. TORCH_NCCL_ASYNC_ERROR_HANDLING is the one TORCH_NCCL_* it sets; other
# TORCH_NCCL_*/NCCL_* settings are the user's and are kept.
LAUNCHER_VARIABLES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


class EngineLaunchError(RuntimeError):
    """An engine did not come up, or crashed more often than ``rollout.max_restarts``."""


def is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def engine_visible_devices(parent: Optional[str], gpu_ids: Sequence[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on node-local devices ``gpu_ids``, seen through the
    parent's own ``CUDA_VISIBLE_DEVICES`` (``parent``; None = every device visible)."""
    if parent is None:
        return ",".join(str(i) for i in gpu_ids)
    visible = [d.strip() for d in parent.split(",") if d.strip()]
    bad = [i for i in gpu_ids if not 0 <= i < len(visible)]
    if bad:
        raise EngineLaunchError(
            f"engine devices {list(gpu_ids)} (node-local indices) are not all visible to this rank: "
            f"CUDA_VISIBLE_DEVICES={parent!r}; every rank must see all of its node's devices"
        )
    return ",".join(visible[i] for i in gpu_ids)


def engine_environment(
    environ: Mapping[str, str], *, gpu_ids: Optional[Sequence[int]] = None, extra: Optional[Mapping[str, str]] = None
) -> dict[str, str]:
    """The complete environment of an engine child: ``environ`` without torchrun's variables,
    ``CUDA_VISIBLE_DEVICES`` set to ``gpu_ids`` (when given), then ``extra`` (see module contract)."""
    env = {k: v for k, v in environ.items() if not is_launcher_variable(k)}
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"), gpu_ids)
    env.update(extra or {})
    return env


def engine_port(cfg: Config, local_engine_index: int) -> int:
    return cfg.rollout.port + local_engine_index * PORT_STRIDE


def free_rollout_port(host: str = "127.0.0.1", *, engines: int = 4) -> int:
    """A ``rollout.port`` whose first ``engines`` engine ports (``engine_port``) are all free now (``cluster.ports``)."""
    return free_port(host, span=engines, stride=PORT_STRIDE)


def _model_path(cfg: Config) -> str:
    return cfg.rollout.model_path or cfg.actor.model_path


def routed_experts_args(cfg: Config) -> list[str]:
    """SGLang's flag that lets ``/generate`` return each token's routed experts, when the actor replays them
    (``actor.moe_routing_replay``); the CPU engine takes it alike."""
    return ["--enable-return-routed-experts"] if cfg.actor.moe_routing_replay else []


def delta_loader_args(cfg: Config) -> list[str]:
    """SGLang's ``--custom-weight-loader`` of the delta sync's engine side, with ``sync.delta``."""
    return ["--custom-weight-loader", DELTA_LOADER] if cfg.sync.delta else []


def sglang_command(
    cfg: Config,
    *,
    port: int,
    base_gpu_id: int,
    host: str = "0.0.0.0",
    weight_version: str = INITIAL_WEIGHT_VERSION,
    python: str = sys.executable,
) -> list[str]:
    """argv of ``python -m sglang.launch_server`` for one engine (``--dp-size 1``: one server per
    engine, as NCCL weight sync needs)."""
    r = cfg.rollout
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        _model_path(cfg),
        "--tp-size",
        str(r.tensor_parallel_size),
        "--dp-size",
        "1",
        "--base-gpu-id",
        str(base_gpu_id),
        "--host",
        host,
        "--port",
        str(port),
        "--mem-fraction-static",
        str(r.sglang.mem_fraction_static),
        "--max-running-requests",
        str(r.max_running_requests),
        "--enable-metrics",
        "--weight-version",
        str(weight_version),
        "--random-seed",
        str(cfg.runner.seed),
        "--skip-server-warmup",
    ]
    cmd += routed_experts_args(cfg) + delta_loader_args(cfg)
    if auth.current():  # SGLang reads its key from the command line only; one token, so a key that starts
        cmd.append(f"{auth.API_KEY_FLAG}={auth.current()}")  # with '-' is not taken for a flag by its argparse
    return cmd + [str(a) for a in r.sglang.extra_args]


def cpu_engine_command(
    cfg: Config,
    *,
    port: int,
    host: str = "0.0.0.0",
    weight_version: str = INITIAL_WEIGHT_VERSION,
    python: str = sys.executable,
) -> list[str]:
    """argv of the CPU engine for one engine (TP is always 1 on CPU)."""
    r = cfg.rollout
    cmd = [
        python,
        "-m",
        "asyncrl.cpu_engine.server",
        "--model-path",
        _model_path(cfg),
        "--host",
        host,
        "--port",
        str(port),
        "--max-running-requests",
        str(r.max_running_requests),
        "--weight-version",
        str(weight_version),
        "--seed",
        str(cfg.runner.seed),
    ]
    if cfg.sync.wire_dtype != "auto":  # the CPU engine holds its weights at the wire dtype (SGLang: its own --dtype)
        cmd += ["--dtype", cfg.sync.wire_dtype]
    return cmd + routed_experts_args(cfg) + delta_loader_args(cfg)


def engine_command(
    cfg: Config,
    *,
    port: int,
    base_gpu_id: int = 0,
    host: str = "0.0.0.0",
    weight_version: str = INITIAL_WEIGHT_VERSION,
    python: str = sys.executable,
) -> list[str]:
    if cfg.rollout.rollout_backend == "cpu":
        return cpu_engine_command(cfg, port=port, host=host, weight_version=weight_version, python=python)
    return sglang_command(
        cfg, port=port, base_gpu_id=base_gpu_id, host=host, weight_version=weight_version, python=python
    )


def model_info_ready(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url/model_info`` answers 200 with a JSON object."""
    try:
        return isinstance(json.loads(get_text(url, "/model_info", timeout_s=timeout_s, step="start")), dict)
    except (EngineStepError, json.JSONDecodeError):
        return False


class EngineSupervisor:
    def __init__(
        self,
        command: list[str],
        *,
        url: str,
        name: str,
        log_dir: str | Path,
        start_timeout_s: float = 1800.0,
        max_restarts: int = 2,
        shutdown_grace_s: float = 10.0,
        env: Optional[dict[str, str]] = None,
        gpu_ids: Optional[Sequence[int]] = None,
    ):
        """``env``: variables added to ``engine_environment(os.environ, gpu_ids=gpu_ids)``."""
        self.command = list(command)
        self.gpu_ids = None if gpu_ids is None else list(gpu_ids)
        self.url = url.rstrip("/")
        self.name = name
        self.log_dir = Path(log_dir)
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.shutdown_grace_s = shutdown_grace_s
        self.env = env
        self.restarts = 0
        self.child: Optional[Child] = None
        self.last_probe: Optional[str] = None
        """Why the last ``probe`` failed (None: it passed)."""

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        engine_index: int,
        local_engine_index: Optional[int] = None,
        base_gpu_id: int = 0,
        run_dir: Optional[str | Path] = None,
        host: str = "0.0.0.0",
        advertise_host: Optional[str] = None,
        port: Optional[int] = None,
        name: Optional[str] = None,
    ) -> EngineSupervisor:
        """Engine ``engine_index`` (global; names the log unless ``name``) on the node-local devices
        ``base_gpu_id .. + rollout.tensor_parallel_size``, listening on
        ``rollout.port + local_engine_index * 10`` unless ``port`` is given; its URL uses
        ``advertise_host`` (default: this host's name, or 127.0.0.1 when bound to loopback)."""
        local = engine_index if local_engine_index is None else local_engine_index
        p = engine_port(cfg, local) if port is None else port
        adv = advertise_host or ("127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname())
        env = {HEALTH_GENERATION_ENV: "false"}  # see module contract: /health never waits on a pause
        if cfg.rollout.rollout_backend == "cpu":
            env, gpu_ids = {**env, "OMP_NUM_THREADS": "1"}, None
        else:  # the engine sees exactly its devices, so its first one is device 0
            gpu_ids = range(base_gpu_id, base_gpu_id + cfg.rollout.tensor_parallel_size)
        return cls(
            engine_command(cfg, port=p, base_gpu_id=0, host=host),
            url=f"http://{adv}:{p}",
            name=name or f"engine{engine_index}",
            log_dir=Path(run_dir or cfg.logging.run_dir) / "logs",
            start_timeout_s=cfg.rollout.start_timeout_s,
            max_restarts=cfg.rollout.max_restarts,
            shutdown_grace_s=cfg.cluster.shutdown_grace_s,
            env=env,
            gpu_ids=gpu_ids,
        )

    @property
    def pid(self) -> Optional[int]:
        return self.child.pid if self.child is not None else None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def start(self) -> None:
        """Start the child and block until it serves ``/model_info``."""
        if self.alive():
            raise EngineLaunchError(f"{self.name} at {self.url} is already running (pid {self.pid})")
        if model_info_ready(self.url, timeout_s=1.0):
            raise EngineLaunchError(
                f"{self.name}: something already answers at {self.url}; "
                "another engine on this port? change rollout.port"
            )
        self._spawn()
        self.wait_ready()

    def _spawn(self) -> None:
        env = engine_environment(os.environ, gpu_ids=self.gpu_ids, extra=self.env)
        log.info(
            "starting %s (CUDA_VISIBLE_DEVICES=%s): %s",
            self.name,
            env.get("CUDA_VISIBLE_DEVICES", "-"),
            " ".join(redacted(self.command)),
        )
        self.child = spawn_child(self.name, self.command, log_dir=self.log_dir, env=env, inherit_env=False)

    def wait_ready(self) -> None:
        """Block until the (just spawned) child serves ``/model_info``; ``EngineLaunchError`` if it dies
        or ``rollout.start_timeout_s`` passes."""
        assert self.child is not None, "wait_ready() before start()/relaunch()"
        try:
            wait_until(
                lambda: model_info_ready(self.url),
                timeout_s=self.start_timeout_s,
                what=f"{self.name} to answer {self.url}/model_info",
                child=self.child,
                interval_s=0.3,
            )
        except (ChildFailed, TimeoutError) as e:
            self._kill()
            raise EngineLaunchError(
                f"{self.name} at {self.url} did not start (step: start, "
                f"rollout.start_timeout_s={self.start_timeout_s:g}): {e}"
            ) from None
        log.info("%s ready at %s (pid %d)", self.name, self.url, self.pid)

    def probe(self, timeout_s: float) -> bool:
        """One liveness check (``liveness``): False when it failed; ``last_probe`` says why."""
        self.last_probe = liveness(self.url, timeout_s)
        return self.last_probe is None

    def exit_code(self) -> Optional[int]:
        return self.child.popen.poll() if self.child is not None else None

    def relaunch(self, reason: str) -> None:
        """Kill what is left of the engine (SIGKILL: a stopped process cannot handle SIGTERM) and spawn a new
        one (call ``wait_ready`` next). Beyond ``max_restarts``: ``EngineLaunchError`` naming the engine."""
        if self.restarts >= self.max_restarts:
            self._kill_now()
            raise EngineLaunchError(
                f"{self.name} at {self.url} is {reason} after {self.restarts} restart(s) "
                f"(rollout.max_restarts={self.max_restarts}); last lines of {self.log_path}:\n{tail_file(self.log_path)}"
            )
        self.restarts += 1
        log.warning("%s at %s is %s; restart %d/%d", self.name, self.url, reason, self.restarts, self.max_restarts)
        self._kill_now()
        self._spawn()

    def _kill_now(self) -> None:
        if self.child is None:
            return
        self.child.stopping = True
        if self.child.alive():
            try:
                os.killpg(self.child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_child(self.child, self.shutdown_grace_s)  # reaps it and forgets it

    def check(self) -> bool:
        """Call periodically. Returns True when the engine is up; restarts a dead engine (blocking
        until ready) while restarts remain, and raises ``EngineLaunchError`` after that."""
        if self.alive():
            return True
        code = self.child.popen.returncode if self.child is not None else None
        tail = tail_file(self.log_path)
        if self.restarts >= self.max_restarts:
            raise EngineLaunchError(
                f"{self.name} at {self.url} exited (code {code}) after {self.restarts} restart(s) "
                f"(rollout.max_restarts={self.max_restarts}); last lines of {self.log_path}:\n{tail}"
            )
        self.restarts += 1
        log.warning("%s exited with code %s; restart %d/%d", self.name, code, self.restarts, self.max_restarts)
        self.child = None
        self.start()
        return False

    def _kill(self) -> None:
        if self.child is not None:
            stop_child(self.child, self.shutdown_grace_s)

    def stop(self) -> None:
        """SIGTERM the engine's process group, wait the grace period, then SIGKILL."""
        self._kill()
        if self.child is not None:
            log.info("%s stopped (code %s)", self.name, self.child.popen.returncode)

    def wait_exit(self, timeout_s: float) -> Optional[int]:
        """Wait up to ``timeout_s`` for the child to exit; its code or None."""
        t0 = time.monotonic()
        while self.alive() and time.monotonic() - t0 < timeout_s:
            time.sleep(0.05)
        return None if self.alive() else self.child.popen.returncode
