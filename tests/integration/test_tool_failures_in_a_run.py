"""A real run of the embedded default whose every trajectory calls, at once, a Python program that hangs, one that
raises, one that prints 100 MB and one that tries the network (a TCP listener of this test), and the calculator
(``chaos_env``): each failure is an observation the policy sees plus ``tool/python/errors``, nothing reaches the
listener, and the run trains on to its last step."""

from __future__ import annotations

import socket

import pytest
from proc_helpers import read_metrics, run_job, tiny_env

pytestmark = pytest.mark.slow

STEPS = 3
BATCH, GROUP = 2, 2


def test_hanging_raising_flooding_and_networking_tools_never_stop_a_run(prepared, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    run_dir = tmp_path / "run"
    try:
        r = run_job(
            prepared,
            run_dir,
            'agentloop.task_name="chaos_env:ENV"',
            "agentloop.max_turns=2",
            "agentloop.python.timeout_s=2",
            "agentloop.python.max_output_bytes=2048",
            f"runner.max_steps={STEPS}",
            f"data.rollout_batch_size={BATCH}",
            f"algorithm.group_size={GROUP}",
            env=tiny_env(ASYNCRL_TEST_CHAOS_PORT=str(port)),
            timeout_s=400,
        )
        with pytest.raises(BlockingIOError):  # nothing the sandbox ran reached the listener
            listener.accept()
    finally:
        listener.close()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == list(range(1, STEPS + 1))
    n = BATCH * GROUP  # trajectories a step, each with one tool turn of four programs and one calculation
    for rec in recs:
        assert rec["tool/python/calls"] == 4 * n and rec["tool/python/errors"] == 4 * n, rec
        assert rec["tool/calculator/calls"] == n and "tool/calculator/errors" not in rec, rec
        assert rec["rollout/tool_calls/mean"] == 5.0 and rec["env/chars"] > 0
    assert "Traceback" not in out, out[-4000:]
