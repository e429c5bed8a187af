"""What we send to SGLang passes SGLang's own argument parser and request classes (tools/check_sglang.py).

The checks against SGLang run where sglang imports (installed without its dependencies, see the tool's docstring)
and are skipped otherwise; the tool's recorders, which drive our own client and weight sync to collect the bodies,
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
    assert endpoints == SENT
    assert endpoints <= set(tool.ENDPOINT_CLASSES) | tool.NO_BODY  # each has the SGLang class it is checked against
    bodies = {endpoint: body for _, (endpoint, body) in calls}
    assert bodies["/end_weight_update"] == {}  # the pipelined end behind the last update, recorded from send_bucket
    versions = [b.get("weight_version") for _, (e, b) in calls if e == "/update_weights_from_distributed"]
    assert "7" in versions and None in versions  # the version rides on the last bucket only


@needs_sglang
def test_our_command_lines_parse_as_we_mean_them(tool):
    results = tool.check_commands()
    assert len(results) == 3
    assert [r["problems"] for r in results] == [[], [], []], results


@needs_sglang
def test_our_request_bodies_fit_sglangs_request_classes(tool):
    results = tool.check_bodies()
    assert {r["case"].split()[-1] for r in results} == SENT
    assert [r for r in results if r["problems"]] == []


@needs_sglang
def test_the_check_catches_mismatches(tool):
    assert tool.check_body("/pause_generation", {"mode": "drain"})
    assert any("new_version" in p for p in tool.check_body("/update_weight_version", {"version": "1"}))
    assert any(
        "max_tokens" in p
        for p in tool.check_body("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    )
