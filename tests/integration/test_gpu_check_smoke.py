"""``benchmarks/gpu_check.py --cpu-smoke``: the GPU check's code paths run on CPU and report JSON."""

import json

import proc_helpers  # tests/integration/proc_helpers.py
import pytest


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = proc_helpers.run_benchmark("gpu_check.py", "--cpu-smoke", "--out", str(out))
    assert r == json.loads(out.read_text())
    assert r["ok"] and r["mode"] == "cpu-smoke" and r["attention_path"] == "sdpa-flash-cpu"
    assert r["logprob_parity"]["fp32_max_abs_diff"] < 1e-4
    assert r["train"]["tokens_per_s"] > 0 and r["cpu_engine_model"]["decode_tokens_per_s"] > 0
