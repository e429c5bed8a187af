"""The metrics writer: TensorBoard events readable by EventAccumulator, JSONL, console line."""

import io
import json

from asyncrl.runner.metrics import MetricsWriter, format_console_line


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
