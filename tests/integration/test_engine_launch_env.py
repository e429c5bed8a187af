"""An engine started from inside a torchrun rank, the way the launcher starts it, comes up.

One torchrun job (1 rank; this file's ``__main__`` is the rank) starts the CPU engine through
``EngineSupervisor.from_config`` -- the rollout role's and the eval fleet's code path -- and records
what happened. The CPU engine creates its own one-process ``tcp://`` torch.distributed world at start,
as SGLang does, so an engine that inherits the rank's ``TORCHELASTIC_USE_AGENT_STORE=True`` waits for a
store nobody hosts and never answers. The rank also starts the same command with the raw inherited
environment (``spawn_child`` as before issue 13) to show that this is what the clean environment fixes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest

pytestmark = pytest.mark.slow


def _rank_main(model: str, out: str, port: int) -> None:
    from asyncrl.cluster.process import spawn_child, stop_child
    from asyncrl.config.schema import Config, LoggingConfig, RolloutConfig
    from asyncrl.engine.launch import EngineLaunchError, EngineSupervisor, model_info_ready

    res: dict = {"rank_env": {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT")}}
    cfg = dataclasses.replace(
        Config(),
        rollout=RolloutConfig(
            rollout_backend="cpu",
            model_path=model,
            max_running_requests=2,
            port=port,
            start_timeout_s=90,
            max_restarts=0,
        ),
        logging=LoggingConfig(run_dir=str(Path(out).parent / "run")),
    )
    sup = EngineSupervisor.from_config(cfg, engine_index=0, host="127.0.0.1")
    try:
        sup.start()
        res["started"] = True
        env = Path(f"/proc/{sup.pid}/environ").read_bytes().split(b"\0")
        res["engine_env_keys"] = sorted(e.split(b"=", 1)[0].decode() for e in env if b"=" in e)
    except EngineLaunchError as e:
        res["started"], res["error"] = False, str(e)[-2000:]
    finally:
        sup.stop()
    # the same engine with the rank's whole environment (a short --dist-timeout: it cannot succeed)
    leaky = spawn_child(
        "leaky_engine", [*sup.command, "--dist-timeout", "5"], log_dir=sup.log_dir, env={"OMP_NUM_THREADS": "1"}
    )
    deadline = time.monotonic() + 60
    while leaky.alive() and time.monotonic() < deadline and not model_info_ready(sup.url, timeout_s=1.0):
        time.sleep(0.3)
    res["leaky_answered"] = model_info_ready(sup.url, timeout_s=1.0)
    res["leaky_exit_code"] = leaky.popen.poll()
    res["leaky_log"] = leaky.tail(5)
    stop_child(leaky, 5.0)
    Path(out).write_text(json.dumps(res))


def test_engine_started_from_a_torchrun_rank_comes_up(tmp_path):
    from asyncrl.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    out = tmp_path / "result.json"
    proc = proc_helpers.run_torchrun(
        Path(__file__), [str(model), str(out), str(proc_helpers.free_port())], nproc=1, timeout_s=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["rank_env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # we really were a torchrun rank
    assert res["started"], res.get("error")
    leaked = [
        k
        for k in res["engine_env_keys"]
        if k.startswith("TORCHELASTIC_") or k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    ]
    assert leaked == []
    # the inherited environment is what breaks the start (the engine's tcp:// world never forms)
    assert not res["leaky_answered"]
    assert res["leaky_exit_code"] not in (None, 0), res["leaky_log"]
    assert "timed out" in res["leaky_log"] or "Timeout" in res["leaky_log"], res["leaky_log"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _rank_main(*sys.argv[1:3], int(sys.argv[3]))
