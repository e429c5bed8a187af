"""``benchmarks/gpu_check.py --cpu-smoke``: the GPU check's code paths run on CPU and report JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the script puts the repo on sys.path itself
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])  # JSON is the last line
    assert r == json.loads(out.read_text())
    assert r["ok"] and r["mode"] == "cpu-smoke" and r["attention_path"] == "sdpa-flash-cpu"
    assert r["logprob_parity"]["fp32_max_abs_diff"] < 1e-4
    assert r["train"]["tokens_per_s"] > 0 and r["cpu_engine_model"]["decode_tokens_per_s"] > 0
