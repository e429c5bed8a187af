"""The eval dispatcher with a real background thread and a real (trivial) CheckpointEvalFn: order,
lag_steps, max_in_flight under both overflow policies, EvalSkip, a raising function, snapshot GC."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from asyncrl.eval.backends import (
    CheckpointEvalFn,
    EvalInput,
    EvalSkip,
    eval_datasets,
    is_eval_step,
    load_eval_fn,
)
from asyncrl.eval.dispatch import EvalDispatcher, outcome_metrics

WAIT_S = 10.0  # every wait in these tests is bounded; a healthy run never gets near it


class FileEval(CheckpointEvalFn):
    """Reads the snapshot: ``value.txt`` -> ``value``, ``snapshot.json`` -> the step it holds. A ``skip`` file
    makes it raise EvalSkip, a ``boom`` file a RuntimeError; ``gate`` (when set) holds each eval until opened."""

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.gate: threading.Event | None = None
        self.started = threading.Semaphore(0)
        self.seen: list[int] = []

    def evaluate_checkpoint(self, checkpoint_dir, input):  # noqa: A002
        d = Path(checkpoint_dir)
        self.started.release()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.seen.append(input.step)
        if (d / "skip").exists():
            raise EvalSkip((d / "skip").read_text())
        if (d / "boom").exists():
            raise RuntimeError("the eval server is down")
        meta = d / "snapshot.json"
        return {
            "value": float((d / "value.txt").read_text()),
            "step_read": json.loads(meta.read_text())["step"] if meta.exists() else input.step,
        }


def snapshot(root: Path, step: int, value: float = 1.0, **flags: str) -> Path:
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "value.txt").write_text(str(value))
    (d / "snapshot.json").write_text(json.dumps({"step": step}))
    for name, text in flags.items():
        (d / name).write_text(text)
    return d


def dispatcher(fn: FileEval, **kw) -> EvalDispatcher:
    base = dict(max_in_flight=2, overflow_policy="backpressure", keep_snapshots=2, wait_timeout_s=WAIT_S)
    base.update(kw)
    return EvalDispatcher(lambda d, step: fn.evaluate_checkpoint(d, EvalInput(step, {}, None)), **base)


def test_points_come_back_in_order_at_their_step_with_lag(tmp_path):
    fn = FileEval()
    disp = dispatcher(fn, max_in_flight=3)
    for step, v in ((2, 0.5), (4, 0.25), (6, 0.75)):
        assert disp.admit(step)
        disp.submit(step, snapshot(tmp_path, step, v), owned=False)
    outs = disp.close()
    assert [(o.step, o.status, o.metrics) for o in outs] == [
        (2, "ok", {"value": 0.5, "step_read": 2.0}),
        (4, "ok", {"value": 0.25, "step_read": 4.0}),
        (6, "ok", {"value": 0.75, "step_read": 6.0}),
    ]
    m = outcome_metrics(outs[0], logged_at=5, num_skipped=0, num_errors=0)
    assert m["eval/value"] == 0.5 and m["eval/step_read"] == 2.0 and m["eval/lag_steps"] == 3.0
    assert m["eval/skipped"] == 0.0 and m["eval/time_seconds"] >= 0.0
    assert disp.num_completed == 3 and disp.poll() == []


def test_skip_policy_skips_a_due_point_while_max_in_flight_are_pending(tmp_path):
    fn = FileEval()
    fn.gate = threading.Event()
    disp = dispatcher(fn, max_in_flight=1, overflow_policy="skip")
    assert disp.admit(2)
    disp.submit(2, snapshot(tmp_path, 2), owned=False)
    assert fn.started.acquire(timeout=WAIT_S)
    assert disp.admit(4) is False and disp.num_skipped == 1  # the slot is taken: skipped, counted
    fn.gate.set()
    outs = disp.close()
    assert [o.step for o in outs] == [2] and fn.seen == [2]
    assert disp.admit(6)  # a free slot again


def test_backpressure_waits_for_the_oldest_pending_eval(tmp_path):
    fn = FileEval()
    fn.gate = threading.Event()
    disp = dispatcher(fn, max_in_flight=1)
    assert disp.admit(2)
    disp.submit(2, snapshot(tmp_path, 2), owned=False)
    assert fn.started.acquire(timeout=WAIT_S)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(disp.admit(4)))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive() and result == []  # still waiting: the only slot is busy
    fn.gate.set()
    waiter.join(timeout=WAIT_S)
    assert result == [True] and disp.num_skipped == 0
    disp.close()


def test_backpressure_gives_up_after_the_wait_timeout_naming_the_key(tmp_path):
    fn = FileEval()
    fn.gate = threading.Event()
    disp = dispatcher(fn, max_in_flight=1, wait_timeout_s=0.2)
    disp.submit(2, snapshot(tmp_path, 2), owned=False)
    with pytest.raises(TimeoutError, match="eval.eval_wait_timeout_s"):
        disp.admit(4)
    fn.gate.set()
    disp.close(timeout_s=WAIT_S)


def test_eval_skip_and_a_raising_function_are_attributed_and_training_goes_on(tmp_path, caplog):
    fn = FileEval()
    disp = dispatcher(fn, max_in_flight=4)
    disp.submit(2, snapshot(tmp_path, 2, skip="no server slot"), owned=False)
    disp.submit(4, snapshot(tmp_path, 4, boom="1"), owned=False)
    disp.submit(6, snapshot(tmp_path, 6, 0.5), owned=False)
    with caplog.at_level(logging.WARNING, logger="asyncrl.eval"):
        outs = disp.close()
    assert [(o.step, o.status) for o in outs] == [(2, "skipped"), (4, "error"), (6, "ok")]
    assert outs[0].reason == "no server slot" and "RuntimeError: the eval server is down" in outs[1].reason
    assert disp.num_skipped == 1 and disp.num_errors == 1 and outs[2].metrics["value"] == 0.5
    assert "no server slot" in caplog.text and "Traceback" in caplog.text  # logged with the reason / traceback
    m = outcome_metrics(outs[1], logged_at=6, num_skipped=disp.num_skipped, num_errors=disp.num_errors)
    assert m["eval/errors"] == 1.0 and m["eval/skipped"] == 1.0 and m["eval/lag_steps"] == 2.0


def test_a_non_dict_result_is_an_error_not_a_dead_thread(tmp_path):
    disp = EvalDispatcher(
        lambda d, step: [1.0], max_in_flight=2, overflow_policy="skip", keep_snapshots=1, wait_timeout_s=WAIT_S
    )
    (tmp_path / "snapshot.json").write_text("{}")
    disp.submit(1, tmp_path, owned=False)
    disp.submit(2, tmp_path, owned=False)
    outs = disp.close()
    assert [o.status for o in outs] == ["error", "error"] and "expected dict" in outs[0].reason


def test_skipped_points_carry_miles_reason_metrics_and_ran_points_their_weight_version(tmp_path):
    """eval/skipped_<reason> for EvalSkip, eval/skipped_crashed for an exception, eval/skipped_ckpt_missing for a
    reused checkpoint without its completion marker (meta.json); a point that ran: eval/step and, per dataset,
    weight_version/mean == step and mixed_version_ratio == 0."""
    fn = FileEval()
    disp = dispatcher(fn, max_in_flight=8)
    disp.submit(2, snapshot(tmp_path, 2, skip="No server slot!"), owned=False)
    disp.submit(4, snapshot(tmp_path, 4, boom="1"), owned=False)
    half = tmp_path / "ckpt" / "step_000006" / "hf_export"  # an interrupted periodic checkpoint: no meta.json
    half.mkdir(parents=True)
    (half / "value.txt").write_text("1")
    disp.submit(6, half, owned=False)
    done = tmp_path / "ckpt" / "step_000008"
    (done / "hf_export").mkdir(parents=True)
    (done / "hf_export" / "value.txt").write_text("0.5")
    (done / "meta.json").write_text(json.dumps({"step": 8, "weight_version": 8}))
    disp.submit(8, done / "hf_export", owned=False)
    outs = disp.close()
    assert [(o.step, o.status) for o in outs] == [(2, "skipped"), (4, "error"), (6, "skipped"), (8, "ok")]
    assert fn.seen == [2, 4, 8]  # the incomplete checkpoint is never handed to the eval function
    ms = [outcome_metrics(o, logged_at=8, num_skipped=0, num_errors=0, datasets=["aime", "test"]) for o in outs]
    assert ms[0]["eval/skipped_no_server_slot"] == 1.0 and ms[1]["eval/skipped_crashed"] == 1.0
    assert ms[2]["eval/skipped_ckpt_missing"] == 1.0 and [m["eval/step"] for m in ms] == [2.0, 4.0, 6.0, 8.0]
    for name in ("aime", "test"):
        assert ms[3][f"eval/{name}/weight_version/mean"] == 8.0 == ms[3]["eval/step"]
        assert ms[3][f"eval/{name}/weight_version/mixed_version_ratio"] == 0.0


def test_owned_snapshots_are_retired_on_every_outcome_and_only_keep_snapshots_stay(tmp_path):
    fn = FileEval()
    disp = dispatcher(fn, max_in_flight=8, keep_snapshots=1)
    reused = snapshot(tmp_path / "ckpt", 2)
    disp.submit(2, reused, owned=False)  # a periodic checkpoint: never deleted
    owned = [
        snapshot(tmp_path / "eval", 4),
        snapshot(tmp_path / "eval", 6, boom="1"),
        snapshot(tmp_path / "eval", 8, skip="x"),
        snapshot(tmp_path / "eval", 10),
    ]
    for d in owned:
        disp.submit(int(d.name.split("_")[1]), d, owned=True)
    assert len(disp.close()) == 5
    assert reused.is_dir()
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["step_000010"]


def test_close_waits_for_pending_evals(tmp_path):
    fn = FileEval()
    fn.gate = threading.Event()
    disp = dispatcher(fn)
    disp.submit(3, snapshot(tmp_path, 3), owned=False)
    assert fn.started.acquire(timeout=WAIT_S)
    threading.Timer(0.2, fn.gate.set).start()
    outs = disp.close()
    assert [o.step for o in outs] == [3] and disp.num_pending == 0


class NotAnEvalFn:
    pass


def test_load_eval_fn_checks_the_class(tmp_path):
    from asyncrl.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/tiny.toml")
    fn = load_eval_fn(f"{__name__}:FileEval", cfg)
    assert isinstance(fn, FileEval) and fn.cfg is cfg
    with pytest.raises(ValueError, match="eval.eval_function_path"):
        load_eval_fn(f"{__name__}:NotAnEvalFn", cfg)
    with pytest.raises(ValueError, match="eval.eval_function_path"):
        load_eval_fn("no_such_module_xyz:F", cfg)


def test_datasets_and_eval_steps(tmp_path):
    from asyncrl.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs/tiny.toml", ['data.test_path="t.jsonl"'])
    assert eval_datasets(cfg) == {"test": "t.jsonl"}
    cfg = load_config(root / "configs/tiny.toml", ['eval.eval_prompt_data={ aime = "a.jsonl" }'])
    assert eval_datasets(cfg) == {"aime": "a.jsonl"}
    assert [s for s in range(1, 9) if is_eval_step(s, 3)] == [3, 6] and not is_eval_step(4, None)


class _ExportFails:
    """An actor whose HF export raises (a full staging directory, a dead disk)."""

    version = 4

    def export_hf(self, d):
        raise OSError(28, "No space left on device")


def test_an_export_that_raises_is_a_skipped_point_and_training_goes_on(tmp_path):
    from asyncrl.config import load_config
    from asyncrl.eval.backends import PeriodicEval

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "configs/tiny.toml",
        [
            f'eval.eval_function_path="{__name__}:FileEval"',
            "eval.eval_interval=2",
            f'eval.eval_hf_dir="{tmp_path / "hf"}"',
            'eval.eval_overflow_policy="skip"',
            "eval.eval_max_in_flight=1",
        ],
    )
    pe = PeriodicEval(cfg, actor=_ExportFails(), is_leader=True)
    try:
        m = pe.after_step(2)  # does not raise
        assert m["eval/skipped_export_failed"] == 1.0 and "eval/export_time_seconds" not in m
        assert pe.after_step(3) == {}
    finally:
        assert pe.finish(4) == []


class GatedEval(FileEval):
    """FileEval held on a class-level gate (PeriodicEval builds the instance itself)."""

    GATE = threading.Event()
    STARTED = threading.Event()

    def evaluate_checkpoint(self, checkpoint_dir, input):  # noqa: A002
        GatedEval.STARTED.set()
        assert GatedEval.GATE.wait(WAIT_S)
        return super().evaluate_checkpoint(checkpoint_dir, input)


class _ExportsValue:
    version = 0

    def export_hf(self, d):
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "value.txt").write_text("0.5")


def test_a_due_point_without_a_slot_under_skip_is_eval_skipped_busy_at_its_step(tmp_path):
    from asyncrl.config import load_config
    from asyncrl.eval.backends import PeriodicEval

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "configs/tiny.toml",
        [
            f'eval.eval_function_path="{__name__}:GatedEval"',
            "eval.eval_interval=2",
            f'eval.eval_hf_dir="{tmp_path}"',
            'eval.eval_overflow_policy="skip"',
            "eval.eval_max_in_flight=1",
        ],
    )
    pe = PeriodicEval(cfg, actor=_ExportsValue(), is_leader=True)
    try:
        assert "eval/export_time_seconds" in pe.after_step(2)
        assert GatedEval.STARTED.wait(WAIT_S)
        m = pe.after_step(4)  # the only slot is busy: skipped, at step 4
        assert m == {"eval/skipped": 1.0, "eval/skipped_busy": 1.0}
    finally:
        GatedEval.GATE.set()
        points = dict(pe.finish(4))
    assert points[2]["eval/step"] == 2.0 and points[2]["eval/value"] == 0.5


def test_weight_version_mean_counts_generated_tokens_only():
    """Tool tokens carry version -1 in ``weight_versions``; the mean is over generated tokens (a multi-turn eval
    at version 60 reported 12.9 when the -1s were averaged in)."""
    from types import SimpleNamespace

    from asyncrl.eval.backends import weight_version_summary

    t = SimpleNamespace(weight_versions=[60, 60, -1, -1, -1, 60], min_version=60, max_version=60)
    assert weight_version_summary([t]) == {"weight_version_mean": 60.0, "mixed_version_ratio": 0.0}


def test_a_failed_snapshot_cleanup_is_raised_after_the_collective_export(tmp_path):
    """The leader's clean-up of a left-over at the snapshot path may fail (here a plain file sits there):
    the export (a collective the other actor ranks are already in) still runs, then the error is raised."""
    from asyncrl.eval.backends import export_snapshot, snapshot_dir

    calls = []

    class Actor:
        version = 3

        def export_hf(self, d):
            calls.append(d)
            return d

    snapshot_dir(tmp_path, 4).write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        export_snapshot(Actor(), tmp_path, 4, is_leader=True)
    assert calls == [snapshot_dir(tmp_path, 4)]
