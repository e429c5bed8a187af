"""An engine's environment and devices (pure): torchrun's variables removed, its own GPUs visible."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config.schema import Config, RolloutConfig
from asyncrl.engine.launch import (
    EngineLaunchError,
    EngineSupervisor,
    engine_environment,
    engine_visible_devices,
)

# what torchrun 2.13 exports to a rank (local_elastic_agent.py), plus the user's own settings
RANK_ENV = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "RANK": "9",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "16",
    "LOCAL_WORLD_SIZE": "8",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "9",
    "ROLE_NAME": "default",
    "ROLE_WORLD_SIZE": "16",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "x",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCHELASTIC_ERROR_FILE": "/tmp/e",
    "PATH": "/usr/bin",
    "HF_HOME": "/data/hf",
    "NCCL_SOCKET_IFNAME": "ib0",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
}


def test_engine_environment_drops_every_torchrun_variable_and_keeps_the_users():
    env = engine_environment(RANK_ENV)
    assert env == {
        "PATH": "/usr/bin",
        "HF_HOME": "/data/hf",
        "NCCL_SOCKET_IFNAME": "ib0",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    }
    env = engine_environment(RANK_ENV, gpu_ids=range(2, 4), extra={"OMP_NUM_THREADS": "1"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "1" and "RANK" not in env


def test_visible_devices_map_through_the_parents_list():
    assert engine_visible_devices(None, range(4, 8)) == "4,5,6,7"
    assert engine_visible_devices("3,5,7, 9", [1, 2]) == "5,7"
    assert engine_visible_devices("GPU-a,GPU-b", [1]) == "GPU-b"
    with pytest.raises(EngineLaunchError, match="CUDA_VISIBLE_DEVICES='0'"):
        engine_visible_devices("0", [1])
    with pytest.raises(EngineLaunchError, match="not all visible"):
        engine_visible_devices("", [0])


def test_from_config_gives_sglang_its_devices_and_base_gpu_id_0():
    cfg = dataclasses.replace(Config(), rollout=RolloutConfig(model_path="/m", tensor_parallel_size=2))
    sup = EngineSupervisor.from_config(
        cfg, engine_index=3, local_engine_index=6, base_gpu_id=6, run_dir="/tmp/r", name="eval_engine1"
    )
    cmd = sup.command
    assert cmd[cmd.index("--base-gpu-id") + 1] == "0" and cmd[cmd.index("--tp-size") + 1] == "2"
    no_health_generation = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}  # engine.liveness says why
    assert sup.gpu_ids == [6, 7] and sup.name == "eval_engine1" and sup.env == no_health_generation
    assert sup.start_timeout_s == cfg.rollout.start_timeout_s >= 1800
    cpu = dataclasses.replace(cfg, rollout=RolloutConfig(rollout_backend="cpu", model_path="/m"))
    sup = EngineSupervisor.from_config(cpu, engine_index=0)
    assert sup.gpu_ids is None and sup.env == {**no_health_generation, "OMP_NUM_THREADS": "1"}
