"""Check what asyncrl sends to SGLang against SGLang's own parser, request classes, session rules and loaders (0.5.23).

No GPU, no server: sglang is installed WITHOUT its dependencies (GPU wheels) in a throwaway environment, plus the
light packages importing its modules needs (``tools/sglang_check_requirements.txt``, the CPU torch pinned). CI runs it
on every run (``tools/check_sglang_ci.sh``, from ``.ci/run``: ~3 minutes from a cold environment, about a minute of
it making the environment); by hand:

    bash tools/check_sglang_ci.sh            # makes .venv-sglang-check if needed, runs the tool and its tests
    PYTHONPATH=.:tools/sglang_check_stubs .venv-sglang-check/bin/python tools/check_sglang.py [--json report.json]

It prints each mismatch and "check_sglang: N checks, M mismatches"; exit 1 on a mismatch. ``tools/sglang_check_stubs``
holds an import-time stand-in for torchvision: PyPI's torchvision is built against CUDA torch and does not load next
to the CPU torch, and sglang's and transformers' modules import it at import time (never called by these checks).
The tool's recorders (below) run without sglang, in the test suite (``tests/unit/test_check_sglang.py``).

What it checks
- Command lines: ``sglang_command`` (rollout engines; TP 1, with routing replay, TP 2 with extra args) and the eval
  fleet's (``eval_engine_config``), without a run secret and with several (``ASYNCRL_API_KEY``, each starting with
  '-'), go through ``sglang.srt.server_args.prepare_server_args`` -- what ``python -m sglang.launch_server`` runs on its
  argv -- and every value we meant is read back, ``api_key`` included (the report never shows a secret).
- Request bodies, built by our own code: ``SGLangClient`` (its one transport method replaced by a recorder),
  the weight sync (the real ``WeightSyncer`` pause, push and finish for every pause mode, per-tensor and
  flattened, with its ``Exchange`` calls and the group's ``post_json`` recorded and answered at once, the
  broadcasts completed at once; ``group.join_request``) and the agent loop's sampling parameters. Each body is
  validated the way SGLang's FastAPI server does it (pydantic over the endpoint's request class:
  ``GenerateReqInput`` dataclass or the msgspec ``*ReqInput`` structs), every key must be a field of that class
  (FastAPI drops unknown keys silently), every required field present; ``/generate`` bodies also pass SGLang's
  JSON contract gate (``generate_contract_error``) and build a ``SamplingParams``.
- Weight-update sessions: the real ``WeightSyncer.sync`` against two scripted engines, once with a failure injected
  at each step (``FAULTS``: the pause, the begin, a bucket's update, the version check, the continue; an answer that
  failed or one that never came) and then a retry sync; each engine's ``/begin_weight_update``,
  ``/update_weights_from_distributed`` and ``/end_weight_update`` replayed through a real
  ``SchedulerWeightUpdaterManager`` (SGLang's session rules: a begin while a session is open, an end without one and
  an update outside one are refused). A refused begin or update is a mismatch, and so is any call where SGLang and
  the CPU engine's ``UpdateWindow`` disagree.
- Weight names: every tensor name of a tiny Qwen3-MoE checkpoint (router ``mlp.gate``, per-expert
  ``mlp.experts.<e>.{gate,up,down}_proj``: the names our weight sync sends) and of tiny Qwen3, Qwen2 and Llama ones
  goes through SGLang's own model class for it, built on CPU, and its ``load_weights`` (``Qwen3MoeForCausalLM``: the
  stacked q/k/v and gate/up mapping, then ``FusedMoE.make_expert_params_mapping`` into ``experts.w13_weight`` /
  ``experts.w2_weight``): each name must land whole, and the names together must write every parameter SGLang has.
  SGLang 0.5.23 builds every Qwen3-MoE layer sparse, so a model with dense layers (``mlp_only_layers``) loses them:
  that case is checked to lose exactly those (``expected_loss``).
- Routed experts (routing replay): the CPU engine's twin of SGLang's: ``--enable-return-routed-experts`` is SGLang's
  flag, a ``/generate`` body asking for them fits ``GenerateReqInput``, and SGLang's own reader
  (``extract_routed_experts_from_meta_info``) reads the CPU engine's ``meta_info["routed_experts"]`` back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import secrets
import sys
import threading
import types
from pathlib import Path
from typing import Any, NamedTuple

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
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
}
NO_BODY = {"/flush_cache"}  # SGLang 0.5.23 reads only a ``timeout`` query parameter there


# ------------------------------------------------------------------------------------- command lines
def _expected(cfg, *, port: int, tp: int, secret: str | None) -> dict[str, Any]:
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
        "api_key": secret,
        "enable_return_routed_experts": cfg.actor.moe_routing_replay,
    }


def run_secrets() -> list[str]:
    """Run secrets to launch with (``ASYNCRL_API_KEY``): one that starts with '-' (argparse takes a separate token
    that starts with '-' for a flag) and three of ``auth.share_secret``'s kind (``secrets.token_urlsafe(32)``) made to
    start with '-' too (about 1 in 64 does by chance)."""
    return ["-abc_DEF-123"] + ["-" + secrets.token_urlsafe(32)[1:] for _ in range(3)]


def command_cases() -> list[tuple[str, Any, int, str | None]]:
    """(name, config, TP size, run secret or None) of every command line checked."""
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
    fleet = eval_engine_config(
        load_config(
            ROOT / "configs/searchr1.toml",
            [
                "eval.eval_num_gpus=2",
                "eval.eval_num_gpus_per_engine=2",
                'eval.eval_sglang={mem_fraction_static = "0.6"}',
            ],
        )
    )
    replay = load_config(ROOT / "configs/searchr1.toml", ["actor.moe_routing_replay=true"])
    cases = [
        ("rollout (configs/searchr1.toml)", base, 1, None),
        ("rollout with routing replay (actor.moe_routing_replay)", replay, 1, None),
        ("rollout TP 2 + extra_args", tp2, 2, None),
        ("eval fleet TP 2", fleet, 2, None),
    ]
    for i, key in enumerate(run_secrets()):
        cases += [
            (f"rollout TP 2 + extra_args, run secret {i}", tp2, 2, key),
            (f"eval fleet TP 2, run secret {i}", fleet, 2, key),
        ]
    return cases


def command_argvs() -> list[tuple[str, list[str], dict[str, Any]]]:
    """(case, the engine's argv after ``python -m sglang.launch_server``, what SGLang must read from it), each built by
    the launcher's own path, ``EngineSupervisor.from_config`` (the engine sees its devices: --base-gpu-id 0), with the
    case's run secret, or none, in the environment."""
    from asyncrl.cluster import auth
    from asyncrl.engine.launch import EngineSupervisor

    out = []
    for name, cfg, tp, secret in command_cases():
        with _env(auth.ENV, secret):
            sup = EngineSupervisor.from_config(cfg, engine_index=0, base_gpu_id=4, port=30010, run_dir="/tmp/x")
        argv = sup.command
        assert argv[1:3] == ["-m", "sglang.launch_server"], argv
        out.append((name, argv[3:], _expected(cfg, port=30010, tp=tp, secret=secret)))
    return out


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``os.environ[name]`` set to ``value`` (removed for None) inside the block, restored after."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def check_commands() -> list[dict]:
    from sglang.srt.server_args import prepare_server_args

    from asyncrl.cluster.auth import redacted

    out = []
    for name, argv, expected in command_argvs():
        res = {"case": name, "argv": redacted(argv), "problems": []}
        try:
            sa = prepare_server_args(argv)
        except (SystemExit, Exception) as e:  # noqa: BLE001 - the report says what SGLang's parser said
            res["problems"].append(f"prepare_server_args rejected it: {type(e).__name__}: {e}")
            out.append(res)
            continue
        for k, want in expected.items():
            got = getattr(sa, k)
            if got == want or str(got) == str(want):
                continue
            if k == "api_key":  # the report never shows a secret
                res["problems"].append(f"api_key: SGLang read {_secret_shape(got)}, we meant {_secret_shape(want)}")
            else:
                res["problems"].append(f"{k}: SGLang read {got!r}, we meant {want!r}")
        out.append(res)
    return out


def _secret_shape(key: Any) -> str:
    return "none" if key is None else f"a {type(key).__name__} of length {len(str(key))}"


# ------------------------------------------------------------------------------------- scripted engines
INJECTED = "injected failure"  # the message of every failure the scripts inject
NOT_READABLE = "Get parameter by name failed"
"""SGLang 0.5.23's 400 to ``/get_weights_by_name`` when the model class cannot read parameters by name (its Qwen2 and
Qwen3 classes, our models: any name): what the scripted engines answer there."""


class _DoneWork:
    """A broadcast that completed at once (no process group: only the HTTP bodies are checked here)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class Step(NamedTuple):
    """A call that reached an engine: ``outcome`` is ``ok``, ``failed`` (answered an injected failure), ``lost`` (ran,
    its answer never came; injected) or ``refused`` (SGLang's own 400: ``NOT_READABLE``); ``sync``: which sync sent it
    (``first`` or ``retry``)."""

    path: str
    body: Any
    outcome: str
    sync: str
    method: str = "POST"


class EngineScript:
    """Plays the engines of a weight sync: records each call that reaches an engine (``steps``: per engine, in order)
    and answers it at once: success, the engine's current version for ``/model_info``, or the armed ``fault`` (once:
    on the first engine, see ``Fault``)."""

    def __init__(self, urls: tuple[str, ...], fault: Fault | None):
        self.steps: dict[str, list[Step]] = {u: [] for u in urls}
        self.fault, self.fired = fault, False
        self.sync = "first"
        self.version = dict.fromkeys(urls, "0")
        self._lock = threading.Lock()  # the failure clean-up may post from a thread per engine

    def _hits(self, url: str, path: str, body: Any) -> bool:
        f = self.fault
        if f is None or self.fired or url != next(iter(self.steps)) or path != f.path:
            return False
        return not f.last or (isinstance(body, dict) and body.get("weight_version") is not None)

    def reach(self, url: str, method: str, path: str, body: Any) -> tuple[str, Any]:
        """The engine ``url`` runs ``method path body``: (outcome, its answer)."""
        with self._lock:
            outcome = "ok"
            if self._hits(url, path, body):
                self.fired = True
                outcome = "lost" if self.fault.lost else "failed"
            if outcome == "ok" and isinstance(body, dict):
                if path == "/update_weights_from_distributed" and body.get("weight_version") is not None:
                    self.version[url] = str(body["weight_version"])
                elif path == "/update_weight_version":
                    self.version[url] = str(body["new_version"])
            if outcome == "ok" and path == "/get_weights_by_name":
                outcome = "refused"
            self.steps[url].append(Step(path, body, outcome, self.sync, method))
            if path == "/model_info":
                return outcome, {"weight_version": self.version[url] if outcome == "ok" else "stale"}
            if outcome == "refused":
                return outcome, {"error": {"message": NOT_READABLE}}
            return outcome, {"success": outcome == "ok", "message": "" if outcome == "ok" else INJECTED}

    def call(self, url: str, c) -> tuple[str, Any, Exception | None]:
        """An ``Exchange`` call reaching ``url``: (outcome, answer, the error our side raises or None)."""
        from asyncrl.engine.blocking import EngineStepError

        outcome, ans = self.reach(url, c.method, c.path, c.body)
        if outcome == "lost":
            return outcome, ans, EngineStepError(url, c.step, f"{c.method} {c.path} timed out ({INJECTED})")
        if outcome == "refused":
            return outcome, ans, _http_400(url, c.step, c.method, c.path, ans)
        if c.check_success and isinstance(ans, dict) and ans.get("success") is False:
            return outcome, ans, EngineStepError(url, c.step, f"{c.path} answered success=false: {INJECTED}")
        return outcome, ans, None


def _http_400(url: str, step: str, method: str, path: str, answer: Any) -> Exception:
    """The error our transport raises on a 400 (``blocking._Req.read``)."""
    from asyncrl.engine.blocking import EngineStepError

    err = EngineStepError(url, step, f"HTTP 400 from {method} {path}: {json.dumps(answer)}")
    err.status = 400
    return err


def _exchange_playing(script: EngineScript, base: type) -> type:
    class ScriptedExchange(base):
        """Each chain's first call and the calls pipelined behind it reach the engine at once (they were written
        together); a call behind a lost answer never runs; a later call goes out only after a success. The first
        failure raises once every written call ran, as the real exchange raises with the other engines' calls on
        the wire."""

        def start(self):
            return self

        def wait(self, **kw):
            first_error = None
            for i, (url, calls) in enumerate(self.chains):
                broken = lost = False
                for k, c in enumerate(calls):
                    if (k and not c.pipelined and (broken or first_error)) or (lost and c.pipelined):
                        break
                    outcome, ans, err = script.call(url, c)
                    lost, broken = outcome == "lost", broken or err is not None
                    if err is None and not broken:
                        self.answers[i].append(ans)
                    first_error = first_error or err
            if first_error is not None:
                raise first_error
            return self.answers

    return ScriptedExchange


@contextlib.contextmanager
def _patched(*targets: tuple[Any, str, Any]):
    """Each ``(object, attribute, value)`` set inside the block, restored after."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, value in targets:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


@contextlib.contextmanager
def engines_played_by(script: EngineScript):
    """The weight sync's transports answered by ``script``: its ``Exchange``, any single call (``post_json``,
    ``get_json``, ``get_text``: ``blocking._request``), the broadcasts (completed at once) and the drain's load
    (idle)."""
    from asyncrl.engine import blocking
    from asyncrl.sync import weight_sync

    def request(url, path, *, method, body, timeout_s, step):
        outcome, ans = script.reach(url, method, path, body)
        if outcome == "lost":
            raise blocking.EngineStepError(url, step, f"{method} {path} timed out ({INJECTED})")
        if outcome in ("failed", "refused"):
            raise _http_400(url, step, method, path, ans)
        return json.dumps(ans).encode()

    with _patched(
        (weight_sync, "Exchange", _exchange_playing(script, weight_sync.Exchange)),
        (blocking, "_request", request),
        (weight_sync, "broadcast_from_rank0", lambda t, pg: _DoneWork()),
        (weight_sync, "engine_load", lambda url, *, timeout_s: 0.0),
    ):
        yield


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
    from asyncrl.agent.envs.searchr1 import SearchR1Env
    from asyncrl.agent.loop import AgentLoop
    from asyncrl.config.schema import SamplingConfig

    me = types.SimpleNamespace(sampling=SamplingConfig(temperature=1.0, top_p=0.9, top_k=20), env=SearchR1Env())
    return AgentLoop.sampling_params(me, 500, greedy=greedy)


def _sync_bodies() -> list[tuple[str, Any]]:
    """Every body the weight sync sends, recorded where it leaves our code (``engines_played_by``: each ``Exchange``
    call -- pause, the pipelined begin, every bucket's update with the pipelined end behind the last one, the version
    bump, flush, end, continue -- and each single call, such as the group's leave, answered at once); the join's body
    comes from its builder. The real ``WeightSyncer.sync`` runs for every pause mode, per-tensor and flattened, and a
    pipeline stage's push (no version on its last bucket) with the coordinator's ``finish``."""
    from asyncrl.config.schema import PAUSE_MODES, SyncConfig
    from asyncrl.sync import weight_sync
    from asyncrl.sync.bucketing import iter_buckets
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup

    url = "http://e0:30000"
    script = EngineScript((url,), None)
    with engines_played_by(script):
        for flat in (False, True):
            cfg = SyncConfig(flattened_bucket=flat, bucket_bytes=16)  # 16 bytes: one tensor a bucket, two buckets
            group = WeightSyncGroup([EngineEndpoint(url)], cfg)
            group.pg = object()  # the broadcasts are _DoneWork; only the bodies leave
            for mode in PAUSE_MODES:
                syncer = weight_sync.WeightSyncer(group, pause_mode=mode, sync_cfg=cfg)
                syncer.sync(iter_buckets(_sync_state().items(), cfg.bucket_bytes), 7)
                syncer.push(iter_buckets(_sync_state().items(), cfg.bucket_bytes))  # a pipeline stage's: no version
                syncer.finish(7)  # ... so the coordinator bumps the version and ends the update
        WeightSyncGroup([EngineEndpoint(url)], SyncConfig(backend="nccl")).destroy()  # the leave
    calls = [(s.path, s.body) for s in script.steps[url] if s.method == "POST"] + _join_bodies()
    return [(f"weight sync {p}", (p, b)) for p, b in calls]


def _sync_state() -> dict:
    """Two small tensors of two dtypes: with 16-byte buckets, two buckets."""
    import torch

    return {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16), "model.norm.weight": torch.zeros(2)}


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


# ------------------------------------------------------------------------------------- weight-update sessions
SESSION_PATHS = ("/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update")
"""The calls SGLang's ``SchedulerWeightUpdaterManager`` keeps its session rules on (begin refuses while a session is
open, end refuses without one, an update refuses outside one)."""
SESSION_ENGINES = ("http://e0:30000", "http://e1:30000")
"""Two engines: the fault hits the first; the second answers everything (what a failure on one engine leaves on the
others is checked too)."""


class Fault(NamedTuple):
    """A failure injected into a sync, on the first engine's first call to ``path`` (``last``: its update carrying the
    version, the one ``/end_weight_update`` is pipelined behind). The engine ran the call. ``lost``: its answer never
    came (a timeout): our side closes the connection, so calls pipelined behind it never run (uvicorn, SGLang's
    server, starts a queued pipelined request only once the previous answer is written to a connection still open);
    else it answered ``{"success": false}`` (a 400), and calls pipelined behind it run."""

    name: str
    path: str
    lost: bool = False
    last: bool = False


FAULTS = (
    Fault("the pause answers a failure (the begin pipelined behind it runs)", "/pause_generation"),
    Fault("the pause times out (the begin pipelined behind it never runs)", "/pause_generation", lost=True),
    Fault("the begin times out (it ran)", "/begin_weight_update", lost=True),
    Fault("the first bucket's update fails", "/update_weights_from_distributed"),
    Fault("the last bucket's update fails (the end behind it runs)", "/update_weights_from_distributed", last=True),
    Fault(
        "the last bucket's update times out (the end behind it never runs)",
        "/update_weights_from_distributed",
        lost=True,
        last=True,
    ),
    Fault("the version check reads a stale version", "/model_info"),
    Fault("the continue answers a failure", "/continue_generation"),
)


def _one_sync(mode: str) -> str | None:
    """One ``WeightSyncer.sync`` to version 7 (two buckets) on a fresh syncer, as a retry after a restart makes it:
    its error, or None."""
    from asyncrl.config.schema import SyncConfig
    from asyncrl.engine.blocking import EngineStepError
    from asyncrl.sync import weight_sync
    from asyncrl.sync.bucketing import iter_buckets
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup

    cfg = SyncConfig(bucket_bytes=16, step_timeout_s=5.0)  # 16 bytes: one tensor a bucket, two buckets
    group = WeightSyncGroup([EngineEndpoint(u) for u in SESSION_ENGINES], cfg)
    group.pg = object()  # the broadcasts are _DoneWork
    try:
        weight_sync.WeightSyncer(group, pause_mode=mode, sync_cfg=cfg).sync(iter_buckets(_sync_state().items(), 16), 7)
    except EngineStepError as e:
        return str(e)
    return None


def session_scenarios() -> list[dict]:
    """For ``retract`` (``in_place`` and ``abort`` send the same calls) and ``drain``: a sync with each ``FAULTS``
    failure (or none) then a retry sync, on the same two engines; each engine's calls recorded. ``problems``: the
    harness's own (a fault that did not fire or did not fail the sync, a retry that failed)."""
    out = []
    for mode in ("retract", "drain"):
        for fault in (None, *FAULTS):
            if mode == "drain" and fault is not None and fault.path == "/pause_generation" and fault.lost:
                continue  # under drain nothing is pipelined behind the pause: the same as the answered failure
            script = EngineScript(SESSION_ENGINES, fault)
            with engines_played_by(script):
                first = _one_sync(mode)
                script.sync = "retry"
                retry = _one_sync(mode)
            problems = []
            if fault is not None and not (script.fired and first):
                problems.append(f"the fault did not fail the first sync (fired: {script.fired}; error: {first})")
            if fault is None and first:
                problems.append(f"the first sync failed: {first}")
            if retry:
                problems.append(f"the retry sync failed: {retry}")
            name = f"{mode}: {fault.name if fault else 'no failure'}, then a retry"
            out.append({"case": name, "first_error": first, "engines": script.steps, "problems": problems})
    return out


def window_verdicts(steps: list[Step]) -> list[tuple[str, str]]:
    """Each session call replayed through the CPU engine's ``UpdateWindow``: (``accepted`` or ``refused``, message)."""
    from asyncrl.cpu_engine.weight_updates import UpdateWindow

    w, out = UpdateWindow(), []
    for s in steps:
        if s.path == "/begin_weight_update":
            ok, msg, _ = w.begin(s.body)
        elif s.path == "/end_weight_update":
            ok, msg, _ = w.end(s.body)
        else:
            refused = w.refusal("update_weights_from_distributed", s.body)
            ok, msg = (True, "") if refused is None else refused[:2]
        out.append(("accepted" if ok else "refused", msg))
    return out


def refusals(url: str, steps: list[Step], verdicts: list[tuple[str, str]]) -> list[str]:
    """A begin or an update refused among an engine's session calls (an end refused is fine: the clean-up after a
    failed sync posts one to every engine, whether its session is open or not)."""
    return [
        f"{url}: the {s.sync} sync's {s.path} (session call {i + 1}) is refused: {msg}"
        for i, (s, (v, msg)) in enumerate(zip(steps, verdicts))
        if v == "refused" and s.path != "/end_weight_update"
    ]


def session_steps(steps: list[Step]) -> list[Step]:
    return [s for s in steps if s.path in SESSION_PATHS]


def window_problems(scenario: dict) -> list[str]:
    """``refusals`` of each engine's session calls replayed through the CPU engine's ``UpdateWindow``."""
    out = []
    for url, steps in scenario["engines"].items():
        steps = session_steps(steps)
        out += refusals(url, steps, window_verdicts(steps))
    return out


class _TargetUpdater:
    """Stand-in for the target model runner's ``weight_updater``: records the calls; a receive fails when the engine
    answered it with a failure in the recording."""

    def __init__(self):
        self.calls: list[str] = []
        self.fail_receive = False

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def end_weight_update(self, *, run_post_load: bool) -> None:
        self.calls.append(f"end(run_post_load={run_post_load})")

    def receive_weights_from_distributed(self, *, names, dtypes, shapes, group_name, load_format):
        self.calls.append("receive")
        if self.fail_receive:
            raise RuntimeError(INJECTED)
        return list(zip(names, shapes))

    def load_weights_from_distributed(self, weights) -> tuple[bool, str]:
        self.calls.append("load")
        return True, "Succeeded to update parameter online."


@contextlib.contextmanager
def _one_rank_tp_group():
    """A one-rank gloo group for the manager's barriers (its ``tp_cpu_group``)."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "the session replay needs a process without a default group"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def sglang_verdicts(steps: list[Step], cpu_group) -> list[tuple[str, str]]:
    """Each session call replayed through a real ``SchedulerWeightUpdaterManager`` (its stand-ins: a TP worker with
    one target runner whose ``weight_updater`` is a ``_TargetUpdater``, a scheduler recording the version, a flush
    that succeeds), each body parsed into its request class as SGLang's server does (pydantic):
    (``accepted`` or ``refused``, SGLang's message). An update whose receive failed is accepted (the session let
    it in)."""
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.runtime_context import get_parallel

    target = _TargetUpdater()
    runner = types.SimpleNamespace(weight_updater=target)
    tp_worker = types.SimpleNamespace(weight_update_runners=lambda: [("target", runner)], model_runner=runner)
    scheduler = types.SimpleNamespace(record_weight_version_change=lambda new_version: None)
    with get_parallel().override(tp_group=types.SimpleNamespace(cpu_group=cpu_group)):
        manager = SchedulerWeightUpdaterManager(
            tp_worker=tp_worker,
            draft_worker=None,
            memory_saver_adapter=None,
            flush_cache=lambda **kw: True,
            is_fully_idle=lambda **kw: True,
            scheduler=scheduler,
        )
    out = []
    for s in steps:
        cls = getattr(io_struct, ENDPOINT_CLASSES[s.path])
        req = TypeAdapter(cls).validate_python(s.body)
        target.fail_receive = s.outcome == "failed"
        answer = getattr(manager, s.path.lstrip("/"))(req)
        accepted = answer.success or INJECTED in answer.message
        out.append(("accepted" if accepted else "refused", answer.message))
    return out


def check_sessions() -> list[dict]:
    """Every scenario of ``session_scenarios``: each engine's begin/update/end calls replayed through SGLang's session
    rules (``sglang_verdicts``); a begin or an update SGLang refuses is a mismatch, and so is any call where SGLang
    and the CPU engine's ``UpdateWindow`` disagree."""
    out = []
    with _one_rank_tp_group() as cpu_group:
        for sc in session_scenarios():
            problems = list(sc["problems"])
            for url, steps in sc["engines"].items():
                steps = session_steps(steps)
                theirs, ours = sglang_verdicts(steps, cpu_group), window_verdicts(steps)
                problems += refusals(url, steps, theirs)
                problems += [
                    f"{url}: the {s.sync} sync's {s.path} (session call {i + 1}): SGLang {v} it ({msg}), "
                    f"the CPU engine's UpdateWindow {w} it"
                    for i, (s, (v, msg), (w, _)) in enumerate(zip(steps, theirs, ours))
                    if v != w
                ]
            calls = {u: [f"{s.sync} {s.path} {s.outcome}" for s in steps] for u, steps in sc["engines"].items()}
            out.append({"case": f"weight sync sessions, {sc['case']}", "calls": calls, "problems": problems})
    return out


# ------------------------------------------------------------------------------------- weight names
LOADER_CASES = (
    ("qwen3_moe (8 experts, top-2, every layer sparse)", "qwen3_moe", {}),
    (
        "qwen3_moe with a dense layer (mlp_only_layers=[1])",
        "qwen3_moe",
        {"num_hidden_layers": 2, "mlp_only_layers": [1]},
    ),
    ("qwen3", "qwen3", {"num_hidden_layers": 2}),
    ("qwen2", "qwen2", {"num_hidden_layers": 2}),
    ("llama", "llama", {"num_hidden_layers": 2}),
)
"""(case, tiny ``arch``, config overrides) of each model whose weight names go through SGLang's loader."""


def expected_loss(spec, hf_names: list[str], sglang_params: list[str]) -> tuple[set[str], set[str]]:
    """What SGLang 0.5.23's loader is known to leave out of a model: (our names it drops, its parameters left
    unwritten). For a Qwen3-MoE with dense layers (``mlp_only_layers``, ``decoder_sparse_step``), it builds every
    layer sparse (``models/qwen3_moe.py:Qwen3MoeDecoderLayer.stage_facts``): the dense layers' ``mlp.*_proj`` are
    dropped without a word and their router and experts keep whatever they were allocated with. Otherwise nothing."""
    if not spec.is_moe:
        return set(), set()
    dense = tuple(f"model.layers.{i}.mlp." for i in range(spec.num_layers) if not spec.is_moe_layer(i))
    return {n for n in hf_names if n.startswith(dense)}, {n for n in sglang_params if n.startswith(dense)}


def sglang_loads(model_dirs: list[str]) -> list[dict]:
    """Each checkpoint's tensors through SGLang's own model class and its ``load_weights`` (run in a process of
    its own: ``loader_reports``). The class is SGLang's choice for the checkpoint's ``architectures``
    (``ModelRegistry``), built on CPU in a one-rank gloo world; each parameter is filled with NaN, the tensors are
    loaded one at a time, and each one's count of newly written elements is recorded: a name SGLang drops writes
    none, a name it maps over another's writes fewer than it holds, and a parameter no name reaches keeps NaNs.
    Returns per directory ``{"model_class", "written": {name: [written, numel]}, "unwritten": {param: count}}``
    (every parameter of SGLang's model, with its count of elements no name wrote)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from sglang.srt import runtime_context
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.rotary_embedding import base as rotary_base
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import prepare_server_args
    from transformers import AutoConfig

    logging.getLogger("sglang").setLevel(logging.ERROR)  # the registry's notes on model modules it cannot import
    # SGLang's rotary embedding picks vllm's kernel unless it sees a CPU build (sgl_kernel's); its CPU path is
    # plain torch, and the choice does not touch the parameters
    rotary_base._is_cpu = True
    runtime_context.publish(
        prepare_server_args(["--model-path", model_dirs[0], "--device", "cpu"]),
        role="scheduler",
        ranks=runtime_context.SpawnRanks(world_rank=0),
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel()
    out = []
    for d in model_dirs:
        cfg = AutoConfig.from_pretrained(d)
        cls, _ = ModelRegistry.resolve_model_cls(cfg.architectures)
        model = cls(cfg)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for prm in params.values():
                prm.fill_(float("nan"))
        left = {n: int(prm.isnan().sum()) for n, prm in params.items()}
        written = {}
        for name, t in sorted(load_file(str(Path(d) / "model.safetensors")).items()):
            model.load_weights([(name, t)])
            now = {n: int(prm.isnan().sum()) for n, prm in params.items()}
            written[name] = [sum(left[n] - now[n] for n in params), t.numel()]
            left = now
        out.append({"model_class": cls.__name__, "written": written, "unwritten": left})
    return out


def loader_reports(model_dirs: list[Path]) -> list[dict]:
    """``sglang_loads`` in a child process (``--sglang-loads``): SGLang's published server arguments and parallel
    groups are process-wide, and the session replay needs a process without a default group."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "loads.json"
        argv = [sys.executable, "-W", "ignore", str(Path(__file__).resolve()), "--sglang-loads", str(report)]
        done = subprocess.run([*argv, *map(str, model_dirs)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the SGLang loader run failed ({done.returncode}): {done.stderr[-3000:]}")
        return json.loads(report.read_text())


def loader_problems(spec, load: dict) -> list[str]:
    """What SGLang's loader did with a checkpoint beyond ``expected_loss``: a name that wrote none of its elements
    (dropped) or only part of them, a parameter left partly unwritten; and a loss ``expected_loss`` names that did
    not happen (SGLang changed: the expectation and ``docs/sglang_differences.md`` must follow)."""
    written, unwritten = load["written"], {p: c for p, c in load["unwritten"].items() if c}
    dropped_ok, unwritten_ok = expected_loss(spec, list(written), list(load["unwritten"]))
    problems = []
    for name, (n, numel) in written.items():
        if name in dropped_ok:
            if n:
                problems.append(f"{name}: expected dropped (a dense layer of a Qwen3-MoE), SGLang wrote {n} elements")
        elif n == 0:
            problems.append(f"{name}: dropped by {load['model_class']}.load_weights (no parameter written)")
        elif n != numel:
            problems.append(f"{name}: {n} of its {numel} elements written (overlaps another name's)")
    for param, count in unwritten.items():
        if param not in unwritten_ok:
            problems.append(f"SGLang's {param}: {count} elements no name of ours wrote")
    missing = unwritten_ok - set(unwritten)
    if missing:
        problems.append(f"expected unwritten (a dense layer of a Qwen3-MoE), SGLang wrote them: {sorted(missing)}")
    return problems


def check_loader_names() -> list[dict]:
    """Every name of each ``LOADER_CASES`` tiny checkpoint (the names our weight sync sends: the actor's HF export
    has the checkpoint's names) goes through SGLang's loader for that model (``sglang_loads``): each must land whole
    in SGLang's parameters, and together cover them all, up to ``expected_loss``."""
    import tempfile

    from asyncrl.models.spec import ModelSpec
    from asyncrl.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [
            make_tiny_checkpoint(Path(tmp) / f"case{i}", arch=arch, seed=0, **overrides)
            for i, (_, arch, overrides) in enumerate(LOADER_CASES)
        ]
        loads = loader_reports(dirs)
        out = []
        for (name, _, _), d, load in zip(LOADER_CASES, dirs, loads):
            spec = ModelSpec.from_pretrained(d)
            dropped, unwritten = expected_loss(spec, list(load["written"]), list(load["unwritten"]))
            out.append(
                {
                    "case": f"weight names, {name} -> {load['model_class']}.load_weights",
                    "names": len(load["written"]),
                    "known_loss": {"dropped": sorted(dropped), "unwritten": sorted(unwritten)},
                    "problems": loader_problems(spec, load),
                }
            )
        return out


# ------------------------------------------------------------------------------------- routed experts
def check_routed_experts() -> list[dict]:
    """The CPU engine's routed-experts flag, request fields and answer against SGLang's (see the module contract)."""
    import numpy as np
    import torch
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    from asyncrl.cpu_engine.args import parse_args
    from asyncrl.cpu_engine.request import encode_routed_experts

    flag = "--enable-return-routed-experts"
    problems = []
    for argv in ([], [flag]):
        theirs = prepare_server_args(["--model-path", "/m", *argv]).enable_return_routed_experts
        ours = parse_args(["--model-path", "/m", "--port", "1", *argv]).enable_return_routed_experts
        if theirs != ours or theirs != bool(argv):
            problems.append(f"argv {argv}: SGLang reads enable_return_routed_experts={theirs}, the CPU engine {ours}")
    body = {"input_ids": [1, 2, 3], "return_routed_experts": True, "routed_experts_start_len": 1}
    problems += [f"/generate {body}: {p}" for p in check_body("/generate", body)]
    routed = torch.arange(2 * 3 * 4, dtype=torch.int32).reshape(2, 3, 4) - 5  # [positions, layers, top-k]
    back = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encode_routed_experts(routed)}})
    if back.dtype != np.int32 or back.tolist() != routed.reshape(-1).tolist():
        problems.append(f"SGLang reads the CPU engine's routed_experts as {back.dtype} {back.tolist()}")
    return [{"case": "routed experts: flag, request fields, meta_info encoding", "problems": problems}]


# ------------------------------------------------------------------------------------- delta sync
def check_delta_sync() -> list[dict]:
    """The delta sync's engine surface against SGLang's: the flags (``--custom-weight-loader``, ``--dtype``) read
    alike, the body is an ``UpdateWeightsFromTensorReqInput``, SGLang's own deserializer (its ``SafeUnpickler``)
    reads the payload back (then unpacked as the loader unpacks it) bit for bit, and its ``dynamic_import`` finds the
    loader."""
    import torch
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import MultiprocessingSerializer, dynamic_import

    from asyncrl.cluster.tensor_payload import unpack_named_tensors
    from asyncrl.config.schema import DELTA_LOADER
    from asyncrl.cpu_engine.args import parse_args
    from asyncrl.sync import delta as codec
    from asyncrl.sync.delta_loader import load_delta
    from asyncrl.sync.delta_sync import update_body

    problems = []
    argv = ["--custom-weight-loader", DELTA_LOADER, "--dtype", "bfloat16"]
    theirs = prepare_server_args(["--model-path", "/m", *argv])
    ours = parse_args(["--model-path", "/m", "--port", "1", *argv])
    if list(theirs.custom_weight_loader) != list(ours.custom_weight_loader) or theirs.dtype != ours.dtype:
        problems.append(
            f"argv {argv}: SGLang reads {theirs.custom_weight_loader} {theirs.dtype}, the CPU engine "
            f"{list(ours.custom_weight_loader)} {ours.dtype}"
        )
    old = torch.randn(64, 8).to(torch.bfloat16)
    new = old.clone()
    new[3, 1:5] += 1
    named = [("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))]
    named += list(codec.to_tensors(codec.encode(old, new, max_density=0.5), "lm_head.weight").items())
    body = update_body(named, report="/tmp/report", tp_size=2, flush_cache=True)
    problems += [f"/update_weights_from_tensor: {p}" for p in check_body("/update_weights_from_tensor", body)]
    back = unpack_named_tensors(MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][1]))
    sent = dict(named)
    for n, t in back:
        if n in sent and not (t.dtype == sent[n].dtype and torch.equal(t.view(torch.uint8), sent[n].view(torch.uint8))):
            problems.append(f"SGLang's deserializer reads {n!r} as another tensor")
    if sorted(n for n, _ in back if n in sent) != sorted(sent):
        problems.append(f"SGLang's deserializer reads names {[n for n, _ in back]}, sent {sorted(sent)}")
    if dynamic_import(body["load_format"]) is not load_delta:
        problems.append(f"SGLang's dynamic_import({body['load_format']!r}) is not asyncrl.sync.delta_loader.load_delta")
    return [
        {
            "case": "delta sync: loader flag, dtype flag, update_weights_from_tensor body and payload",
            "problems": problems,
        }
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the whole report (every case, argv and body) there")
    ap.add_argument(
        "--sglang-loads", nargs="+", metavar=("REPORT", "MODEL_DIR"), help="(the weight-name check's child process)"
    )
    args = ap.parse_args(argv)
    if args.sglang_loads:
        report, *dirs = args.sglang_loads
        Path(report).write_text(json.dumps(sglang_loads(dirs)))
        return 0
    import sglang

    # expected on every run, not findings: the syncs' logs, the clean-up after each injected failure, and SGLang's
    # error log of each injected failed receive
    logging.getLogger("asyncrl").setLevel(logging.ERROR)
    logging.getLogger("sglang.srt.managers.scheduler_components.weight_updater").setLevel(logging.CRITICAL)

    sys.path.insert(0, str(ROOT))
    report = {
        "sglang": sglang.__version__,
        "launch_module": importlib.util.find_spec("sglang.launch_server") is not None,
        "commands": check_commands(),
        "bodies": check_bodies(),
    }
    report["sessions"] = check_sessions()
    report["weight_names"] = check_loader_names()
    report["routed_experts"] = check_routed_experts()
    report["delta_sync"] = check_delta_sync()
    cases = (
        report["commands"]
        + report["bodies"]
        + report["sessions"]
        + report["weight_names"]
        + report["routed_experts"]
        + report["delta_sync"]
    )
    if not report["launch_module"]:
        cases.append({"case": "sglang.launch_server", "problems": ["the module is not in this sglang"]})
    report["num_checked"] = len(cases)
    report["num_problems"] = sum(len(c["problems"]) for c in cases)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    for c in cases:
        for p in c["problems"]:
            print(f"MISMATCH {c['case']}: {p}")
    print(
        f"check_sglang: {report['num_checked']} checks, {report['num_problems']} mismatches (sglang {sglang.__version__})"
    )
    return 1 if report["num_problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
