"""The metrics writer: TensorBoard events readable by EventAccumulator, JSONL, console line."""

import io
import json

from asyncrl.trainer.writers import MetricsWriter, format_console_line


def test_tensorboard_and_jsonl_round_trip(tmp_path):
    out = io.StringIO()
    w = MetricsWriter(tmp_path, console_stream=out, max_steps=3)
    w.log({"reward/mean": 0.25, "rollout/data_staleness/mean": 1.0, "time/step": 2.5, "note": "text"}, step=1)
    w.log({"reward/mean": 0.5, "train/loss": float("nan")}, step=2)
    w.close()

    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["reward/mean"] == 0.25 and "note" not in recs[0]
    assert recs[1]["train/loss"] == "nan"  # JSON has no NaN: kept as a string, not dropped

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "rollout/data_staleness/mean", "time/step"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]

    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/3 | reward 0.25")
    assert "t_step 2.5" in lines[0]


def test_console_line_fixed_order():
    line = format_console_line({"time/step": 1.0, "reward/mean": 0.5, "train/loss": 0.1}, 4)
    assert line == "step 4 | reward 0.5 | loss 0.1 | t_step 1"


def test_a_resumed_run_purges_the_steps_it_writes_again(tmp_path):
    """Resumed at step 3 (purge_step=4): steps 4 and 5 of the first attempt are gone from metrics.jsonl and
    TensorBoard, so every step shows once, with the resumed run's values (they showed twice before)."""
    first = MetricsWriter(tmp_path, console=False)
    for step in range(1, 6):
        first.log({"reward/mean": float(step)}, step=step)
    first.close()
    again = MetricsWriter(tmp_path, console=False, purge_step=4)
    for step in (4, 5, 6):
        again.log({"reward/mean": 10.0 * step}, step=step)
    again.close()

    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in recs] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]
