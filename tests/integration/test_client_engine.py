"""The SGLang client's failure paths and the engine supervisor, against real processes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys

import pytest

from asyncrl.config.schema import Config, LoggingConfig, RolloutConfig
from asyncrl.cpu_engine.testing import REPO_ROOT, free_port
from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.engine.launch import EngineLaunchError, EngineSupervisor
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow


def test_client_errors_name_url_and_endpoint():
    async def go():
        port = free_port()
        async with SGLangClient(f"http://127.0.0.1:{port}", control_timeout_s=2) as c:
            with pytest.raises(EngineError) as ei:
                await c.model_info()
            assert ei.value.status is None and ei.value.endpoint == "/model_info" and str(port) in str(ei.value)

        # a server that accepts and never answers: the call times out
        async def silent(reader, writer):
            await asyncio.sleep(30)

        srv = await asyncio.start_server(silent, "127.0.0.1", 0)
        p = srv.sockets[0].getsockname()[1]
        async with SGLangClient(f"http://127.0.0.1:{p}") as c:
            with pytest.raises(EngineError, match="timeout"):
                await c.generate([1, 2], {"max_new_tokens": 1}, timeout_s=0.5)
        srv.close()

    asyncio.run(go())


def test_supervisor_start_timeout_and_early_exit_show_the_log(tmp_path):
    port = free_port()
    never = [
        sys.executable,
        "-c",
        "print('hello from a server that never listens', flush=True); import time; time.sleep(60)",
    ]
    sup = EngineSupervisor(
        never, url=f"http://127.0.0.1:{port}", name="never", log_dir=tmp_path, start_timeout_s=1.5, shutdown_grace_s=2
    )
    with pytest.raises(EngineLaunchError, match="hello from a server that never listens"):
        sup.start()
    assert not sup.alive()
    dies = [sys.executable, "-c", "import sys; print('fatal: bad flag', flush=True); sys.exit(3)"]
    sup = EngineSupervisor(dies, url=f"http://127.0.0.1:{port}", name="dies", log_dir=tmp_path, start_timeout_s=30)
    with pytest.raises(EngineLaunchError, match="fatal: bad flag"):
        sup.start()


def test_supervisor_runs_cpu_engine_from_config_and_restarts_it(tmp_path, monkeypatch):
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    cfg = dataclasses.replace(
        Config(),
        rollout=RolloutConfig(
            rollout_backend="cpu",
            model_path=str(model),
            max_running_requests=4,
            port=free_port(),
            start_timeout_s=60,
            max_restarts=1,
        ),
        logging=LoggingConfig(run_dir=str(tmp_path / "run")),
    )
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    sup = EngineSupervisor.from_config(cfg, engine_index=0, host="127.0.0.1")
    sup.start()
    try:
        assert sup.log_path == tmp_path / "run" / "logs" / "engine0.log" and sup.log_path.is_file()

        async def ask():
            async with SGLangClient(sup.url) as c:
                r = await c.generate([3, 4, 5], {"max_new_tokens": 3, "temperature": 0})
                return r, await c.model_info()

        r, info = asyncio.run(ask())
        assert len(r.output_ids) == 3 and info["weight_version"] == "0"
        assert sup.check() is True
        os.kill(sup.pid, signal.SIGKILL)
        assert sup.wait_exit(10) is not None
        assert sup.check() is False and sup.restarts == 1 and sup.alive()  # restarted, ready again
        asyncio.run(ask())
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait_exit(10)
        with pytest.raises(EngineLaunchError, match="max_restarts=1"):
            sup.check()
    finally:
        sup.stop()
    assert not sup.alive()
