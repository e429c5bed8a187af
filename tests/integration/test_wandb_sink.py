"""The wandb sink (``logging.wandb``), real wandb in offline mode, read back from the run's local ``.wandb`` file.

The wandb run must hold what metrics.jsonl holds: the same names, the same steps, record by record, including a
record logged at an earlier step than the one before it (an eval point that finished later), which
``run.log(step=)`` would drop; and the resolved config as the run's config.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]'; the dev extra has it)")

from proc_helpers import assert_nothing_left, read_metrics, run_job  # noqa: E402
from wandb_files import config, history, metric_axes, read_records, run_files  # noqa: E402

from asyncrl.config import load_config, to_dict  # noqa: E402
from asyncrl.config.schema import WandbConfig  # noqa: E402
from asyncrl.trainer.writers import MetricsWriter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OFFLINE = WandbConfig(project="asyncrl-tests", mode="offline", tags=["unit"])


def _same(a: dict, b: dict) -> bool:
    """Two records with the same names and values (NaN equals NaN)."""
    if a.keys() != b.keys():
        return False
    return all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def assert_wandb_holds_the_jsonl(run_dir: Path, wandb_history: list[dict]) -> None:
    """Record by record, in order: the wandb run's history is metrics.jsonl (its ``time`` field aside; JSON's "nan"
    strings are NaN in wandb)."""
    jsonl = []
    for rec in read_metrics(run_dir):
        rec.pop("time")
        jsonl.append({k: float(v) if isinstance(v, str) else v for k, v in rec.items()})
    assert len(wandb_history) == len(jsonl), ([r["step"] for r in wandb_history], [r["step"] for r in jsonl])
    for got, want in zip(wandb_history, jsonl):
        assert _same(got, want), (got, want)


def test_every_record_reaches_wandb_at_its_own_step_with_the_config(tmp_path):
    cfg = load_config(REPO / "configs/tiny.toml", [f'logging.run_dir="{tmp_path / "run"}"'])
    run_dir = tmp_path / "run"
    w = MetricsWriter(run_dir, console=False, wandb=OFFLINE, config=to_dict(cfg), run_id="0123456789ab")
    w.log({"eval/test/accuracy": 0.1}, step=0)  # the held-out eval before training
    w.log({"reward/mean": 0.25, "train/loss": float("nan"), "note": "text"}, step=1)
    w.log({"reward/mean": 0.5, "time/step": 2.0}, step=2)
    w.log({"eval/checksum": 7.0, "eval/lag_steps": 1.0}, step=1)  # a late eval point, at its own (earlier) step
    w.log({"reward/mean": 0.75}, step=3)
    w.log({"eval/test/accuracy": 0.3}, step=3)  # the held-out eval after the last step, at that step
    w.close()

    (path,) = run_files(run_dir)
    records = read_records(path)
    got = history(records)
    assert [r["step"] for r in got] == [0, 1, 2, 1, 3, 3]  # none dropped, none merged
    assert got[3] == {"eval/checksum": 7.0, "eval/lag_steps": 1.0, "step": 1}
    assert "note" not in got[1] and math.isnan(got[1]["train/loss"])
    assert_wandb_holds_the_jsonl(run_dir, got)
    assert metric_axes(records) == {"step": "", "*": "step"}  # every metric plotted against the run's step
    assert config(records) == json.loads(json.dumps(to_dict(cfg)))  # the resolved config, as JSON has it
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "run"  # no logging.wandb.name: the run directory's name
    assert (run.run_id, run.project, list(run.tags)) == ("0123456789ab", "asyncrl-tests", ["unit"])
    assert records[-1].WhichOneof("record_type") == "exit"  # close() finished the run


def test_a_resumed_writer_continues_the_wandb_run_and_writes_the_purged_steps_again(tmp_path):
    first = MetricsWriter(tmp_path, console=False, wandb=OFFLINE, run_id="resumedrun01")
    for step in range(1, 6):
        first.log({"reward/mean": float(step)}, step=step)
    first.close()
    again = MetricsWriter(tmp_path, console=False, purge_step=4, wandb=OFFLINE, run_id="resumedrun01")
    for step in (4, 5, 6):
        again.log({"reward/mean": 10.0 * step}, step=step)
    again.close()

    files = run_files(tmp_path)
    assert [p.name for p in files] == ["run-resumedrun01.wandb"] * 2  # one wandb run, one local file per attempt
    attempts = [history(read_records(p)) for p in files]
    assert [[(r["step"], r["reward/mean"]) for r in h] for h in attempts] == [
        [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)],
        [(4, 40), (5, 50), (6, 60)],  # steps 4 and 5 written again, none dropped
    ]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl purged as before


def test_a_sink_that_does_not_start_fails_the_writer_naming_the_key(tmp_path):
    bad = WandbConfig(project="team/project", mode="offline")  # wandb.init refuses '/' in a project name
    with pytest.raises(RuntimeError, match=r"logging\.wandb: .*Invalid project name 'team/project'"):
        MetricsWriter(tmp_path, console=False, wandb=bad)


def test_mode_disabled_starts_no_wandb_run(tmp_path):
    w = MetricsWriter(tmp_path, console=False, wandb=WandbConfig(mode="disabled"))
    w.log({"reward/mean": 1.0}, step=1)
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_a_run_of_the_embedded_default_logs_to_wandb(prepared, tmp_path):
    """torchrun, 3 steps, the held-out eval before and after (records at steps 0 and 3) and an external eval point
    at step 2 that finishes after step 3's record (``eval_helpers.LateChecksumEval``), so it is logged after it."""
    run_dir = tmp_path / "run"
    hf_dir = tmp_path / "eval_hf"
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=3",
        "runner.eval_before_after=true",
        "eval.max_samples=4",
        "eval.eval_interval=2",
        'eval.eval_function_path="eval_helpers:LateChecksumEval"',
        f'eval.eval_hf_dir="{hf_dir}"',
        'logging.wandb={ project = "asyncrl-e2e", mode = "offline", group = "ci" }',
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    assert_nothing_left(run_dir, within_s=60)  # a failure bound: children exit at once, a loaded machine is slow
    (path,) = run_files(run_dir)
    records = read_records(path)
    got = history(records)
    assert_wandb_holds_the_jsonl(run_dir, got)
    # before, steps 1-3, the late point at step 2, after; step 2's record has the point's export time
    assert [(x["step"], "eval/checksum" in x) for x in got] == [(0, 0), (1, 0), (2, 0), (3, 0), (2, 1), (3, 0)]
    assert "eval/test/accuracy" in got[0] and "eval/test/accuracy" in got[-1] and "eval/export_time_seconds" in got[2]
    assert {"reward/mean", "train/loss", "time/step", "rollout/data_staleness/mean"} <= set().union(*got)
    resolved = config(records)
    assert resolved["logging"]["wandb"] == {
        "project": "asyncrl-e2e",
        "mode": "offline",
        "group": "ci",
        "tags": [],
        "init_timeout_s": 90.0,
        "finish_timeout_s": 300.0,
    }
    assert resolved["runner"]["max_steps"] == 3 and resolved["logging"]["run_dir"] == str(run_dir)
    (run,) = [x.run for x in records if x.WhichOneof("record_type") == "run"]
    ident = json.loads((run_dir / "run.json").read_text())
    assert (run.run_id, run.display_name, run.run_group) == (ident["run_id"], "run", "ci")
