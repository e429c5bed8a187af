"""End to end: the embedded default under torchrun (actor rank + rollout rank + broker + CPU engine).

Asserts on the structured outputs (metrics.jsonl, TensorBoard events, summary.json), not on logs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from proc_helpers import assert_nothing_left, read_metrics, run_job

# Every metric the two seed documents name (RLinf's page and Miles' page), as logged per step.
SEED_METRICS_ASYNC = [
    "rollout/buffer/admission_wait_inflight_limit",
    "rollout/buffer/admission_wait_buffer_full",
    "rollout/data_staleness/mean",
    "rollout/data_staleness/max",
    "rollout/version_span/mean",
    "rollout/queue_steps/mean",
    "rollout/fully_async/queue_size",
    "rollout/fully_async/aborted_groups_filtered",
    "rollout/fully_async/stale_groups_filtered",
    "rollout/fully_async/avg_staleness",
    "rollout/fully_async/max_staleness",
    "rollout/fully_async/buffer_avg_staleness",
    "rollout/fully_async/buffer_max_staleness",
    "time/step",
    "time/training",
    "time/wait_data",
    "time/sync_weights",
    "sglang_num_running_reqs",
    "sglang_cache_hit_rate",
    "prefix_cache_hit_rate",
    "reward/mean",
    "train/loss",
    "data/skipped_long_prompts",
]
# RLinf's sync-mode split and the broker's metrics, in the synchronous run
SEED_METRICS_SYNC = [
    "rollout/buffer/admission_wait_inflight_limit",
    "rollout/buffer/admission_wait_buffer_full",
    "rollout/data_staleness/mean",
    "rollout/data_staleness/max",
    "rollout/version_span/mean",
    "rollout/queue_steps/mean",
    "rollout/fully_async/avg_staleness",
    "rollout/fully_async/max_staleness",
    "time/step",
    "time/rollout",
    "time/training",
    "time/sync_weights",
]
# Miles' eval metrics of a point that ran, in every eval run (the dataset is data.test_path's "test")
SEED_METRICS_EVAL = [
    "eval/step",
    "eval/lag_steps",
    "eval/test/weight_version/mean",
    "eval/test/weight_version/mixed_version_ratio",
]
# Miles' checkpoint-backend metrics and every skip reason of its table, in the external-function run
SEED_METRICS_EVAL_EXTERNAL = SEED_METRICS_EVAL + [
    "eval/export_time_seconds",
    "eval/skipped_busy",
    "eval/skipped_export_failed",
    "eval/skipped_ckpt_missing",
    "eval/skipped_crashed",
    "eval/skipped_no_free_slot",
]


def tb_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of the run, read back from the event files: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _names_a_choice(name: str) -> bool:
    """A layout name whose ``{}`` is a tool's or a metric's name (an engine's index is always written)."""
    return "{}" in name and not name.startswith("engine/")


def assert_layout_drawn(tb: dict, *, absent: str) -> None:
    """Every chart line of the custom-scalars layout (``asyncrl/trainer/tb_layout.py``) is drawn from a tag the run
    wrote (TensorBoard's ``re.match`` of the chart's regexes), but ``absent``: the other mode's time split, and the
    lines whose ``{}`` is a name the agent chooses (``tool/{}/calls``: written once a tool is called, which a warm
    start of two steps seldom does; ``env/{}``: only environments that report metrics)."""
    from asyncrl.trainer.tb_layout import LAYOUT, custom_scalars_layout

    built = custom_scalars_layout()
    undrawn = [
        name
        for category, charts in LAYOUT
        for title, names in charts
        for name, rx in zip(names, built[category][title][1])
        if name != absent and not _names_a_choice(name) and not any(re.match(rx, t) for t in tb)
    ]
    assert not undrawn, f"layout names the run never wrote: {undrawn}"


def assert_eval_points_measured_their_step(tb: dict, steps: list[int]) -> None:
    missing = [m for m in SEED_METRICS_EVAL if m not in tb]
    assert not missing, f"eval metrics missing from TensorBoard: {missing}"
    for s in steps:  # Miles: weight_version/mean == eval/step and mixed_version_ratio == 0 confirm the weights
        assert tb["eval/step"][s] == s and tb["eval/test/weight_version/mean"][s] == s, (s, tb["eval/step"])
        assert tb["eval/test/weight_version/mixed_version_ratio"][s] == 0.0


def _assert_clean_exit(r, run_dir: Path):
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    # the weight-sync group is dropped on live engines (it was once destroyed after the shutdown had stopped them)
    assert "destroy_weights_update_group" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert_nothing_left(run_dir, within_s=60)  # a failure bound: children exit at once, a loaded machine is slow


def _assert_no_prompt_lost(recs: list[dict]):
    last = recs[-1]
    issued = last["broker/issued_groups"]
    accounted = (
        last["broker/trained_groups"]
        + last["broker/dropped_groups"]
        + last["broker/held_groups"]
        + last["broker/reissued_groups"]
    )
    assert issued == accounted, last


@pytest.mark.slow
@pytest.mark.parametrize("pause_mode", ["retract", "drain"])
def test_async_steps(prepared, tmp_path, pause_mode):
    """Also: Miles' dynamic-sampling filter (``rollout/dynamic_filter/drop_<reason>``) and custom rollout log
    hook (called every step with the step's trajectories; returning False keeps the default logging)."""
    run_dir = tmp_path / "run"
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=4",
        f'rollout.pause_mode="{pause_mode}"',
        'rollout_buffer.dynamic_sampling_filter_path="eval_helpers:drop_every_fifth"',
        'logging.custom_rollout_log_function_path="eval_helpers:log_rollout_data"',
    )
    _assert_clean_exit(r, run_dir)
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3, 4]

    tb = tb_scalars(run_dir)
    missing = [m for m in SEED_METRICS_ASYNC + ["rollout/dynamic_filter/drop_every_fifth"] if m not in tb]
    assert not missing, f"metrics missing from TensorBoard: {missing}"
    assert any(t.startswith("rollout/data_staleness/ratio_") for t in tb)
    assert_layout_drawn(tb, absent="time/rollout")  # async: the actor's wait is time/wait_data
    for x in recs:  # exclusive: a second both limits block counts once (as buffer full)
        waits = x["rollout/buffer/admission_wait_inflight_limit"] + x["rollout/buffer/admission_wait_buffer_full"]
        assert waits <= 1.0 + 1e-9, x
    assert sorted(tb["time/step"]) == [1, 2, 3, 4]
    calls = [json.loads(ln) for ln in (run_dir / "hook_calls.jsonl").read_text().splitlines()]
    assert [c["step"] for c in calls] == [1, 2, 3, 4] and all(c["samples"] > 0 for c in calls)
    assert [c["staleness"] for c in calls] == pytest.approx(
        [tb["rollout/data_staleness/mean"][s] for s in (1, 2, 3, 4)]
    )

    bound = 8 / 4 + 1  # max_buffered_groups / rollout_batch_size + 1
    assert max(x["rollout/data_staleness/max"] for x in recs) <= bound
    versions = [x["actor/weight_version"] for x in recs]
    assert versions == sorted(versions) and versions[-1] == 4
    _assert_no_prompt_lost(recs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    if pause_mode == "drain":  # drain lets requests finish before a sync: nothing is retracted, except a turn that
        # was on the wire when the broker stopped issuing and reached the engine between "idle" and the guard pause:
        # the syncer sees it in its load re-read, logs it, resumes and drains again (WeightSyncer._drain)
        retracted = [x["step"] for x in recs if x["rollout/retractions/mean"] > 0]
        slipped = "got a request during the pause" in r.stdout + r.stderr
        assert not retracted or slipped, f"retractions at steps {retracted} under drain with no request slipped in"


@pytest.mark.slow
def test_sync_steps(prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_job(prepared, run_dir, "runner.max_steps=3", "runner.async_mode=false")
    _assert_clean_exit(r, run_dir)
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3]
    for key in ("time/rollout", "time/training", "time/sync_weights", "time/step"):
        assert all(key in x for x in recs), key
    tb = tb_scalars(run_dir)
    missing = [m for m in SEED_METRICS_SYNC if m not in tb]
    assert not missing, f"metrics missing from TensorBoard: {missing}"
    assert "time/wait_data" not in tb  # sync mode: the wait is time/rollout, counted once
    assert_layout_drawn(tb, absent="time/wait_data")
    for s in (1, 2, 3):  # the split adds up to (at most) the step
        parts = tb["time/rollout"][s] + tb["time/training"][s] + tb["time/sync_weights"][s]
        assert parts <= tb["time/step"][s] * 1.01 + 0.01, (s, parts, tb["time/step"][s])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["time/wait_data"] == 0.0
    # synchronous: every trained group was generated by the weights of the step before
    assert max(x["rollout/data_staleness/max"] for x in recs) == 0
    _assert_no_prompt_lost(recs)


@pytest.mark.slow
def test_kill_and_resume(prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_job(prepared, run_dir, "runner.max_steps=2", "runner.checkpoint_interval=2")
    _assert_clean_exit(r, run_dir)
    assert (run_dir / "checkpoints" / "step_000002" / "complete").is_file()
    r = run_job(prepared, run_dir, "runner.max_steps=4", "runner.checkpoint_interval=2", "runner.resume=true")
    _assert_clean_exit(r, run_dir)
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    assert recs[-1]["actor/weight_version"] == 4


@pytest.mark.slow
def test_periodic_eval_shared_engines_and_external_backend(prepared, tmp_path):
    """``eval.eval_interval = 2``: on the shared engines (points in the step's record, production held and
    resumed), then with an external CheckpointEvalFn on fresh snapshots (points logged at their step with
    ``eval/lag_steps``; the snapshot is the actor's weights at that step; retired snapshots are deleted)."""
    from eval_helpers import weights_checksum

    run_dir = tmp_path / "shared"  # 4 of the 34 held-out prompts a point: the points' plumbing, not the figures
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=4",
        "eval.eval_interval=2",
        "runner.eval_before_after=true",
        "eval.max_samples=4",
        'logging.custom_eval_rollout_log_function_path="eval_helpers:log_eval_rollout_data"',
    )
    _assert_clean_exit(r, run_dir)
    assert_eval_points_measured_their_step(tb_scalars(run_dir), [2, 4])  # shared engines, interval 1: exact
    calls = [json.loads(ln) for ln in (run_dir / "hook_calls.jsonl").read_text().splitlines()]
    assert [(c["kind"], c["step"], c["datasets"]) for c in calls] == [("eval", s, ["test"]) for s in (0, 2, 4, 4)]
    summary = json.loads((run_dir / "summary.json").read_text())  # the before/after eval holds issuing too
    assert summary["test_accuracy_before"] is not None and summary["test_accuracy_after"] is not None
    every = read_metrics(run_dir)
    recs = [x for x in every if "time/step" in x]
    assert [x["step"] for x in recs] == [1, 2, 3, 4]  # shared-engine points are part of their step's record
    evals = {x["step"]: x for x in recs if "eval/test/accuracy" in x}
    assert sorted(evals) == [2, 4]
    before_after = [x for x in every if "time/step" not in x]  # records of their own, at step 0 and the last step
    assert [x["step"] for x in before_after] == [0, 4] and all("eval/test/accuracy" in x for x in before_after)
    assert before_after[0]["eval/test/accuracy"] == summary["test_accuracy_before"]
    for x in evals.values():
        assert 0.0 <= x["eval/test/accuracy"] <= 1.0 and x["eval/test/num_prompts"] == 4  # eval.max_samples
        assert x["eval/test/response_len"] > 0 and x["eval/test/num_turns"] >= 1 and x["eval/time_seconds"] > 0
    _assert_no_prompt_lost(recs)
    assert recs[-1]["broker/issued_groups"] > recs[1]["broker/issued_groups"]  # production resumed after the eval

    # external CheckpointEvalFn, every step an eval point, every skip reason of Miles' page happening for real
    # (eval_helpers.EverySkipReasonEval): 1 export raises, 2 EvalSkip (holding the eval thread until 6 is busy),
    # 3 lost its completion marker, 4 crashes, 5 measures, 6 finds four points in flight
    hf_dir = tmp_path / "eval_hf"
    hf_dir.mkdir()
    (hf_dir / "step_000001").write_text("not a directory: the export of step 1 raises\n")
    run_dir = tmp_path / "external"
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=6",
        "eval.eval_interval=1",
        'eval.eval_function_path="eval_helpers:EverySkipReasonEval"',
        f'eval.eval_hf_dir="{hf_dir}"',
        'eval.eval_overflow_policy="skip"',
        "eval.eval_max_in_flight=4",
        "eval.eval_keep_snapshots=1",
        "runner.checkpoint_interval=5",
        "runner.save_hf=true",
    )
    _assert_clean_exit(r, run_dir)
    recs = read_metrics(run_dir)
    steps = [x for x in recs if "time/step" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4, 5, 6]
    assert [x["step"] for x in steps if "eval/export_time_seconds" in x] == [2, 3, 4, 5]
    (point,) = [x for x in recs if "eval/checksum" in x]
    assert point["step"] == 5 and point["eval/snapshot_step"] == 5 and point["eval/weight_version"] == 5
    assert point["eval/num_datasets"] == 1 and point["eval/lag_steps"] == 1  # logged at the end of step 6
    ckpt_export = run_dir / "checkpoints" / "step_000005" / "hf_export"  # the actor's own HF export at step 5
    assert point["eval/checksum"] == pytest.approx(weights_checksum(ckpt_export), rel=1e-12)
    assert sorted(p.name for p in hf_dir.iterdir()) == ["step_000001", "step_000005"]  # keep_snapshots = 1

    tb = tb_scalars(run_dir)
    missing = [m for m in SEED_METRICS_EVAL_EXTERNAL if m not in tb]
    assert not missing, f"eval metrics missing from TensorBoard: {missing}"
    assert sorted(tb["eval/checksum"]) == [5]
    assert_eval_points_measured_their_step(tb, [5])
    # each skipped point at the step it would have landed on, with Miles' reason names
    assert tb["eval/skipped_export_failed"] == {1: 1.0} and tb["eval/skipped_no_free_slot"] == {2: 1.0}
    assert tb["eval/skipped_ckpt_missing"] == {3: 1.0} and tb["eval/skipped_crashed"] == {4: 1.0}
    assert tb["eval/skipped_busy"] == {6: 1.0}
    assert sorted(tb["eval/step"]) == [2, 3, 4, 5]  # the points that reached the eval thread
    assert tb["eval/skipped"][6] == 2.0 and tb["eval/errors"][4] == 1.0  # running counts


@pytest.mark.slow
def test_periodic_eval_on_a_dedicated_fleet(prepared, tmp_path):
    """Three ranks (actor, rollout, eval fleet engine on CPU), ``eval.eval_interval = 2``: at each eval step the
    fresh snapshot is loaded into the fleet engine (``/update_weights_from_disk``, its weight version becomes
    the step) and the held-out set is evaluated there, logged at its step with ``eval/lag_steps``."""
    run_dir = tmp_path / "fleet"
    hf_dir = tmp_path / "eval_hf"
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=4",
        "eval.eval_interval=2",
        "eval.eval_num_gpus=1",
        f'eval.eval_hf_dir="{hf_dir}"',
        "eval.eval_keep_snapshots=1",
        "eval.max_samples=4",
        'cluster.component_placement={ actor = "0", "rollout,reward" = "1", eval = "2" }',
        "cluster.num_devices_per_node=3",
        nproc=3,
    )
    _assert_clean_exit(r, run_dir)
    recs = read_metrics(run_dir)
    steps = [x for x in recs if "time/step" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert [x["step"] for x in steps if "eval/export_time_seconds" in x] == [2, 4]
    points = {x["step"]: x for x in recs if "eval/test/accuracy" in x}
    assert sorted(points) == [2, 4]
    for s, x in points.items():
        assert 0.0 <= x["eval/test/accuracy"] <= 1.0 and x["eval/test/num_prompts"] == 4  # eval.max_samples
        assert x["eval/fleet/weight_version"] == s  # the fleet engine carries the snapshot's weights
        assert 0 <= x["eval/lag_steps"] <= 4 - s and x["eval/errors"] == 0 and x["eval/skipped"] == 0
    assert sorted(p.name for p in hf_dir.iterdir()) == ["step_000004"]  # keep_snapshots = 1
    assert_eval_points_measured_their_step(tb_scalars(run_dir), [2, 4])
    # the fleet engine scores the probe prompt as the step-4 snapshot does (fp32 engine vs float64 here; a few
    # tiny steps move this figure by ~1e-6 only, so exact per-step equality is tested on the endpoint itself:
    # tests/integration/test_engine_update_from_disk.py)
    ref = _probe_logprob(hf_dir / "step_000004")
    assert points[4]["eval/fleet/probe_logprob"] == pytest.approx(ref, rel=1e-5)
    assert (run_dir / "logs" / "eval_engine0.log").is_file()
    _assert_no_prompt_lost([x for x in recs if "broker/issued_groups" in x])


def _probe_logprob(model_dir: Path) -> float:
    """Sum of the log-probs of ``PROBE_IDS[1:]`` under the checkpoint, computed in-process (no engine)."""
    import torch

    from asyncrl.cpu_engine.model import KVPool, load_model
    from asyncrl.eval.fleet import PROBE_IDS

    m = load_model(model_dir)
    ids = torch.tensor(PROBE_IDS)
    h = m.forward(ids, torch.tensor([0]), torch.tensor([len(PROBE_IDS)]), KVPool(m.spec, 1), row0=0)
    lp = torch.log_softmax(m.logits(h).double(), dim=-1)
    return float(sum(lp[i, PROBE_IDS[i + 1]] for i in range(len(PROBE_IDS) - 1)))
