"""Helpers for tests and benchmarks that need a live CPU engine (real process, real HTTP).

with running_cpu_engine(model_dir, max_running_requests=8) as sup:
    ...  # sup.url answers the SGLang API
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from asyncrl.cluster.ports import free_port
from asyncrl.engine.launch import EngineLaunchError, EngineSupervisor

REPO_ROOT = Path(__file__).resolve().parents[2]


PORT_ATTEMPTS = 3
"""``running_cpu_engine`` picks a free port (``cluster.ports``: below the ephemeral range, so only a process that
asks for that very port can take it) and the engine binds it a second later. Should another process take it in
between anyway, the engine exits with ``Address already in use`` and the helper starts it again on a new port."""


def _engine_cmd(
    model_path, port: int, *, max_running_requests: int, weight_version: str, seed: int, extra
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "asyncrl.cpu_engine.server",
        "--model-path",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-running-requests",
        str(max_running_requests),
        "--weight-version",
        weight_version,
        "--seed",
        str(seed),
        *(extra or []),
    ]


@contextlib.contextmanager
def running_cpu_engine(
    model_path: str | Path,
    *,
    log_dir: str | Path,
    max_running_requests: int = 8,
    weight_version: str = "0",
    seed: int = 0,
    extra: list[str] | None = None,
    start_timeout_s: float = 120.0,
) -> Iterator[EngineSupervisor]:
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        sup = EngineSupervisor(
            _engine_cmd(
                model_path,
                port,
                max_running_requests=max_running_requests,
                weight_version=weight_version,
                seed=seed,
                extra=extra,
            ),
            url=f"http://127.0.0.1:{port}",
            name=f"cpu_engine_{port}",
            log_dir=log_dir,
            start_timeout_s=start_timeout_s,
            max_restarts=0,
            shutdown_grace_s=5.0,
            env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
        )
        try:
            sup.start()
            break
        except EngineLaunchError as e:
            # the port was free when asked for, and taken by another process before the engine bound it
            if "address already in use" not in str(e).lower() or attempt == PORT_ATTEMPTS:
                raise
    try:
        yield sup
    finally:
        sup.stop()
