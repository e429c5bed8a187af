"""The benchmark harness (benchmarks/harness.py): sides interleaved in alternating order, ratios paired per
repetition with their target, the JSON printed last, baselines keeping a few runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "harness.py"


@pytest.fixture()
def harness(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_harness", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "BASELINES", tmp_path)
    monkeypatch.setattr(mod, "CALIBRATION_S", 0.01)
    return mod


def test_interleave_alternates_the_order_after_the_warmup(harness):
    calls = []
    sides = {"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}
    out = harness.interleave(sides, reps=4, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [1.0] * 4, "b": [2.0] * 4}


def test_ratio_is_paired_per_repetition_with_its_target(harness, capsys):
    rep = harness.Report("demo", ["--quick"])
    r = rep.ratio("speed_ratio", [2.0, 4.0, 9.0], [1.0, 2.0, 3.0], target=2.5)
    assert r["values"] == [2.0, 2.0, 3.0] and r["median"] == 2.0 and r["met"] is False
    assert r["target"] == 2.5 and r["target_op"] == ">="
    low = rep.ratio("latency_ratio", [1.0], [1.0], target=1.5, at_least=False)
    assert low["met"] is True
    with pytest.raises(ValueError, match="_ratio"):
        rep.ratio("speed", [1.0], [1.0], target=1.0)
    with pytest.raises(ValueError, match="pair up"):
        rep.ratio("x_ratio", [1.0, 2.0], [1.0], target=1.0)


def test_emit_prints_json_last_and_keeps_the_last_runs(harness, capsys, tmp_path):
    for i in range(harness.KEEP_RUNS + 2):
        rep = harness.Report("demo", ["--quick"])
        rep.ratio("speed_ratio", [2.0], [1.0], target=1.0)
        rep.emit({"i": i}, save=True)
        last = capsys.readouterr().out.strip().splitlines()[-1]
        doc = json.loads(last)
        assert doc["speed_ratio"]["median"] == 2.0 and doc["i"] == i and doc["targets_missed"] == []
        assert {"command", "date", "load_start", "load_end", "speed_start", "speed_end"} <= set(doc)
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert [r["i"] for r in saved["runs"]] == list(range(2, harness.KEEP_RUNS + 2))
    assert saved["latest"]["i"] == harness.KEEP_RUNS + 1


def test_speed_measures_both_probes_and_leaves_the_thread_count(harness):
    import torch

    threads = torch.get_num_threads()
    s = harness.speed()
    assert set(s) == {"matmul_gflops_1t", "python_mops"}
    assert s["matmul_gflops_1t"] > 0.1 and s["python_mops"] > 0.1  # any CPU of this century does more
    assert torch.get_num_threads() == threads
