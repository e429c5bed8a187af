"""tools/warm_start_curve.py runs end to end: it prepares data and the random model, trains the warm start and
probes the held-out copy skill at the asked steps (a 2-step recipe on 60 countries)."""

import json
import subprocess
import sys
from pathlib import Path

from proc_helpers import PREPARE_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]


def test_curve_probes_the_asked_steps(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/warm_start_curve.py"),
            "--dir",
            str(tmp_path / "prep"),
            "--at",
            "1,2",
            "prepare.sft_steps=2",
            "prepare.sft_batch_size=8",
            "prepare.num_entities=60",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [p["step"] for p in out["points"]] == [1, 2]
    for p in out["points"]:
        assert 0.0 <= p["exact"] <= p["token"] <= 1.0 and 0.0 <= p["train_exact"] <= p["train_token"] <= 1.0
        assert 0.0 <= p["query"] <= 1.0 and 0.0 <= p["train_query"] <= 1.0
    assert (tmp_path / "prep/data/test.jsonl").is_file() and (tmp_path / "prep/model/config.json").is_file()


def test_probe_of_a_saved_checkpoint(prepared, tmp_path):
    """``--model`` probes a saved checkpoint without training; the random one predicts no answer and no query."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/warm_start_curve.py"),
            "--dir",
            str(prepared),
            "--model",
            str(prepared / "model"),
            *PREPARE_OVERRIDES,  # the shared artefacts' recipe: another would make them again
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (point,) = json.loads(r.stdout.strip().splitlines()[-1])["points"]
    assert point["exact"] == point["train_exact"] == 0.0
    assert point["query"] == point["train_query"] == 0.0
