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


def _cpu_ticks(pid: int) -> int:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])  # utime + stime


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _until(cond, what: str, deadline_s: float = 30.0) -> None:
    import time

    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"still not {what} after {deadline_s} s"
        time.sleep(0.05)


def test_background_load_runs_busy_processes_and_stops_them_by_pid(harness):
    with harness.background_load() as pids:
        assert len(pids) == harness.LOAD_PROCS == 2
        start = {p: _cpu_ticks(p) for p in pids}
        _until(lambda: all(_cpu_ticks(p) > start[p] + 5 for p in pids), "burning CPU")  # 50 ms of CPU each
    assert all(_gone(p) for p in pids)


def test_background_load_ends_with_its_parent(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    script = (
        f"import sys, time\nsys.path.insert(0, {str(HARNESS.parent)!r})\nimport harness\n"
        "cm = harness.background_load()\nprint(' '.join(map(str, cm.__enter__())), flush=True)\ntime.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)  # no finally, no cleanup: the busy processes must notice by themselves
        parent.wait(30)
        _until(lambda: all(_gone(p) for p in pids), "ended after their parent's death")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)


def test_conditions_file_ratios_and_figures_under_idle_and_loaded(harness, capsys):
    assert harness.conditions("both") == ["idle", "loaded"] and harness.conditions("loaded") == ["loaded"]
    with pytest.raises(ValueError, match="--load"):
        harness.conditions("busy")
    rep = harness.Report("demo", [])
    with rep.condition("idle"):
        rep.ratio("speed_ratio", [2.0], [1.0], target=1.5)
        rep.record({"n": 1})
    with rep.condition("loaded"):
        rep.ratio("speed_ratio", [1.0], [1.0], target=1.5)
        rep.record({"n": 2})
    with pytest.raises(RuntimeError, match="outside"):
        rep.record({"n": 3})
    doc = rep.emit({"common": True})
    assert doc["idle"]["speed_ratio"]["median"] == 2.0 and doc["idle"]["n"] == 1
    assert doc["loaded"]["speed_ratio"]["median"] == 1.0 and doc["loaded"]["n"] == 2
    assert doc["idle"]["background"]["busy_processes"] == 0 and doc["loaded"]["background"]["busy_processes"] == 2
    assert {"load_start", "load_end", "speed_start"} <= set(doc["loaded"])
    assert doc["targets_missed"] == [] and doc["targets_missed_loaded"] == ["speed_ratio"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["common"] is True


def test_only_a_benchmark_that_runs_conditions_takes_load(harness):
    import argparse

    with_load, without = argparse.ArgumentParser(), argparse.ArgumentParser()
    harness.add_args(with_load, load=True)
    harness.add_args(without)
    assert with_load.parse_args([]).load == "both" and with_load.parse_args(["--load", "idle"]).load == "idle"
    with pytest.raises(SystemExit):  # not silently ignored where the benchmark has no idle/loaded split
        without.parse_args(["--load", "idle"])


def test_under_condition_records_the_load_for_a_json_of_its_own(harness):
    with harness.under_condition("loaded") as info:
        pids = info["background"]["pids"]
        assert info["background"]["busy_processes"] == 2 and not any(_gone(p) for p in pids)
        assert {"load_start", "speed_start"} <= set(info) and "load_end" not in info
    assert "load_end" in info and all(_gone(p) for p in pids)
    with pytest.raises(ValueError, match="busy"):
        with harness.under_condition("busy"):
            pass


def test_condition_view_reads_a_run_as_before_load(harness):
    run = {"date": "d", "ratio_x": 1, "idle": {"ratio_x": 2, "results": {"a": 1}}, "loaded": {"ratio_x": 3}}
    assert harness.condition_view(run)["ratio_x"] == 2 and harness.condition_view(run)["results"] == {"a": 1}
    assert harness.condition_view(run, "loaded")["ratio_x"] == 3 and harness.condition_view(run)["date"] == "d"
    old = {"date": "d", "results": {"a": 0}}  # a baseline from before --load: as it is
    assert harness.condition_view(old) == old


def test_a_tiny_job_gives_every_process_and_the_cpu_engine_its_threads(harness, tmp_path, monkeypatch):
    """``run_tiny_job(threads=2)``: the job's environment says 2 to the ranks (OMP_NUM_THREADS) and to the CPU engine
    (its ``--num-threads`` default, which the launcher leaves out); 1 (the default) leaves the engine's unset."""
    from asyncrl.cpu_engine.args import NUM_THREADS_ENV, parse_args

    seen = []

    def fake_run(cmd, *, env, **kw):  # the torchrun job itself is the outside edge here: only its environment matters
        seen.append(env)
        raise SystemExit("stop")

    monkeypatch.setattr("subprocess.run", fake_run)
    monkeypatch.setenv(NUM_THREADS_ENV, "7")  # a stale setting of the benchmark's own environment does not leak
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for threads in (2, 1):
        with pytest.raises(SystemExit, match="stop"):
            harness.run_tiny_job(tmp_path, [], timeout_s=1, what="t", threads=threads)
    assert seen[0]["OMP_NUM_THREADS"] == "2" and seen[0][NUM_THREADS_ENV] == "2"
    assert seen[0]["OMP_WAIT_POLICY"] == "PASSIVE"  # harness.OMP_WAIT_POLICY_NOTE
    assert seen[1]["OMP_NUM_THREADS"] == "1" and NUM_THREADS_ENV not in seen[1] and "OMP_WAIT_POLICY" not in seen[1]
    argv = ["--model-path", "m", "--port", "1"]
    assert parse_args(argv).num_threads == 7 and parse_args([*argv, "--num-threads", "3"]).num_threads == 3
    monkeypatch.setenv(NUM_THREADS_ENV, "two")
    with pytest.raises(SystemExit):  # named by argparse's error: ASYNCRL_CPU_ENGINE_NUM_THREADS='two'
        parse_args(argv)
    monkeypatch.delenv(NUM_THREADS_ENV)
    assert parse_args(argv).num_threads is None
