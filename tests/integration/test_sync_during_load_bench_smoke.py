"""``benchmarks/weight_sync_bench.py --during-load generate+train`` runs end to end on a small model.

The busy side really ran under its load: the engines answered the stream's requests and the actor process ran (its
CPU time grew) while the sync was timed (``DuringLoad.on`` returns only once both are seen running; a dead trainer or
a failed request ends the benchmark non-zero, which fails this test). Speed is measured in benchmarks/, not here."""

import proc_helpers  # tests/integration/proc_helpers.py
import pytest

SMALL = ("--hidden-size", "128", "--intermediate-size", "256", "--layers", "2", "--engines", "1", "--reps", "1")


@pytest.mark.slow
def test_sync_is_timed_quiet_and_while_engines_generate_and_the_actor_trains():
    doc = proc_helpers.run_benchmark(
        "weight_sync_bench.py", *SMALL, "--load", "idle", "--during-load", "generate+train"
    )
    assert doc["during_load"] == "generate+train" and "loaded" not in doc
    idle = doc["idle"]
    r = idle["results"]["engines1"]
    assert r["sync_s"]["n"] == r["busy_sync_s"]["n"] == r["bare_s"]["n"] == 1  # the three sides, one each
    assert {"busy_control_s", "busy_gather_s", "busy_transfer_s"} <= set(r)
    load = r["during_load"]
    assert load["load"] == "generate+train" and load["on_s"] > 0
    assert load["generated_tokens_per_s"] > 0 and load["trainer_cpu_cores"] > 0 and load["trainer_steps_total"] >= 1
    assert idle["engines1_quiet_over_busy_sync_ratio"]["n"] == 1
