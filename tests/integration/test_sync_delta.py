"""Delta sync into two real CPU engines held at bf16 (``--dtype bfloat16``, SGLang's flag): only the changed
elements travel, through ``/update_weights_from_tensor`` and the delta loader registered with
``--custom-weight-loader``; the served weights must be bit-identical to the trainer's bf16 export, tensor by
tensor (``/get_weights_by_name``: a Llama checkpoint, which SGLang can read back by name).

The trainer is this process: a plain-PyTorch decoder (fp32, HF names) stepped like an optimizer at a small
learning rate, so most bf16 elements do not move.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from asyncrl.config.schema import DELTA_LOADER, SyncConfig
from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.blocking import get_json, post_json
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder
from asyncrl.sync.bucketing import iter_buckets
from asyncrl.sync.catchup import Puller
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.weight_store import WeightStore
from asyncrl.sync.weight_sync import WeightSyncer

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
STEP = 2e-5  # an Adam-like step on these weights (std 0.02, a bf16 ulp ~1e-4): a fraction of the elements move


@dataclass
class Env:
    engines: list
    group: WeightSyncGroup
    syncer: WeightSyncer
    trainer: TorchDecoder
    version: int = 0

    def sync(self) -> dict[str, float]:
        self.version += 1
        named = self.trainer.state_dict().items()
        return self.syncer.sync(iter_buckets(named, 64 * 1024), version=self.version).metrics()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    ckpt = make_tiny_checkpoint(root / "model", arch="llama", seed=0, num_hidden_layers=2)
    extra = ["--weight-sync-timeout-s", str(TIMEOUT_S), "--dtype", "bfloat16", "--custom-weight-loader", DELTA_LOADER]
    logs = root / "logs"
    with (
        running_cpu_engine(ckpt, log_dir=logs, weight_version="0", extra=extra) as e1,
        running_cpu_engine(ckpt, log_dir=logs, weight_version="0", extra=extra) as e2,
    ):
        cfg = SyncConfig(
            backend="gloo",
            join_timeout_s=TIMEOUT_S,
            step_timeout_s=TIMEOUT_S,
            delta=True,
            wire_dtype="bfloat16",
            delta_report_dir=str(root / "reports"),
        )
        group = WeightSyncGroup(
            [EngineEndpoint(e1.url), EngineEndpoint(e2.url)], cfg, master_address="127.0.0.1", control_timeout_s=60
        )
        group.init()
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=cfg)
        try:
            yield Env([e1, e2], group, syncer, TorchDecoder.from_pretrained(ckpt))
        finally:
            group.destroy()


def _step(model: TorchDecoder, seed: int) -> None:
    """An Adam-like step: every element moves by ``STEP``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).sign() * STEP)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _assert_served_bit_identical(env: Env) -> None:
    sent = {n: t.to(torch.bfloat16) for n, t in env.trainer.state_dict().items()}
    for e in env.engines:
        for name, want in sent.items():
            got = post_json(
                e.url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}, timeout_s=30, step="t"
            )
            served = torch.tensor(got, dtype=torch.float32)
            assert torch.equal(served, served.to(torch.bfloat16).float()), f"{e.url} {name}: not held at bf16"
            assert torch.equal(_bits(served.to(torch.bfloat16)), _bits(want)), f"{e.url} serves another {name}"


def test_delta_sync_is_bit_identical_and_sends_less(env: Env):
    first = env.sync()  # nothing sent before: every tensor whole
    assert first["sync/bytes_sent"] == first["sync/bytes_full"] > 0 and "sync/delta_density" not in first
    _assert_served_bit_identical(env)
    for seed in (1, 2):
        _step(env.trainer, seed)
        m = env.sync()
        assert 0 < m["sync/delta_density"] < 0.5 and m["sync/checksum_failures"] == 0
        assert m["sync/bytes_sent"] < 0.8 * m["sync/bytes_full"]
        _assert_served_bit_identical(env)
    for e in env.engines:
        assert get_json(e.url, "/model_info", timeout_s=10, step="t")["weight_version"] == str(env.version)


def test_corrupted_delta_is_caught_by_its_checksum_and_resent_whole(env: Env):
    victim = env.engines[1].url
    hit: list[str] = []

    def flip(url, named):
        if url != victim or hit:
            return named
        out = []
        for n, t in named:
            if n.endswith(".delta_val") and t.numel() and not hit:
                t = t.clone()
                t.view(torch.int16)[0] ^= 0x10  # one flipped bit of one tensor's payload, to one engine
                hit.append(n.removesuffix(".delta_val"))
            out.append((n, t))
        return out

    env.syncer.delta.tamper = flip
    try:
        _step(env.trainer, 3)
        m = env.sync()
    finally:
        env.syncer.delta.tamper = None
    assert hit and m["sync/checksum_failures"] == 1
    assert env.syncer.delta.stats.resent == {victim: hit}
    _assert_served_bit_identical(env)


def test_restarted_engine_gets_a_full_send(env: Env):
    e2 = env.engines[1]
    e2.stop()
    e2.start()  # back to the checkpoint, version "0", no delta base
    env.group.recreate()
    _step(env.trainer, 4)
    m = env.sync()
    whole_one = m["sync/bytes_full"] / 2
    assert m["sync/checksum_failures"] == 0  # its version told the sender: no delta was tried on it
    assert whole_one < m["sync/bytes_sent"] < 2 * whole_one and m["sync/delta_density"] > 0  # one whole, one delta
    _assert_served_bit_identical(env)


def test_an_engine_that_pulled_its_weights_gets_a_full_send(env: Env, tmp_path):
    """A restarted engine caught up by pulling (``sync.catchup = "pull"``) serves the sender's version but its loader
    has no base: the puller tells the sender, so its next sync is whole and no delta fails on it."""
    e2 = env.engines[1]
    e2.stop()
    e2.start()
    store = WeightStore(tmp_path / "weight_store", base_interval=8, keep_bases=2)
    store.put(env.version, {n: t.detach().clone() for n, t in env.trainer.state_dict().items()})
    puller = Puller(store, initial_path="(unused: the store holds a version)", timeout_s=TIMEOUT_S)
    puller.on_pull = env.syncer.delta.forget  # as the leader wires it
    puller.pull(e2.url)
    assert get_json(e2.url, "/model_info", timeout_s=10, step="t")["weight_version"] == env.syncer.delta.version
    env.group.recreate()
    _step(env.trainer, 5)
    m = env.sync()
    whole_one = m["sync/bytes_full"] / 2
    assert m["sync/checksum_failures"] == 0, env.syncer.delta.stats.resent
    assert whole_one < m["sync/bytes_sent"] < 2 * whole_one and m["sync/delta_density"] > 0  # one whole, one delta
    assert not env.syncer.delta.no_base
    _assert_served_bit_identical(env)


def test_update_weights_from_tensor_answers_as_sglang(env: Env):
    """SGLang's surface of the call itself (last here: it loads weights behind the delta sender's back)."""
    from asyncrl.cluster.tensor_payload import serialize_named_tensors
    from asyncrl.engine.blocking import EngineStepError

    url = env.engines[0].url
    x = torch.full((128,), 0.5, dtype=torch.bfloat16)
    body = {"serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", x)])], "load_format": None}

    def call(path, b):
        return post_json(url, path, b, timeout_s=30, step="t", check_success=False)

    with pytest.raises(EngineStepError, match="must run between begin_weight_update.. and end_weight_update") as e:
        call("/update_weights_from_tensor", body)
    assert e.value.status == 400
    call("/begin_weight_update", {})
    try:
        with pytest.raises(EngineStepError, match="Unknown load_format"):
            post_json(url, "/update_weights_from_tensor", {**body, "load_format": "x.y"}, timeout_s=30, step="t")
        ok = call("/update_weights_from_tensor", {**body, "weight_version": "tensor-1"})
        assert ok == {"success": True, "message": "Success Weight version updated to tensor-1."}
    finally:
        call("/end_weight_update", {})
    got = post_json(url, "/get_weights_by_name", {"name": "model.norm.weight"}, timeout_s=30, step="t")
    assert got == [0.5] * 100  # SGLang's default truncate_size
