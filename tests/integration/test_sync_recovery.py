"""A hung engine does not stall a weight sync: the engine is SIGSTOPped, then a sync starts (its 600 s step
timeout untouched); the engine's watcher (here a thread playing the rollout rank) calls it hung, kills and
relaunches it; the sync fails fast on the killed engine, waits for the restart, re-forms the group and pushes
the weights again. The engine ends at the trainer's version with the trainer's weights, in seconds.

Real parts: a CPU engine process, the gloo weight-sync group, the HTTP sequence, a plain-PyTorch trainer.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from sync_helpers import KillsAfterFirstBucket, Trainer, assert_serves, served_version, watch_and_restart

from asyncrl.config.schema import SyncConfig
from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.recovery import EngineRecovery, sync_weights
from asyncrl.sync.weight_sync import WeightSyncer

pytestmark = pytest.mark.slow


def test_sync_survives_a_hung_engine(tmp_path):
    ckpt = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    trainer = Trainer(TorchDecoder.from_pretrained(ckpt), version=3)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05)  # "trained": differs from the checkpoint the engine restarts with
    cfg = SyncConfig(bucket_bytes=64 * 1024, backend="gloo", join_timeout_s=30, step_timeout_s=600)
    with running_cpu_engine(ckpt, log_dir=tmp_path / "logs", extra=["--weight-sync-timeout-s", "30"]) as sup:
        sup.max_restarts = 1
        group = WeightSyncGroup([EngineEndpoint(sup.url)], cfg, master_address="127.0.0.1", control_timeout_s=10)
        group.init()
        counts, published, stop = [0], {}, threading.Event()
        rec = EngineRecovery(
            group, read_restarts=lambda i: counts[i], publish_synced=published.__setitem__, wait_s=60, max_failures=2
        )
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=cfg)
        watcher = threading.Thread(target=watch_and_restart, args=(sup, counts, stop, 2.0), daemon=True)
        watcher.start()
        try:
            os.kill(sup.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            res = sync_weights(trainer, syncer, rec, bucket_bytes=cfg.bucket_bytes, is_leader=True, bcast=lambda x: x)
            took = time.monotonic() - t0
            assert res.version == "3" and counts == [1] and published == {0: 1}
            assert took < 30, f"the sync took {took:.0f}s with a hung engine"
            assert served_version(sup.url) == "3"
            assert_serves(sup.url, trainer)
        finally:
            stop.set()
            group.destroy()
            watcher.join(timeout=30)


def test_sync_that_fails_after_begin_is_retried_and_the_survivor_accepts_it(tmp_path):
    """Two engines; one is killed in the middle of a sync (after every engine's /begin_weight_update). The failed
    sync closes the survivor's weight-update session before the recovery retries, so the retry's begin is accepted
    (the CPU engine, like SGLang, refuses a second begin while a session is open) and both engines end at the
    trainer's version and weights."""
    ckpt = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=2, hidden_size=32, intermediate_size=64
    )
    cfg = SyncConfig(bucket_bytes=16 * 1024, backend="gloo", join_timeout_s=30, step_timeout_s=120)
    extra = ["--weight-sync-timeout-s", "10"]  # the survivor's receive of the lost bucket gives up after 10 s
    with (
        running_cpu_engine(ckpt, log_dir=tmp_path / "logs", extra=extra) as a,
        running_cpu_engine(ckpt, log_dir=tmp_path / "logs", extra=extra) as b,
    ):
        b.max_restarts = 1
        trainer = KillsAfterFirstBucket(TorchDecoder.from_pretrained(ckpt), version=5, victim=b)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05)
        group = WeightSyncGroup(
            [EngineEndpoint(a.url), EngineEndpoint(b.url)], cfg, master_address="127.0.0.1", control_timeout_s=10
        )
        group.init()
        counts, published, stop = [0, 0], {}, threading.Event()
        rec = EngineRecovery(
            group, read_restarts=lambda i: counts[i], publish_synced=published.__setitem__, wait_s=60, max_failures=2
        )
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=cfg)
        watcher = threading.Thread(target=watch_and_restart, args=(b, counts, stop, 2.0, 1), daemon=True)
        watcher.start()
        try:
            res = sync_weights(trainer, syncer, rec, bucket_bytes=cfg.bucket_bytes, is_leader=True, bcast=lambda x: x)
            assert not trainer.armed, "the victim was not killed: the sync had a single bucket"
            assert res.version == "5" and counts == [0, 1] and published == {1: 1} and rec.failures == 1
            for url in (a.url, b.url):
                assert served_version(url) == "5"
            assert "a weight-update session is already open" not in a.log_path.read_text()
        finally:
            stop.set()
            group.destroy()
            watcher.join(timeout=30)
