"""The versioned weight store (``asyncrl.sync.weight_store``): its pure core (which kind each version takes, retention,
encode/decode with per-tensor checksums) and its files (atomic versions, verified reads, the materialized directory
the engine's ``/update_weights_from_disk`` loads)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.sync.weight_store import (
    DELTA,
    FULL,
    MANIFEST_FILE,
    MATERIALIZED_FILE,
    SAME,
    WEIGHTS_FILE,
    Manifest,
    StoreCorruption,
    VersionPlan,
    WeightStore,
    decode_chain,
    encode_version,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16, dtype=torch.float32),
    }


def _step(state: dict[str, torch.Tensor], *, frac: float, seed: int) -> dict[str, torch.Tensor]:
    """A training step's change: ``frac`` of the embedding's elements moved, the MLP untouched, the norm all moved."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    emb = out["model.embed_tokens.weight"].view(-1)
    idx = torch.randperm(emb.numel(), generator=g)[: int(frac * emb.numel())]
    emb[idx] = (emb[idx].float() + 0.5).to(emb.dtype)
    out["model.norm.weight"] += 0.01
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_plan_takes_a_base_every_k_versions_and_drops_old_chains():
    plan = VersionPlan(base_interval=3, keep_bases=2)
    kinds = []
    for _ in range(7):
        kinds.append(plan.next_kind())
        plan.wrote(kinds[-1])
    assert kinds == ["base", "delta", "delta", "base", "delta", "delta", "base"]
    ms = [Manifest(v, "base" if v % 3 == 1 else "delta", base=v - (v - 1) % 3, parent=None) for v in range(1, 8)]
    assert plan.dropped(ms) == [1, 2, 3]  # chains based at 4 and 7 kept


def test_encode_stores_only_changes_and_decode_rebuilds_bit_for_bit():
    v1 = _state()
    m1, p1 = encode_version(1, v1, prev=None, kind="base")
    assert set(p1) == set(v1) and all(e["stored"] == FULL for e in m1.tensors.values())
    v2 = _step(v1, frac=0.03, seed=1)
    m2, p2 = encode_version(2, v2, prev=(m1, v1), kind="delta")
    stored = {k: e["stored"] for k, e in m2.tensors.items()}
    assert stored == {
        "model.embed_tokens.weight": DELTA,  # 3% changed: its changed elements only
        "model.layers.0.mlp.up_proj.weight": SAME,
        "model.norm.weight": FULL,  # every element changed: the codec declines, stored whole
    }
    assert sum(t.numel() * t.element_size() for t in p2.values()) < sum(
        t.numel() * t.element_size() for t in v2.values()
    )
    assert m2.base == 1 and m2.parent == 1
    assert _same(decode_chain([(m1, p1), (m2, p2)], where="mem"), v2)


def test_decode_names_a_corrupted_tensor():
    v1 = _state()
    m1, p1 = encode_version(1, v1, prev=None, kind="base")
    p1["model.norm.weight"] = p1["model.norm.weight"].clone()
    p1["model.norm.weight"][3] = 7.0
    with pytest.raises(StoreCorruption, match=r"v00000001/weights\.safetensors.*'model\.norm\.weight'.*checksum"):
        decode_chain([(m1, p1)], where="store")


def test_store_writes_bases_and_deltas_and_reads_every_kept_version(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=3, keep_bases=2)
    states = [_state()]
    for s in range(1, 8):
        states.append(_step(states[-1], frac=0.02, seed=s))
    for v, st in enumerate(states, start=1):
        store.put(v, st)
    assert store.versions() == [4, 5, 6, 7, 8]  # chains 1-3 dropped; bases at 4 and 7
    assert [store.manifest(v).kind for v in store.versions()] == ["base", "delta", "delta", "base", "delta"]
    for v in store.versions():
        assert _same(store.read(v), states[v - 1])
    d = store.materialize(8)
    assert [p.name for p in d.iterdir()] == [MATERIALIZED_FILE]
    assert _same(load_file(str(d / MATERIALIZED_FILE)), states[-1])
    assert store.materialize(8) == d  # cached


def test_capture_passes_buckets_on_and_keeps_a_copy(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=2, keep_bases=1)
    st = _state()
    buckets = [list(st.items())[:2], list(st.items())[2:]]
    assert list(store.capture(iter(buckets))) == buckets
    for t in st.values():
        t.add_(1)  # the actor trains on: the copy is unchanged
    assert not _same(store.captured, st)


def test_rewriting_a_version_drops_a_resumed_attempts_future(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2)
    s1, s2 = _state(1), _state(2)
    for v in (1, 2, 3):
        store.put(v, s1)
    store.materialize(3)
    again = WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2)  # the job restarted from version 2's ckpt
    again.put(2, s2)
    assert again.versions() == [1, 2] and again.manifest(2).kind == "base"
    assert _same(again.read(again.latest()), s2)
    assert _same(load_file(str(again.materialize(2) / MATERIALIZED_FILE)), s2)


def test_a_torn_write_is_invisible_and_removed_on_open(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2)
    store.put(1, _state())
    torn = tmp_path / "ws" / ".tmp-v00000002-123"  # what a crash between the file writes and the rename leaves
    torn.mkdir()
    (torn / WEIGHTS_FILE).write_bytes(b"\0" * 100)
    (torn / MANIFEST_FILE).write_text(json.dumps({"version": 2}))
    assert store.versions() == [1] and store.latest() == 1
    WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2)
    assert not torn.exists()


def test_a_corrupted_file_is_caught_naming_version_file_and_tensor(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2)
    s1 = _state()
    store.put(1, s1)
    store.put(2, _step(s1, frac=0.05, seed=3))
    f = tmp_path / "ws" / "v00000001" / WEIGHTS_FILE
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF  # one byte of the last tensor's data
    f.write_bytes(bytes(raw))
    reopened = WeightStore(tmp_path / "ws", base_interval=8, keep_bases=2)  # a restarted actor rank 0 reads the disk
    with pytest.raises(StoreCorruption, match=r"v00000001/weights\.safetensors: tensor '[^']+' of version 1 fails"):
        reopened.materialize(2)
    f.write_bytes(b"not a safetensors file")
    with pytest.raises(StoreCorruption, match=r"v00000001/weights\.safetensors: not a readable safetensors file"):
        store.read(2)


def test_put_async_writes_in_order_and_a_reader_waits_for_it(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=4, keep_bases=2)
    states = [_state()]
    for s in range(1, 4):
        states.append(_step(states[-1], frac=0.02, seed=s))
    for v, st in enumerate(states, start=1):
        store.put_async(v, st)
    assert store.latest() == 4  # waits for the write in flight
    assert _same(store.read(4), states[-1])
    seconds, num_bytes = store.take_put_figures()
    assert seconds > 0 and num_bytes > 0 and store.take_put_figures() == (0.0, 0)


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path):
    store = WeightStore(tmp_path / "ws", base_interval=4, keep_bases=2)
    store.put_async(1, {"w": torch.zeros(3), "bad": "not a tensor"})
    with pytest.raises(AttributeError):
        store.wait()
    store.put_async(2, _state())  # the store goes on: the failed version left nothing visible
    assert store.latest() == 2 and store.versions() == [2]
