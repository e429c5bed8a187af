"""``benchmarks/agent_bench.py --quick`` runs the real agent loop against its stand-in retriever and reports JSON.

Its retriever implements ``asyncrl.agent.tools.base.Retriever`` by hand; when that interface grew ``wait_available``
(the retriever-outage hold) the benchmark broke and nothing noticed (it is not in the #16 side-by-side). Figures are
not asserted here (speed is measured in benchmarks/, never in tests), only that it runs the loop to the end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_agent_bench_quick_runs_the_loop_to_the_end():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "agent_bench.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])  # JSON is the last line
    assert r["bench"] == "agent" and r["quick"] is True
    o = r["overhead"]
    assert o["trajectories"] > 0 and o["turns"] >= o["trajectories"]  # every trajectory took at least one turn
    assert r["bm25"]["top1_is_subject"] > 0.9  # the index answered the queries it was built for
