"""What we send to SGLang passes SGLang's own argument parser and request classes (tools/check_sglang.py).

The checks against SGLang run where sglang imports (installed without its dependencies: CI's
tools/check_sglang_ci.sh runs this file so) and are skipped otherwise; the tool's recorders, which drive our own client and weight sync to collect the bodies,
run everywhere, so a change to that code that the tool no longer follows fails here (it once broke unnoticed: the
client lost ``abort_request`` and the tool still called it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_sglang.py"


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_sglang = pytest.mark.skipif(
    not (_has("sglang.srt.server_args") and _has("sglang.srt.managers.io_struct")), reason="sglang is not installed"
)

# every SGLang endpoint our code posts to (the tool must record each: a new one needs its request class there)
SENT = {
    "/generate",
    "/update_weights_from_disk",
    "/pause_generation",
    "/begin_weight_update",
    "/update_weights_from_distributed",
    "/end_weight_update",
    "/update_weight_version",
    "/flush_cache",
    "/continue_generation",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
}


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("check_sglang", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_recorders_collect_every_body_our_current_code_sends(tool):
    calls = tool._client_bodies() + tool._sync_bodies()
    endpoints = {endpoint for _, (endpoint, _) in calls}
    assert SENT <= endpoints  # a new one is fine once the tool knows its class (below)
    assert endpoints <= set(tool.ENDPOINT_CLASSES) | tool.NO_BODY  # each has the SGLang class it is checked against
    bodies = {endpoint: body for _, (endpoint, body) in calls}
    assert bodies["/end_weight_update"] == {}  # the pipelined end behind the last update, recorded from send_bucket
    versions = [b.get("weight_version") for _, (e, b) in calls if e == "/update_weights_from_distributed"]
    assert "7" in versions and None in versions  # the version rides on the last bucket only


def test_the_launcher_passes_the_run_secret_as_one_token(tool):
    """``--api-key=K`` as one argv token (SGLang's argparse takes a separate token that starts with '-' for a flag),
    only when a secret is set, and never in the logged command."""
    from asyncrl.cluster.auth import redacted

    cases = tool.command_argvs()
    with_key = [(argv, want["api_key"]) for _, argv, want in cases if want["api_key"] is not None]
    assert len(with_key) == 2 * len(tool.run_secrets()) and all(key.startswith("-") for _, key in with_key)
    for argv, key in with_key:
        assert [a for a in argv if a.startswith("--api-key")] == [f"--api-key={key}"]
        assert not any(key in a for a in redacted(argv))
    assert not any(a.startswith("--api-key") for _, argv, want in cases if want["api_key"] is None for a in argv)


def test_each_injected_failure_fails_the_first_sync_and_the_retry_runs(tool):
    scenarios = tool.session_scenarios()
    # retract and drain, each without a failure and with each fault; drain pipelines nothing behind its pause
    assert len(scenarios) == 2 * (1 + len(tool.FAULTS)) - 1
    assert [sc["problems"] for sc in scenarios] == [[]] * len(scenarios)
    for sc in scenarios:
        for steps in sc["engines"].values():
            retry = [s.path for s in steps if s.sync == "retry"]
            assert retry[:2] == ["/pause_generation", "/begin_weight_update"] and "/continue_generation" in retry
    by_name = {sc["case"]: sc for sc in scenarios}
    timed_out = by_name["retract: the pause times out (the begin pipelined behind it never runs), then a retry"]
    first = {u: [s.path for s in steps if s.sync == "first"] for u, steps in timed_out["engines"].items()}
    assert "/begin_weight_update" not in first["http://e0:30000"]  # behind a lost answer: never reaches the engine
    assert "/begin_weight_update" in first["http://e1:30000"]  # the other engine's pause answered: its begin ran


def test_the_cpu_engine_accepts_every_begin_and_update_a_sync_sends_after_a_failure(tool):
    """Each engine's begin/update/end calls, over a failed sync and its retry, replayed through the CPU engine's
    ``UpdateWindow`` (SGLang's session rules: a second begin is refused): the failed sync must close the sessions it
    opened, or the retry's begin is refused."""
    problems = [f"{sc['case']}: {p}" for sc in tool.session_scenarios() for p in tool.window_problems(sc)]
    assert problems == []


def test_the_session_replay_catches_a_second_begin_and_an_update_outside(tool):
    steps = [tool.Step(p, b, "ok", "first") for p, b in _UNPAIRED]
    verdicts = [v for v, _ in tool.window_verdicts(steps)]
    assert verdicts == ["refused", "accepted", "refused", "accepted", "refused", "refused"]
    assert len(tool.refusals("http://e0:30000", steps, tool.window_verdicts(steps))) == 3  # ends refused are fine


_UPDATE = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "weight_update_group"}
_UNPAIRED = [  # an update before the begin, a second begin, two ends
    ("/update_weights_from_distributed", _UPDATE),
    ("/begin_weight_update", {"selector": "all"}),
    ("/begin_weight_update", {"selector": "all"}),
    ("/end_weight_update", {}),
    ("/end_weight_update", {}),
    ("/update_weights_from_distributed", _UPDATE),
]


@needs_sglang
def test_our_command_lines_parse_as_we_mean_them(tool):
    results = tool.check_commands()
    assert len(results) == 4 + 2 * len(tool.run_secrets())  # rollout, with routing replay, TP 2, eval fleet; secrets
    assert [r for r in results if r["problems"]] == []


@needs_sglang
def test_our_request_bodies_fit_sglangs_request_classes(tool):
    results = tool.check_bodies()
    assert {r["case"].split()[-1] for r in results} >= SENT
    assert [r for r in results if r["problems"]] == []


@needs_sglang
def test_our_weight_sync_keeps_sglangs_session_rules(tool):
    results = tool.check_sessions()
    assert len(results) == len(tool.session_scenarios())
    assert [r for r in results if r["problems"]] == []


@needs_sglang
def test_the_check_catches_mismatches(tool):
    assert tool.check_body("/pause_generation", {"mode": "drain"})
    assert any("new_version" in p for p in tool.check_body("/update_weight_version", {"version": "1"}))
    assert any(
        "max_tokens" in p
        for p in tool.check_body("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    )


@needs_sglang
def test_sglangs_session_rules_agree_with_the_cpu_engines_window(tool):
    steps = [tool.Step(p, b, "ok", "first") for p, b in _UNPAIRED]
    with tool._one_rank_tp_group() as cpu_group:
        theirs = tool.sglang_verdicts(steps, cpu_group)
    assert theirs == tool.window_verdicts(steps)  # the same verdicts and SGLang's own messages


def test_the_weight_name_check_names_a_dropped_name_a_partial_one_and_an_unwritten_parameter(tool, tmp_path):
    from asyncrl.models.spec import ModelSpec
    from asyncrl.models.tiny import make_tiny_checkpoint

    mixed = ModelSpec.from_pretrained(
        make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    )
    e0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
    dense = "model.layers.1.mlp.up_proj.weight"
    unwritten = {"model.layers.0.mlp.experts.w2_weight": 0, "model.layers.1.mlp.gate.weight": 3}
    clean = {"model_class": "M", "written": {e0: [8, 8], dense: [0, 6]}, "unwritten": unwritten}
    assert tool.loader_problems(mixed, clean) == []  # SGLang's known loss of a dense layer, and nothing else
    assert tool.loader_problems(mixed, {**clean, "written": {e0: [0, 8], dense: [0, 6]}}) == [
        f"{e0}: dropped by M.load_weights (no parameter written)"
    ]
    assert tool.loader_problems(mixed, {**clean, "written": {e0: [5, 8], dense: [0, 6]}}) == [
        f"{e0}: 5 of its 8 elements written (overlaps another name's)"
    ]
    swapped = {"model.layers.0.mlp.experts.w2_weight": 2, "model.layers.1.mlp.gate.weight": 0}
    assert tool.loader_problems(mixed, {**clean, "unwritten": swapped}) == [
        "SGLang's model.layers.0.mlp.experts.w2_weight: 2 elements no name of ours wrote",
        "expected unwritten (a dense layer of a Qwen3-MoE), SGLang wrote them: ['model.layers.1.mlp.gate.weight']",
    ]
    assert tool.loader_problems(mixed, {**clean, "written": {e0: [8, 8], dense: [6, 6]}}) == [
        f"{dense}: expected dropped (a dense layer of a Qwen3-MoE), SGLang wrote 6 elements"
    ]


@needs_sglang
def test_every_weight_name_we_send_lands_whole_in_sglangs_model(tool):
    """SGLang's own model classes, built on CPU, load each tiny checkpoint name by name: the Qwen3-MoE's router and
    per-expert names land in ``mlp.gate`` and the fused ``experts.w13_weight`` / ``w2_weight``; a Qwen3-MoE with a
    dense layer loses exactly that layer's MLP (SGLang 0.5.23 builds every layer sparse)."""
    results = {r["case"].split(" -> ")[0].removeprefix("weight names, "): r for r in tool.check_loader_names()}
    assert [r for r in results.values() if r["problems"]] == []
    moe = results["qwen3_moe (8 experts, top-2, every layer sparse)"]
    assert moe["names"] == 4 * (3 * 8 + 1 + 8) + 3 and moe["known_loss"] == {"dropped": [], "unwritten": []}
    assert results["qwen3_moe with a dense layer (mlp_only_layers=[1])"]["known_loss"] == {
        "dropped": [f"model.layers.1.mlp.{p}_proj.weight" for p in ("down", "gate", "up")],
        "unwritten": [f"model.layers.1.mlp.{p}" for p in ("experts.w13_weight", "experts.w2_weight", "gate.weight")],
    }


@needs_sglang
def test_the_cpu_engines_routed_experts_are_sglangs(tool):
    assert [r["problems"] for r in tool.check_routed_experts()] == [[]]


@needs_sglang
def test_the_delta_sync_speaks_sglangs_update_weights_from_tensor(tool, monkeypatch):
    assert [r["problems"] for r in tool.check_delta_sync()] == [[]]
    # the check can fail: a body with a field SGLang's request class lacks is caught
    from asyncrl.sync import delta_sync

    real = delta_sync.update_body
    monkeypatch.setattr(delta_sync, "update_body", lambda *a, **k: {**real(*a, **k), "bogus": 1})
    assert any("bogus" in p for r in tool.check_delta_sync() for p in r["problems"])
