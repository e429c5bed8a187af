"""A paused engine is live, and the run secret is SGLang-safe: one real run of the embedded default checks both.

- The sync stalls for real: actor rank 0 is SIGSTOPped while the engine is paused for a weight sync (seen on the
  engine's own ``/ready``, which answers 503 while paused), and stays stopped for 3 x ``rollout.unhealthy_after_s``
  with no control traffic. The engine, like SGLang 0.5.23, keeps the health generation waiting on the pause, so a
  liveness check that used ``/health`` would call it hung and SIGKILL it; ours reads the pause from ``/ready`` and
  ``/ping`` and leaves it alone. After SIGCONT the sync completes and the run finishes with no engine restart.
- The run secret begins with ``-`` (SGLang's argparse took such a value for a flag when passed as two tokens;
  the launcher passes ``--api-key=K``). It reaches the CPU engine (a request without it is refused with 401, with
  it answered) and is written nowhere: not in any file of the run directory, not in the job's output.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from proc_helpers import TinyJob, cmdline, pids_mentioning, ppid, tiny_env

pytestmark = pytest.mark.slow

UNHEALTHY_AFTER_S = 3.0


def _status(url: str, path: str, key: str | None = None) -> int:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _actor_rank_0(run_dir: Path) -> int:
    broker = next(p for p in pids_mentioning(str(run_dir)) if "asyncrl.runner.broker_process" in cmdline(p))
    rank0 = ppid(broker)
    assert "launch/train.py" in cmdline(rank0), cmdline(rank0)
    return rank0


def _stop_while_paused(url: str, actor: int, *, tries: int, timeout_s: float) -> None:
    """SIGSTOP ``actor`` as soon as the engine reports a pause; if the sync ended before the signal landed (the
    engine is generating again), SIGCONT and catch the next sync."""
    deadline = time.monotonic() + timeout_s
    for _ in range(tries):
        while _status(url, "/ready") == 200:
            if time.monotonic() > deadline:
                pytest.fail(f"no weight sync paused the engine within {timeout_s:g} s")
        os.kill(actor, signal.SIGSTOP)
        if _status(url, "/ready") == 503:
            return
        os.kill(actor, signal.SIGCONT)
    pytest.fail(f"every one of {tries} syncs ended before actor rank 0 could be stopped inside it")


def test_a_stalled_sync_keeps_the_engine_and_the_secret_stays_secret(prepared, tmp_path):
    key = "-" + secrets.token_urlsafe(32)
    run_dir = tmp_path / "run"
    job = TinyJob(
        prepared,
        run_dir,
        "runner.max_steps=8",
        f"rollout.unhealthy_after_s={UNHEALTHY_AFTER_S}",
        "rollout.health_check_timeout_s=1",
        "rollout.health_check_interval_s=0.5",
        "cluster.actor_unresponsive_after_s=120",
        env=tiny_env(ASYNCRL_API_KEY=key),
    )
    try:
        job.wait_step(2, timeout_s=240)
        url = f"http://127.0.0.1:{job.engine_port()}"
        engine = job.engine_pid()
        assert _status(url, "/server_info") == 401, "the engine must refuse a request without the run secret"
        assert _status(url, "/server_info", key) == 200, "the engine must accept the run secret"
        actor = _actor_rank_0(run_dir)
        _stop_while_paused(url, actor, tries=20, timeout_s=120)
        stopped_at = time.monotonic()
        try:  # paused, no control traffic: the rollout rank's liveness checks run all along
            while time.monotonic() - stopped_at < 3 * UNHEALTHY_AFTER_S:
                assert job.engine_pid() == engine, "the paused engine was restarted"
                assert _status(url, "/ready") == 503, "the engine left the pause while the actor was stopped"
                time.sleep(0.2)
            assert _status(url, "/ping", key) == 200
        finally:
            os.kill(actor, signal.SIGCONT)
        rc = job.finish(timeout_s=300)
    except BaseException:
        job.kill_all()
        raise
    out = job.output()
    assert rc == 0, out[-6000:]
    last = job.records()[-1]
    assert last["step"] == 8 and last["rollout/engine_restarts"] == 0, last
    assert key not in out, "the run secret was printed"
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not leaked, f"the run secret is written in {leaked}"
