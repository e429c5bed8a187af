"""Helpers for tests and benchmarks that need a live CPU engine (real process, real HTTP).

with running_cpu_engine(model_dir, max_running_requests=8) as sup:
    ...  # sup.url answers the SGLang API
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from asyncrl.rollout.sglang_launcher import EngineSupervisor

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port the OS just handed out (bind to 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.rollout.cpu_engine",
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
    sup = EngineSupervisor(
        cmd,
        url=f"http://127.0.0.1:{port}",
        name=f"cpu_engine_{port}",
        log_dir=log_dir,
        start_timeout_s=start_timeout_s,
        max_restarts=0,
        shutdown_grace_s=5.0,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    sup.start()
    try:
        yield sup
    finally:
        sup.stop()
