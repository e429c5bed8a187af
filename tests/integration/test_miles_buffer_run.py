"""A real run with a buffer written to Miles' DataBuffer contract (async put/get, on_evict): it trains, checkpoints
its buffered groups and resumes with them; with ``max_concurrent_samples`` it runs Miles' ``sample`` counting; and
the dry run refuses a buffer path that does not import or a class of neither contract (issue 42, items 1 and 3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from proc_helpers import REPO, TRAIN, read_metrics, run_job, tiny_env, tiny_overrides
from test_e2e import _assert_clean_exit, _assert_no_prompt_lost

from asyncrl.broker import protocol as P

BUFFER = 'rollout_buffer.custom_data_buffer_path="miles_buffers:Fifo"'


def _events(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_miles_contract_buffer_trains_checkpoints_and_resumes_with_its_groups(prepared, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "buffer.jsonl"
    env = tiny_env(ASYNCRL_TEST_MILES_BUFFER_LOG=str(log), ASYNCRL_TEST_SLOW_FILTER_S="5")
    common = (
        BUFFER,
        "rollout_buffer.max_concurrent_samples=6",  # Miles' sample counting: 6 trajectories, 3 groups' worth
        "runner.checkpoint_interval=2",
        # the first batch's filter takes 5 s while generation goes on: the buffer holds groups at the checkpoint
        'rollout_buffer.sample_filter_path="slow_filter:slow_first_batch"',
    )
    r = run_job(prepared, run_dir, *common, "runner.max_steps=2", env=env)
    _assert_clean_exit(r, run_dir)
    first = _events(log)
    first_pid = first[0]["pid"]
    assert all(e["typed"] and e["samples"] == 2 for e in first)  # Miles' types: a Sample per trajectory
    gets = [e for e in first if e["event"] == "get"]
    assert len(gets) >= 8  # two steps of 4 groups came out of the buffer's own get()

    body, blobs = P.state_from_bytes((run_dir / "checkpoints" / "step_000002" / "broker_state.bin").read_bytes())
    held = [g.item.index for g in P.unpack_state(body, blobs)["buffered"]]
    assert held, "the checkpoint kept none of the buffer's groups"

    r = run_job(prepared, run_dir, *common, "runner.max_steps=4", "runner.resume=true", env=env)
    _assert_clean_exit(r, run_dir)
    resumed = [(e["event"], e["prompt"]) for e in _events(log) if e["pid"] != first_pid]
    # the fresh buffer is given the checkpoint's groups back in their arrival order (what the new broker generated
    # before the state arrived is taken out first), and the resumed run's first batch is the oldest of them (fifo)
    n = len(held)
    starts = [i for i in range(len(resumed) - n + 1) if resumed[i : i + n] == [("put", p) for p in held]]
    assert starts, (held, resumed[:40])
    gets = [p for ev, p in resumed[starts[-1] + n :] if ev == "get"]
    k = min(n, 4)  # data.rollout_batch_size
    assert gets[:k] == held[:k], (held, gets[:8])
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    _assert_no_prompt_lost(recs)
    assert all(x["rollout/buffer/num_inflight_samples"] <= 6 for x in recs)
    assert "custom/evicted" in recs[-1]  # the buffer's own get_metrics() reached the run's metrics


def _dry_run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TRAIN), "configs/tiny.toml", *overrides, "--dry-run"],
        cwd=REPO,
        env=tiny_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_the_dry_run_checks_the_buffer_and_says_which_counting_is_in_force(tmp_path):
    base = tiny_overrides(tmp_path / "prep", tmp_path / "run")  # prepare.enabled: nothing needs to exist yet
    r = _dry_run(*base, 'rollout_buffer.custom_data_buffer_path="nosuch.mod:Buf"')
    assert r.returncode == 2 and "rollout_buffer.custom_data_buffer_path: cannot import module 'nosuch.mod'" in r.stderr
    r = _dry_run(*base, 'rollout_buffer.custom_data_buffer_path="miles_buffers:_log"')
    assert r.returncode == 2, r.stderr
    assert "'miles_buffers:_log' is a function, not a class" in r.stderr, r.stderr
    r = _dry_run(*base, BUFFER, "rollout_buffer.max_concurrent_samples=6")
    assert r.returncode == 0, r.stderr
    assert "# rollout_buffer.custom_data_buffer_path = 'miles_buffers:Fifo': Miles' DataBuffer contract" in r.stdout
    assert '# rollout_buffer.submission_granularity = "sample" (derived: max_concurrent_samples' in r.stdout
    assert "counts trajectories (Miles): at most rollout_buffer.max_concurrent_samples = 6 trajectories" in r.stdout
    r = _dry_run(*base)
    assert '# rollout_buffer.submission_granularity = "group" (derived: RLinf\'s default)' in r.stdout, r.stdout[-2000:]
