"""``benchmarks/autotune.py --quick`` runs both simulated regimes to the end and says which side bound.

Speed and the >= 97% verdict are measured in benchmarks/ (``benchmarks/baselines/autotune.json``), not here; this
checks that the benchmark runs, interleaves every setting, and that the Search-R1 case (deterministic per seed) is
training-bound with auto never above the derived limit, and the knee case generation-bound."""

import proc_helpers  # tests/integration/proc_helpers.py
import pytest


@pytest.mark.slow
def test_autotune_bench_quick_runs_both_regimes():
    doc = proc_helpers.run_benchmark("autotune.py", "--quick", "--reps", "1", "--load", "idle")
    assert doc["benchmark"] == "autotune" and doc["reps"] == 1 and "load_start" in doc and "load_end" in doc
    assert "loaded" not in doc and doc["idle"]["background"]["busy_processes"] == 0
    r = doc | doc["idle"]  # the idle condition's cases over the top level (harness.condition_view), as before --load
    sr1, knee = r["cases"]["searchr1"], r["cases"]["knee"]
    assert set(sr1["settings"]) == {"77", "154", "308", "512", "auto", "auto@512"}
    assert all(row["groups_s"]["n"] == 1 for row in sr1["settings"].values())
    assert (
        sr1["settings"]["auto"]["training_bound_share"] == 1.0 and knee["settings"]["auto"]["training_bound_share"] == 0
    )
    assert max(max(limits) for limits in sr1["auto"]["auto"]["limits_per_rep"]) == sr1["derived"] == 308
    assert sr1["auto"]["auto"]["ok"]  # holds at the derived 308: the case (auto raised it to 512)
