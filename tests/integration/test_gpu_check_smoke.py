"""``benchmarks/gpu_check.py --cpu-smoke``: the GPU check's code paths run on CPU and report JSON; its two-process
checks (``benchmarks/gpu_check_dist.py``) on CPU with gloo, their comparison, deadline and fallback on purpose."""

import json
import subprocess
import sys
import time

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch

sys.path.insert(0, str(proc_helpers.REPO / "benchmarks"))

import gpu_check_dist  # noqa: E402  (benchmarks/gpu_check_dist.py)


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = proc_helpers.run_benchmark("gpu_check.py", "--cpu-smoke", "--out", str(out))
    assert r == json.loads(out.read_text())
    assert r["ok"] and r["mode"] == "cpu-smoke" and r["attention_path"] == "sdpa-flash-cpu"
    assert r["logprob_parity"]["fp32_max_abs_diff"] < 1e-4
    assert r["train"]["tokens_per_s"] > 0 and r["cpu_engine_model"]["decode_tokens_per_s"] > 0
    for name in ("weight_sync", "tp_gather"):  # NCCL refused (CPU tensors / CPU build): the gloo fallback ran
        w = r[name]
        assert w["device"] == "cpu" and w["backend"] == "gloo" and w["dtype"] == "bfloat16", w
        assert w["attempts"]["gloo"] == "ok" and w["attempts"]["nccl"].startswith("rank "), w["attempts"]
        assert r["checks"][f"{name}_ran"]
    ws = r["weight_sync"]
    assert ws["num_buckets"] > 1 and ws["num_bytes"] > 0
    for fmt in ("per_tensor", "flattened_bucket"):
        f = ws[fmt]
        assert f["bitwise_equal"] and f["model_holds_sent"] and f["num_checked"] == ws["num_tensors"], f
        assert f["bytes_per_s"] > 0 and len(f["rep_s"]) == len(f["receive_s"]) == 2
        assert r["checks"][f"weight_sync_{fmt}_received_as_sent"]
    tp = r["tp_gather"]
    assert tp["bitwise_equal"] and not tp["unexpected"] and tp["num_tensors"] == ws["num_tensors"], tp
    assert r["checks"]["tp_gather_matches_unsharded"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the report of a machine without CUDA")
def test_gpu_check_without_cuda_reports_every_phase_skipped(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = subprocess.run(
        [sys.executable, str(proc_helpers.REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=proc_helpers.REPO,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r == json.loads(out.read_text())
    assert r["mode"] == "gpu" and not r["ok"] and "no CUDA device" in r["skipped"]
    for name in ("train", "logprob_parity", "cpu_engine_model", "weight_sync", "tp_gather"):
        assert r[name] == {"skipped": r["skipped"]} and r["checks"][f"{name}_ran"] is False


def test_compare_is_bitwise_and_names_what_differs():
    t = torch.tensor([[0.0, 1.5, -2.0], [3.0, 4.0, 5.0]], dtype=torch.bfloat16)
    expected = [("a", t), ("b", t[0]), ("c", t), ("d", t), ("e", t)]
    signed_zero = t.clone()
    signed_zero[0, 0] = -0.0  # equal as a number, not as bytes
    got = {"a": t.clone(), "b": t[0].clone(), "c": signed_zero, "d": t.float(), "e": t.reshape(3, 2)}
    r = gpu_check_dist.compare(got, expected, device_type="cpu")
    assert not r["bitwise_equal"] and not r["dtype_ok"] and not r["shapes_ok"] and r["device_ok"]
    assert r["mismatched"] == {"bytes": ["c"], "dtype": ["d"], "shape": ["e"]} and r["missing"] == []
    r = gpu_check_dist.compare({"a": t.clone()}, expected[:2], device_type="cpu")
    assert not r["bitwise_equal"] and r["missing"] == ["b"] and r["num_checked"] == 1
    assert gpu_check_dist.compare(got, expected[:2], device_type="cpu")["bitwise_equal"]
    assert not gpu_check_dist.compare(got, expected[:1], device_type="cuda")["device_ok"]


def _sleeps(rank: int, *, sleep_s: float) -> dict:
    time.sleep(sleep_s)
    return {"rank": rank}


def _nccl_refused(rank: int, *, backend: str, port: int, deadline_s: float) -> dict:
    """NCCL as on one GPU: rank 0 refuses at once, rank 1 hangs (killed after the grace); gloo works."""
    if backend == "nccl":
        if rank == 0:
            raise RuntimeError("Duplicate GPU detected")
        time.sleep(deadline_s)
    return {"rank": rank, "port": port}


@pytest.mark.slow
def test_run_ranks_kills_ranks_past_their_deadline(tmp_path):
    t0 = time.monotonic()
    ranks = gpu_check_dist.run_ranks(_sleeps, {"sleep_s": 600}, deadline_s=4, out_dir=tmp_path)
    assert ranks == [{"error": "killed at the deadline (4 s)"}] * 2
    assert time.monotonic() - t0 < 60  # the deadline, the kill and the joins; not the sleep


@pytest.mark.slow
def test_with_fallback_runs_gloo_after_nccl_refused(tmp_path):
    r = gpu_check_dist.with_fallback(_nccl_refused, {}, lambda ranks: {"ranks": ranks}, deadline_s=100, tmp=tmp_path)
    assert r["backend"] == "gloo" and [x["rank"] for x in r["ranks"]] == [0, 1]
    assert r["attempts"] == {
        "nccl": "rank 0: RuntimeError: Duplicate GPU detected; rank 1: killed after another rank failed",
        "gloo": "ok",
    }  # the hanging rank went FAIL_GRACE_S after rank 0 failed, not at the NCCL try's deadline
