"""The CPU engine's start-up: its flags (SGLang's names), its arguments, and its own torch.distributed world.

    args = parse_args(["--model-path", "runs/tiny/model", "--port", "30000"])
    init_engine_world(args)  # as SGLang: a one-process gloo world before the model loads

Start-up as SGLang's (0.5.23 ``srt/distributed/bootstrap.py``): before loading the model the engine creates its
own one-process torch.distributed world, ``init_process_group("gloo", init_method="tcp://<host>:<nccl_port>",
rank=0, world_size=1)`` (SGLang does this even at TP=1, with a free ``nccl_port`` unless ``--nccl-port``). So an
engine started with a torchrun rank's environment (``TORCHELASTIC_USE_AGENT_STORE=True``) fails here exactly as
SGLang would (it waits for a store nobody hosts, then exits after ``--dist-timeout``): CI sees a launcher that
leaks that environment.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from asyncrl.cluster import auth
from asyncrl.cluster.ports import free_port

log = logging.getLogger("asyncrl.cpu_engine")

PROG = "python -m asyncrl.cpu_engine.server"
NUM_THREADS_ENV = "ASYNCRL_CPU_ENGINE_NUM_THREADS"
"""``--num-threads`` where the command line leaves it out. The launcher starts the CPU engine with
``OMP_NUM_THREADS=1`` (one core, the other the actor's) and no ``--num-threads``; a run's processes inherit this
variable, so a benchmark gives the engine both cores of a sync (turn-taking) run with it (``benchmarks/overlap.py``).
Not SGLang's: a GPU engine has no CPU threads to size."""
DTYPES = {
    "auto": torch.float32,
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
"""SGLang 0.5.23's ``--dtype`` choices -> the dtype the CPU engine holds its weights at (``auto``: fp32, see
``EngineArgs.dtype``)."""


@dataclass(frozen=True)
class EngineArgs:
    model_path: str
    port: int
    host: str = "127.0.0.1"
    max_running_requests: int = 64
    weight_version: str = "default"
    seed: int = 0
    prefix_cache_tokens: int = 32768
    """Tokens of finished requests' KV kept for prefix reuse (0 disables)."""
    context_length: Optional[int] = None
    """Defaults to the model's max_position_embeddings."""
    num_threads: Optional[int] = None
    """torch intra-op threads (default: ``NUM_THREADS_ENV`` where set, else torch's choice)."""
    weight_sync_timeout_s: float = 600.0
    """Timeout of the weight-update group (join and each broadcast)."""
    nccl_port: Optional[int] = None
    """Port of the engine's own one-process torch.distributed world (SGLang ``--nccl-port``; default: free)."""
    dist_timeout_s: float = 120.0
    """Timeout of creating that world (SGLang ``--dist-timeout``)."""
    api_key: Optional[str] = None
    """SGLang's ``--api-key``: every request but OPTIONS and paths starting with ``/health``, ``/ready`` or
    ``/metrics`` needs ``Authorization: Bearer <key>`` (else 401 ``{"error": "Unauthorized"}``); defaults to
    ``ASYNCRL_API_KEY``. Matches sglang 0.5.23 exactly (``asyncrl.cluster.auth`` says which files)."""
    enable_return_routed_experts: bool = False
    """SGLang's ``--enable-return-routed-experts`` (a mixture-of-experts model): a ``/generate`` with
    ``return_routed_experts`` gets ``meta_info["routed_experts"]``, every token's experts in every layer."""
    dtype: str = "auto"
    """SGLang's ``--dtype`` (its choices): the weights are held rounded to this dtype (``bfloat16``/``bfloat16``,
    ``half``/``float16``); compute stays fp32. ``auto`` keeps fp32 (SGLang's auto would pick the checkpoint's
    16-bit dtype; the CPU engine keeps its fp32 default: docs/sglang_differences.md)."""
    custom_weight_loader: tuple[str, ...] = ()
    """SGLang's ``--custom-weight-loader``: import paths (``module.func``) that ``/update_weights_from_tensor``
    accepts as ``load_format``; each is called as ``func(model, named_tensors)``."""


def parse_args(argv: Optional[list[str]] = None) -> EngineArgs:
    ap = argparse.ArgumentParser(prog=PROG, description="The CPU engine: an HTTP server that speaks SGLang's API.")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    ap.add_argument("--prefix-cache-tokens", type=int, default=32768)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--weight-sync-timeout-s", type=float, default=600.0)
    ap.add_argument("--nccl-port", type=int, default=None)
    ap.add_argument("--dist-timeout", dest="dist_timeout_s", type=float, default=120.0)
    ap.add_argument("--api-key", default=None, help="like SGLang's --api-key (default: $ASYNCRL_API_KEY)")
    ap.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="as SGLang's: answer return_routed_experts with each token's experts (meta_info.routed_experts)",
    )
    ap.add_argument("--dtype", default="auto", choices=list(DTYPES), help="as SGLang's: the weights' dtype")
    ap.add_argument(
        "--custom-weight-loader",
        nargs="*",
        default=None,
        help="as SGLang's: import paths (module.func) accepted as /update_weights_from_tensor's load_format",
    )
    a = ap.parse_args(argv)
    if a.max_running_requests < 1:
        ap.error("--max-running-requests must be >= 1")
    if a.num_threads is None and os.environ.get(NUM_THREADS_ENV):
        value = os.environ[NUM_THREADS_ENV]
        if not value.isdigit() or int(value) < 1:
            ap.error(f"{NUM_THREADS_ENV}={value!r}: expected a whole number of threads >= 1")
        a.num_threads = int(value)
    return EngineArgs(
        model_path=a.model_path,
        port=a.port,
        host=a.host,
        max_running_requests=a.max_running_requests,
        weight_version=a.weight_version,
        seed=a.seed,
        prefix_cache_tokens=a.prefix_cache_tokens,
        context_length=a.context_length,
        num_threads=a.num_threads,
        weight_sync_timeout_s=a.weight_sync_timeout_s,
        nccl_port=a.nccl_port,
        dist_timeout_s=a.dist_timeout_s,
        api_key=a.api_key or auth.current(),
        enable_return_routed_experts=a.enable_return_routed_experts,
        dtype=a.dtype,
        custom_weight_loader=tuple(a.custom_weight_loader or ()),
    )


def weight_dtype(name: str) -> torch.dtype:
    """The dtype the CPU engine rounds its weights to for SGLang's ``--dtype`` value ``name``."""
    return DTYPES[name]


def init_engine_world(args: EngineArgs) -> str:
    """The engine's own one-process torch.distributed world, created the way SGLang creates its TP world
    (see module contract); returns the ``tcp://`` init method used."""
    host = args.host or "127.0.0.1"
    port = args.nccl_port
    if port is None:  # SGLang also picks a free port for its nccl_port
        port = free_port(host)
    init_method = f"tcp://{host}:{port}"
    t0 = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=init_method, rank=0, world_size=1, timeout=_dt.timedelta(seconds=args.dist_timeout_s)
    )
    log.info("own torch.distributed world at %s (gloo, 1 rank) in %.2fs", init_method, time.monotonic() - t0)
    return init_method


def env_bool(name: str, default: bool) -> bool:
    """An environment switch read as SGLang's ``EnvBool`` reads it (a value it does not know is an error)."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if v.lower() in ("true", "1", "yes", "y"):
        return True
    if v.lower() in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{name}: {v!r} is not a valid boolean value")
