"""What we send to SGLang passes SGLang's own argument parser and request classes (tools/check_sglang.py).

Runs where sglang imports (installed without its dependencies, see the tool's docstring); skipped otherwise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.server_args")
pytest.importorskip("sglang.srt.managers.io_struct")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_sglang.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("check_sglang", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_our_command_lines_parse_as_we_mean_them(tool):
    results = tool.check_commands()
    assert len(results) == 3
    assert [r["problems"] for r in results] == [[], [], []], results


def test_our_request_bodies_fit_sglangs_request_classes(tool):
    results = tool.check_bodies()
    endpoints = {r["case"].split()[-1] for r in results}
    assert {
        "/generate",
        "/pause_generation",
        "/continue_generation",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/abort_request",
    } <= endpoints
    assert [r for r in results if r["problems"]] == []


def test_the_check_catches_mismatches(tool):
    assert tool.check_body("/pause_generation", {"mode": "drain"})
    assert any("new_version" in p for p in tool.check_body("/update_weight_version", {"version": "1"}))
    assert any(
        "max_tokens" in p
        for p in tool.check_body("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    )
