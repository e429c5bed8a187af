"""The catch-up keys (``sync.catchup``, ``sync.store_*``): bad values fail naming the key, store keys without the
pull are rejected, and engines on other nodes than actor rank 0 get the shared-filesystem warning; the leader's
recovery sends absolute paths, and a corrupted store makes it fall back to the push, naming the damage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.loader import load_config
from asyncrl.config.validate import validate
from asyncrl.sync.catchup import Puller
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.recovery import EngineRecovery
from asyncrl.sync.weight_store import WEIGHTS_FILE, WeightStore
from asyncrl.trainer.leader import make_recovery

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ('sync.catchup="pulled"', "sync.catchup"),
        ("sync.store_base_interval=0", "sync.store_base_interval"),
        ('sync.catchup="pull"\nsync.store_keep_bases=0', "sync.store_keep_bases"),
        ('sync.store_dir="/tmp/x"', "sync.store_dir"),  # set, but nothing writes the store under push
        ('sync.catchup="pull"\nsync.topology="sharded"', "sync.catchup"),  # rank 0 holds only its shards
    ],
)
def test_a_bad_catchup_setting_fails_naming_the_key(override, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_config("configs/tiny.toml", override.split("\n"))


def test_engines_on_other_nodes_get_the_shared_filesystem_warning():
    two_nodes = load_config("configs/searchr1.toml", ['sync.catchup="pull"', 'sync.store_dir="/shared/ws"'])
    (w,) = [w for w in validate(two_nodes) if "sync.catchup" in w]
    assert "node(s) [1]" in w and "'/shared/ws'" in w and "every node mounts" in w
    assert not [w for w in validate(load_config("configs/searchr1.toml")) if "sync.catchup" in w]
    assert not [w for w in validate(load_config("configs/tiny.toml", ['sync.catchup="pull"'])) if "sync.catchup" in w]


def test_pull_recovery_names_the_store_and_checkpoint_by_absolute_path(tmp_path, monkeypatch):
    """The engine resolves ``model_path`` in its own working directory: the leader sends absolute paths."""
    cfg = load_config(TINY, ['sync.catchup="pull"', 'rollout.model_path="prep/model_sft"'])
    monkeypatch.chdir(tmp_path)
    group = WeightSyncGroup([EngineEndpoint("http://127.0.0.1:1")], cfg.sync)
    rec = make_recovery(cfg, group, None, run_dir=Path("runs/x"))
    assert rec.puller.store.root == tmp_path / "runs/x/weight_store" and rec.puller.store.root.is_dir()
    assert rec.puller.source() == (0, tmp_path / "prep/model_sft")  # nothing synced yet: the engines' checkpoint
    push = make_recovery(load_config(TINY), group, None, run_dir=Path("runs/y"))
    assert push.puller is None and not (tmp_path / "runs/y").exists()


def test_a_corrupted_store_falls_back_to_the_push_naming_the_damage(tmp_path, caplog):
    WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2).put(3, {"w": torch.ones(8)})
    f = tmp_path / "ws" / "v00000003" / WEIGHTS_FILE
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01
    f.write_bytes(bytes(raw))
    published = {}
    group = WeightSyncGroup([EngineEndpoint("http://127.0.0.1:1")], load_config(TINY).sync)
    rec = EngineRecovery(
        group, read_restarts=lambda i: 1, publish_synced=published.__setitem__, wait_s=1, max_failures=1
    )
    rec.puller = Puller(WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2), initial_path="-", timeout_s=1)
    assert not rec.catch_up() and rec.pending() and published == {}  # the step loop's catch-up sync pushes instead
    assert "tensor 'w' of version 3 fails its checksum" in caplog.text and "a full sync will push" in caplog.text
