"""Start ``python -m asyncrl.broker`` as a child and wait for its address (tests, benchmarks, tools).

The launcher supervises the broker through ``asyncrl.cluster.process``; this helper is the small,
self-contained way to get one running with a timeout and a liveness check.

    bp = start_broker("configs/tiny.toml", ["data.rollout_batch_size=4"], log_path="broker.log")
    client = BrokerClient(bp.address); ...; bp.stop()
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class BrokerProcess:
    proc: subprocess.Popen
    address: str

    def stop(self, *, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode


def start_broker(config_path: str, overrides: list[str] | None = None, *, bind: str = "tcp://127.0.0.1:0",
                 prompts_path: Optional[str] = None, log_path: Optional[str] = None, log_level: str = "INFO",
                 timeout_s: float = 30.0) -> BrokerProcess:
    fd, addr_file = tempfile.mkstemp(prefix="asyncrl-broker-", suffix=".addr")
    os.close(fd)
    os.unlink(addr_file)
    cmd = [sys.executable, "-m", "asyncrl.broker", str(config_path), *(overrides or []), "--bind", bind,
           "--address-file", addr_file, "--log-level", log_level]
    if prompts_path:
        cmd += ["--prompts", str(prompts_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    # stdout inherited: the broker prints its warnings there (the console); everything goes to the log
    proc = subprocess.Popen(cmd, stdout=None, stderr=log, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while not os.path.exists(addr_file):
            if proc.poll() is not None:
                raise RuntimeError(f"broker exited with code {proc.returncode} before binding"
                                   + (f"; see {log_path}" if log_path else ""))
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"broker did not publish its address within {timeout_s:.0f}s")
            time.sleep(0.02)
        address = Path(addr_file).read_text().strip()
        os.unlink(addr_file)
    finally:
        if log_path:
            log.close()
    return BrokerProcess(proc, address)
