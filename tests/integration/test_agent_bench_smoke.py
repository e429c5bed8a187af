"""``benchmarks/agent_bench.py --quick`` runs the real agent loop against its stand-in retriever and reports JSON.

Its retriever implements ``asyncrl.agent.tools.base.Retriever`` by hand; when that interface grew ``wait_available``
(the retriever-outage hold) the benchmark broke and nothing noticed (it is not in the #16 side-by-side). Figures are
not asserted here (speed is measured in benchmarks/, never in tests), only that it runs the loop to the end."""

import proc_helpers  # tests/integration/proc_helpers.py
import pytest


@pytest.mark.slow
def test_agent_bench_quick_runs_the_loop_to_the_end():
    r = proc_helpers.run_benchmark("agent_bench.py", "--quick")
    assert r["bench"] == "agent" and r["quick"] is True
    o = r["overhead"]
    assert o["trajectories"] > 0 and o["turns"] >= o["trajectories"]  # every trajectory took at least one turn
    assert r["bm25"]["top1_is_subject"] > 0.9  # the index answered the queries it was built for
