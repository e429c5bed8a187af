"""Check what asyncrl sends to SGLang against SGLang's own parser and request classes (sglang 0.5.23).

No GPU, no server: sglang is installed WITHOUT its dependencies in a throwaway environment, plus the light
packages that importing ``sglang.srt.server_args`` and ``sglang.srt.managers.io_struct`` needs (checked 2026-12-05):

    python -m venv /tmp/sgl && /tmp/sgl/bin/pip install --no-deps sglang==0.5.23
    /tmp/sgl/bin/pip install torch==2.13.0 numpy orjson psutil pybase64 requests packaging pillow starlette \
        msgspec pydantic pyzmq tqdm ipython aiohttp transformers apache-tvm-ffi==0.1.11 sentencepiece \
        compressed-tensors gguf openai partial-json-parser triton dill pytest pytest-timeout
    PYTHONPATH=.:tools/sglang_check_stubs /tmp/sgl/bin/python tools/check_sglang.py   # JSON report; exit 1 on a mismatch
    PYTHONPATH=.:tools/sglang_check_stubs /tmp/sgl/bin/python -m pytest -q tests/unit/test_check_sglang.py

``tools/sglang_check_stubs`` holds an import-time stand-in for torchvision: PyPI's torchvision is built against
CUDA torch and does not load next to the CPU torch, and sglang's and transformers' modules import it at import
time (never called by these checks). The tool's recorders (below) run without sglang, in the test suite.

What it checks
- Command lines: ``sglang_command`` (rollout engines; TP 1 and TP 2 with extra args) and the eval fleet's
  (``eval_engine_config``) go through ``sglang.srt.server_args.prepare_server_args`` -- what
  ``python -m sglang.launch_server`` runs on its argv -- and every value we meant is read back.
- Request bodies, built by our own code: ``SGLangClient`` (its one transport method replaced by a recorder),
  the weight sync (the real ``WeightSyncer`` pause, push and finish for every pause mode, per-tensor and
  flattened, with its ``Exchange`` calls and the group's ``post_json`` recorded and answered at once, the
  broadcasts completed at once; ``group.join_request``) and the agent loop's sampling parameters. Each body is
  validated the way SGLang's FastAPI server does it (pydantic over the endpoint's request class:
  ``GenerateReqInput`` dataclass or the msgspec ``*ReqInput`` structs), every key must be a field of that class
  (FastAPI drops unknown keys silently), every required field present; ``/generate`` bodies also pass SGLang's
  JSON contract gate (``generate_contract_error``) and build a ``SamplingParams``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENDPOINT_CLASSES = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}
NO_BODY = {"/flush_cache"}  # SGLang 0.5.23 reads only a ``timeout`` query parameter there


# ------------------------------------------------------------------------------------- command lines
def _expected(cfg, *, port: int, tp: int) -> dict[str, Any]:
    r = cfg.rollout
    return {
        "model_path": r.model_path or cfg.actor.model_path,
        "tp_size": tp,
        "dp_size": 1,
        "base_gpu_id": 0,
        "host": "0.0.0.0",
        "port": port,
        "mem_fraction_static": r.sglang.mem_fraction_static,
        "max_running_requests": r.max_running_requests,
        "enable_metrics": True,
        "weight_version": "0",
        "random_seed": cfg.runner.seed,
        "skip_server_warmup": True,
    }


def command_cases() -> list[tuple[str, Any, int]]:
    from asyncrl.config.eval_engine import eval_engine_config
    from asyncrl.config.loader import load_config

    base = load_config(ROOT / "configs/searchr1.toml", [])
    tp2 = load_config(
        ROOT / "configs/searchr1.toml",
        [
            "rollout.tensor_parallel_size=2",
            'rollout.sglang.extra_args=["--log-level", "warning", "--chunked-prefill-size", "8192"]',
        ],
    )
    fleet = load_config(
        ROOT / "configs/searchr1.toml",
        ["eval.eval_num_gpus=2", "eval.eval_num_gpus_per_engine=2", 'eval.eval_sglang={mem_fraction_static = "0.6"}'],
    )
    return [
        ("rollout (configs/searchr1.toml)", base, 1),
        ("rollout TP 2 + extra_args", tp2, 2),
        ("eval fleet TP 2", eval_engine_config(fleet), 2),
    ]


def check_commands() -> list[dict]:
    from sglang.srt.server_args import prepare_server_args

    from asyncrl.rollout.sglang_launcher import EngineSupervisor

    out = []
    for name, cfg, tp in command_cases():
        # the launcher's own path: from_config (the engine sees its devices, --base-gpu-id 0)
        sup = EngineSupervisor.from_config(cfg, engine_index=0, base_gpu_id=4, port=30010, run_dir="/tmp/x")
        argv = sup.command
        assert argv[1:3] == ["-m", "sglang.launch_server"], argv
        res = {"case": name, "argv": argv[3:], "problems": []}
        try:
            sa = prepare_server_args(argv[3:])
        except (SystemExit, Exception) as e:  # noqa: BLE001 - the report says what SGLang's parser said
            res["problems"].append(f"prepare_server_args rejected it: {type(e).__name__}: {e}")
            out.append(res)
            continue
        for k, want in _expected(cfg, port=30010, tp=tp).items():
            got = getattr(sa, k)
            if got != want and str(got) != str(want):
                res["problems"].append(f"{k}: SGLang read {got!r}, we meant {want!r}")
        out.append(res)
    return out


# ------------------------------------------------------------------------------------- request bodies
def _client_bodies() -> list[tuple[str, Any]]:
    """Every body ``SGLangClient`` (the agent loop's, the eval's and the fleet's engine client) sends, recorded at
    its one transport method (``_request``)."""
    from asyncrl.engine.client import SGLangClient

    calls: list[tuple[str, str, Any]] = []

    async def record(self, method, endpoint, body=None, *, timeout_s=None, want="json"):
        calls.append((method, endpoint, body))
        if endpoint == "/generate":
            return {"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": {"type": "length"}}}
        return {"success": True, "message": "", "weight_version": "3"}

    async def drive() -> None:
        c = SGLangClient("http://sglang:30000")
        c._request = types.MethodType(record, c)
        await c.generate([1, 2, 3], _agent_sampling_params(greedy=False), rid="w0-g1-0")
        await c.generate([1, 2, 3], _agent_sampling_params(greedy=True), rid="w0-g1-1", logprob_start_len=0)
        await c.generate([1, 2, 3], {"max_new_tokens": 1, "temperature": 0.0}, logprob_start_len=0)  # fleet probe
        await c.update_weights_from_disk("/snap/step_3", weight_version="3")
        await c.weight_version()  # a GET: no body

    asyncio.run(drive())
    return [(f"SGLangClient {e}", (e, b)) for m, e, b in calls if m == "POST"]


def _agent_sampling_params(*, greedy: bool) -> dict:
    from asyncrl.agent.loop import AgentLoop
    from asyncrl.agent.tasks.searchr1 import SearchR1Task
    from asyncrl.config.schema import SamplingConfig

    me = types.SimpleNamespace(sampling=SamplingConfig(temperature=1.0, top_p=0.9, top_k=20), task=SearchR1Task())
    return AgentLoop.sampling_params(me, 500, greedy=greedy)


class _DoneWork:
    """A broadcast that completed at once (no process group: only the HTTP bodies are checked here)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def _sync_bodies() -> list[tuple[str, Any]]:
    """Every body the weight sync sends, recorded where it leaves our code: each ``Exchange`` call (pause, the
    pipelined begin, every bucket's update with the pipelined end behind the last one, the version bump, flush, end,
    continue) answered at once, and the group's leave (``post_json``); the join's body comes from its builder. The
    real ``WeightSyncer.sync`` runs for every pause mode, per-tensor and flattened, and a pipeline stage's push (no
    version on its last bucket) with the coordinator's ``finish``."""
    import torch

    from asyncrl.config.schema import PAUSE_MODES, SyncConfig
    from asyncrl.sync import group as group_mod
    from asyncrl.sync import weight_sync
    from asyncrl.sync.bucketing import iter_buckets
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup

    calls: list[tuple[str, Any]] = []

    class RecordingExchange(weight_sync.Exchange):
        """Records each call's body and answers it at once (success; ``/model_info``: version 7), no engine."""

        def start(self):
            return self

        def wait(self, **kw):
            for _, cs in self.chains:
                for c in cs:
                    if c.method == "POST":
                        calls.append((c.path, c.body))
            return [[{"weight_version": "7", "success": True, "message": ""} for _ in cs] for _, cs in self.chains]

    def recording_post_json(url, path, body, **kw):
        calls.append((path, body))
        return {"success": True, "message": ""}

    saved = weight_sync.Exchange, weight_sync.broadcast_from_rank0, group_mod.post_json
    weight_sync.Exchange = RecordingExchange
    weight_sync.broadcast_from_rank0 = lambda t, pg: _DoneWork()
    group_mod.post_json = recording_post_json
    try:
        state = {
            "model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
            "model.norm.weight": torch.zeros(2),
        }
        for flat in (False, True):
            cfg = SyncConfig(flattened_bucket=flat, bucket_bytes=16)  # 16 bytes: one tensor a bucket, two buckets
            group = WeightSyncGroup([EngineEndpoint("http://e0:30000")], cfg)
            group.pg = object()  # the broadcasts are _DoneWork; only the bodies leave
            for mode in (m for m in PAUSE_MODES if m != "drain"):  # drain polls the engines' load first
                syncer = weight_sync.WeightSyncer(group, pause_mode=mode, sync_cfg=cfg)
                syncer.sync(iter_buckets(state.items(), cfg.bucket_bytes), 7)
                syncer.push(iter_buckets(state.items(), cfg.bucket_bytes))  # a pipeline stage's push: no version
                syncer.finish(7)  # ... so the coordinator bumps the version and ends the update
        WeightSyncGroup([EngineEndpoint("http://e0:30000")], SyncConfig(backend="nccl")).destroy()  # the leave
    finally:
        weight_sync.Exchange, weight_sync.broadcast_from_rank0, group_mod.post_json = saved
    calls += _join_bodies()
    return [(f"weight sync {p}", (p, b)) for p, b in calls]


def _join_bodies() -> list[tuple[str, Any]]:
    """The join's body, from its one builder (``WeightSyncGroup.init`` sends it; running that needs the engines
    to join a real rendezvous)."""
    from asyncrl.sync.group import join_request

    body = join_request(
        master_address="10.0.0.1",
        master_port=29555,
        rank_offset=1,
        world_size=2,
        group_name="weight_update_group",
        backend="nccl",
    )
    return [("/init_weights_update_group", body)]


def _fields(cls) -> tuple[set[str], set[str]]:
    """(all field names, required field names) of a dataclass or msgspec struct."""
    if dataclasses.is_dataclass(cls):
        fs = [f for f in dataclasses.fields(cls) if f.init]
        req = {f.name for f in fs if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return {f.name for f in fs}, req
    import msgspec

    fs = msgspec.structs.fields(cls)
    return {f.name for f in fs}, {f.name for f in fs if f.required}


def check_body(endpoint: str, body: Any) -> list[str]:
    from pydantic import TypeAdapter, ValidationError
    from sglang.srt.managers import io_struct

    if endpoint in NO_BODY:
        return []
    if endpoint not in ENDPOINT_CLASSES:
        return [f"no SGLang request class known for {endpoint}"]
    cls = getattr(io_struct, ENDPOINT_CLASSES[endpoint])
    problems = []
    if not isinstance(body, dict):
        return [f"body is {type(body).__name__}, SGLang's server parses a JSON object into {cls.__name__}"]
    names, required = _fields(cls)
    unknown = sorted(set(body) - names)
    if unknown:
        problems.append(f"keys {unknown} are not fields of {cls.__name__} (FastAPI drops them silently)")
    missing = sorted(required - set(body))
    if missing:
        problems.append(f"required fields {missing} of {cls.__name__} are missing")
    try:
        TypeAdapter(cls).validate_python(body)
    except ValidationError as e:
        problems.append(f"{cls.__name__} rejects it: {e}")
    if endpoint == "/generate":
        problems += _check_generate(body)
    return problems


def _check_generate(body: dict) -> list[str]:
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    problems = []
    err = generate_contract_error(body)
    if err is not None:
        problems.append(f"SGLang's /generate contract gate: {err}")
    try:
        sp = SamplingParams(**body.get("sampling_params", {}))
        # our servers keep their tokenizer (no --skip-tokenizer-init): stop strings are matched on text
        sp.normalize(types.SimpleNamespace(encode=lambda s, add_special_tokens=False: list(s.encode())))
        sp.verify(vocab_size=151936)
    except (TypeError, ValueError) as e:
        problems.append(f"SamplingParams rejects {body.get('sampling_params')}: {e}")
    return problems


def check_bodies() -> list[dict]:
    out = []
    for name, (endpoint, body) in _client_bodies() + _sync_bodies():
        out.append({"case": name, "body": body, "problems": check_body(endpoint, body)})
    return out


def main() -> int:
    import sglang

    sys.path.insert(0, str(ROOT))
    report = {
        "sglang": sglang.__version__,
        "launch_module": importlib.util.find_spec("sglang.launch_server") is not None,
        "commands": check_commands(),
        "bodies": check_bodies(),
    }
    bad = [c for c in report["commands"] + report["bodies"] if c["problems"]]
    report["num_checked"] = len(report["commands"]) + len(report["bodies"])
    report["num_problems"] = sum(len(c["problems"]) for c in bad)
    print(json.dumps(report, indent=1, default=str))
    return 0 if not bad and report["launch_module"] else 1


if __name__ == "__main__":
    sys.exit(main())
