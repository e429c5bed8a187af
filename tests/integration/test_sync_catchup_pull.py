"""Catch-up by pulling, for real (issue 45 item 3).

- A CPU engine is SIGKILLed after a sync wrote version 3 to the weight store and restarted (at version 0, from its
  HF checkpoint); ``EngineRecovery.catch_up`` makes it pull version 3 through ``/update_weights_from_disk``: it
  serves version 3 with the trainer's weights (its own log names the store's directory) before anything generates
  on it, no push happened, and the next sync re-forms the group and broadcasts as before. Then the same engine is
  killed again and caught up by the old full push, timed side by side with the pull.
- A whole CPU-default run with ``sync.catchup = "pull"``: its engine is SIGKILLed after step 2; the rollout rank
  restarts it, actor rank 0 makes it pull the store's version before the worker takes work again, no catch-up push
  happens, and the run finishes with nothing dropped.
- The store's writer is SIGKILLed in the middle of writing a version: no version that looks complete is left, the
  previous one reads back verified, and the next opening removes the torn write.

Real parts: a CPU engine process, the gloo weight-sync group, the HTTP sequence, a plain-PyTorch trainer, a writer
subprocess.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from proc_helpers import REPO, TinyJob
from sync_helpers import KillsAfterFirstBucket, Trainer, assert_serves, served_version

from asyncrl.config.schema import SyncConfig
from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder
from asyncrl.sync.catchup import Puller
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.recovery import EngineRecovery, sync_weights
from asyncrl.sync.weight_store import WeightStore
from asyncrl.sync.weight_sync import SyncHooks, WeightSyncer

pytestmark = pytest.mark.slow


def _kill_and_restart(sup, counts: list[int]) -> None:
    """The rollout rank's part, for real: the engine dies (SIGKILL), is relaunched from its HF checkpoint, answers,
    and its restart is announced."""
    old = sup.pid
    os.kill(old, signal.SIGKILL)
    sup.child.popen.wait(timeout=30)
    sup.relaunch("dead")
    sup.wait_ready()
    assert sup.pid != old
    counts[0] = sup.restarts


def catchup_pull_vs_push(
    tmp_path: Path, *, hidden_size: int, num_layers: int, check_empty_store: bool, num_engines: int = 1
) -> dict:
    """Kill and restart the first of ``num_engines`` engines twice: catch it up by pulling, then by the full push; the
    figures (and the assertions of the pull's contract on the way). ``check_empty_store``: first a restart before any
    sync, caught up from the engines' own checkpoint."""
    ckpt = make_tiny_checkpoint(
        tmp_path / "model",
        arch="qwen2",
        seed=0,
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
    )
    trainer = Trainer(TorchDecoder.from_pretrained(ckpt), version=2)
    cfg = SyncConfig(bucket_bytes=64 << 20, backend="gloo", join_timeout_s=60, step_timeout_s=120, verify_interval=0)
    store = WeightStore(tmp_path / "run" / "weight_store", base_interval=8, keep_bases=2)
    with contextlib.ExitStack() as stack:
        sups = [stack.enter_context(running_cpu_engine(ckpt, log_dir=tmp_path / "logs")) for _ in range(num_engines)]
        sup = sups[0]
        sup.max_restarts = 3
        endpoints = [EngineEndpoint(s.url) for s in sups]
        group = WeightSyncGroup(endpoints, cfg, master_address="127.0.0.1", control_timeout_s=30)
        group.init()
        counts, published = [0] * num_engines, {}
        rec = EngineRecovery(
            group, read_restarts=lambda i: counts[i], publish_synced=published.__setitem__, wait_s=60, max_failures=2
        )
        rec.puller = Puller(store, initial_path=str(ckpt), timeout_s=cfg.step_timeout_s)
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=cfg)

        def sync():
            return sync_weights(trainer, syncer, rec, bucket_bytes=cfg.bucket_bytes, is_leader=True, bcast=lambda x: x)

        try:
            if check_empty_store:  # before any sync the store is empty: the engines' own checkpoint is version 0
                _kill_and_restart(sup, counts)
                assert rec.catch_up() and published == {0: 1} and served_version(sup.url) == "0"
                assert f"from {ckpt} in" in sup.log_path.read_text()
            for _ in range(2):  # versions 3 (a base) and 4 (a delta) in the store
                trainer.train()
                sync()
            store.wait()  # the last version's write runs on the store's thread
            assert store.versions() == [3, 4] and store.manifest(4).kind == "delta"
            _kill_and_restart(sup, counts)
            assert served_version(sup.url) == "0" and rec.pending()
            t0 = time.perf_counter()
            assert rec.catch_up()  # the leader's batch wait does this
            pull_s, materialize_s = time.perf_counter() - t0, rec.puller.last_materialize_s
            # served the store's version before anything generated on it, published synced, no push
            first = counts[0]
            assert served_version(sup.url) == "4" and published == {0: first} and not rec.pending()
            assert rec.puller.num_pulls == 1 + check_empty_store
            log = sup.log_path.read_text()
            assert f"from {store.root}/materialized/v00000004 in" in log, log[-3000:]
            assert_serves(sup.url, trainer)
            # the run goes on: the next sync re-forms the group (the restarted engine left it) and broadcasts
            trainer.train()
            res = sync()
            assert res.version == "5" and {served_version(s.url) for s in sups} == {"5"} and rec.joined[0] == first
            assert_serves(sup.url, trainer)
            # the old way, side by side: the same engine killed again, caught up by a full push
            _kill_and_restart(sup, counts)
            rec.puller = None
            t0 = time.perf_counter()
            sync()  # the step loop's catch-up sync: re-forms the group, pushes every byte
            push_s = time.perf_counter() - t0
            assert {served_version(s.url) for s in sups} == {"5"} and published == {0: first + 1}
            return {
                "pull_s": pull_s,
                "pull_materialize_s": materialize_s,
                "push_s": push_s,
                "model_bytes": sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values()),
                "num_engines": num_engines,
            }
        finally:
            group.destroy()


def test_restarted_engine_catches_up_by_pulling_then_rejoins_the_broadcast(tmp_path):
    figures = catchup_pull_vs_push(tmp_path, hidden_size=64, num_layers=2, check_empty_store=True)
    print(f"catch-up of a restarted engine: {figures}")


def test_an_engine_that_misses_a_broadcast_falls_back_to_pulling(tmp_path):
    """Two engines; one is SIGKILLed in the middle of a sync. Under ``sync.catchup = "pull"`` the sync is finished by
    the survivor pulling the version from the store (no wait for the dead engine's restart, no retried push), and
    the survivor generates again at once; a sync while the dead engine is still down falls back the same way; once
    restarted, the dead engine pulls the latest version before it takes work, and the next sync re-forms the group
    and broadcasts to both."""
    ckpt = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=2, hidden_size=32, intermediate_size=64
    )
    cfg = SyncConfig(bucket_bytes=16 * 1024, backend="gloo", join_timeout_s=30, step_timeout_s=120, verify_interval=0)
    extra = ["--weight-sync-timeout-s", "5"]  # the survivor's receive of the lost bucket gives up after 5 s
    store = WeightStore(tmp_path / "weight_store", base_interval=8, keep_bases=2)
    with (
        running_cpu_engine(ckpt, log_dir=tmp_path / "logs", extra=extra) as a,
        running_cpu_engine(ckpt, log_dir=tmp_path / "logs", extra=extra) as b,
    ):
        b.max_restarts = 1
        trainer = KillsAfterFirstBucket(TorchDecoder.from_pretrained(ckpt), version=4, victim=b)
        trainer.train(0.05)  # version 5, away from the checkpoint the engines (and a restart) start from
        group = WeightSyncGroup(
            [EngineEndpoint(a.url), EngineEndpoint(b.url)], cfg, master_address="127.0.0.1", control_timeout_s=10
        )
        group.init()
        counts, published = [0, 0], {}
        rec = EngineRecovery(
            group, read_restarts=lambda i: counts[i], publish_synced=published.__setitem__, wait_s=60, max_failures=2
        )
        rec.puller = Puller(store, initial_path=str(ckpt), timeout_s=cfg.step_timeout_s)
        ended = []
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=cfg, hooks=SyncHooks(sync_end=ended.append))

        def sync():
            return sync_weights(trainer, syncer, rec, bucket_bytes=cfg.bucket_bytes, is_leader=True, bcast=lambda x: x)

        try:
            res = sync()
            assert not trainer.armed, "the victim was not killed: the sync had a single bucket"
            # finished by pulling, with no restart seen and no failure counted toward a retry
            assert res.version == "5" and res.num_buckets == 0 and counts == [0, 0] and rec.failures == 0
            assert rec.puller.num_fallbacks == 1 and rec.puller.num_pulls == 1 and store.versions() == [5]
            assert ended == [5] and not b.alive() and rec.stale
            assert served_version(a.url) == "5"
            assert_serves(a.url, trainer)  # resumed, with the trainer's weights
            # a sync while the dead engine is still down: the group cannot re-form (refused at once): pulled again
            trainer.train()
            res = sync()
            assert res.version == "6" and rec.puller.num_fallbacks == 2 and served_version(a.url) == "6"
            assert_serves(a.url, trainer)
            # the rollout rank restarts it: it pulls version 6 before it takes work
            b.relaunch("dead")
            b.wait_ready()
            counts[1] = b.restarts
            assert served_version(b.url) == "0" and rec.pending()
            assert rec.catch_up() and published == {1: 1} and served_version(b.url) == "6"
            assert_serves(b.url, trainer)
            # the broadcast is the fast path again: the group re-forms with both, every bucket is pushed
            trainer.train()
            res = sync()
            assert res.version == "7" and res.num_buckets > 1 and not rec.stale and rec.joined == [0, 1]
            assert rec.puller.num_fallbacks == 2 and rec.puller.num_pulls == 3
            for sup in (a, b):
                assert served_version(sup.url) == "7"
                assert_serves(sup.url, trainer)
        finally:
            group.destroy()


_WRITER = """
import sys, torch
from asyncrl.sync.weight_store import WeightStore
store = WeightStore(sys.argv[1], base_interval=8, keep_bases=2)
store.put(1, {"w": torch.zeros(4)})
print("version 1 written", flush=True)
big = {f"w{i}": torch.randn(4 << 20) for i in range(16)}  # 256 MB: the write takes a while
store.put(2, big)
print("version 2 written", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_no_version_that_looks_complete(tmp_path):
    root = tmp_path / "weight_store"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "version 1 written"
        deadline = time.monotonic() + 60
        while not any(root.glob(".tmp-v00000002-*/weights.safetensors")):  # the write of version 2 has begun
            assert proc.poll() is None, "the writer finished before it could be killed mid-write"
            assert time.monotonic() < deadline, "the writer never began version 2"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "v00000002").exists()
    store = WeightStore(root, base_interval=8, keep_bases=2)  # a restarted actor rank 0 opens it
    assert store.versions() == [1]
    assert torch.equal(store.read(1)["w"], torch.zeros(4))
    assert not list(root.glob(".tmp-*")), "the torn write was not removed on open"


def test_a_run_whose_engine_is_killed_catches_it_up_by_pulling(prepared, tmp_path):
    run = tmp_path / "run"
    # a sync every 4 steps: the kill lands after step 4's sync, the buffer (max_buffered_groups 8 = 2 steps) feeds
    # steps 5-6, and the leader waits for step 7's data while the engine restarts: no sync can bring it back
    job = TinyJob(prepared, run, "runner.max_steps=8", "rollout.update_weights_interval=4", 'sync.catchup="pull"')
    try:
        job.wait_step(4, timeout_s=240)
        first = job.wait_for("the engine's pid", job.engine_pid)
        os.kill(first, signal.SIGKILL)
        job.wait_for("the restarted engine's pid", lambda: (p := job.engine_pid()) not in (None, first) and p)
        rc = job.finish(timeout_s=300)
    except BaseException:
        job.kill_all()
        raise
    out = job.output()
    assert rc == 0, out[-6000:]
    recs = job.records()
    last = recs[-1]
    assert [r["actor/weight_version"] for r in recs] == list(range(1, 9))
    assert last["rollout/engine_restarts"] == 1
    assert last["sync/catchup_pulls"] == 1 and last["sync/catchup_pushes"] == 0, last
    assert sum(r["time/sync_catchup"] for r in recs) > 0
    assert last["broker/dropped_groups"] == 0, "groups of the killed engine were dropped instead of re-issued"
    assert last["broker/issued_groups"] == (
        last["broker/trained_groups"]
        + last["broker/dropped_groups"]
        + last["broker/held_groups"]
        + last["broker/reissued_groups"]
    ), last
    assert "catch-up weight sync" not in out, "a full catch-up push ran"
    # the leader's pull came before the worker took work again (one output file, written in time order)
    pulled = out.index("caught up by pulling version")
    assert f"from {run}/weight_store/materialized/v" in out[pulled : pulled + 1000]
    assert pulled < out.index("synced; taking work again"), out[-6000:]
    engine_logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.log") if "engine" in p.name)
    assert f"from {run}/weight_store/materialized/v" in engine_logs  # the engine's own word: it loaded the store's
