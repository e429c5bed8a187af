"""The CPU shims: version pin, and the scoped cuda->cpu rewriting Megatron's optimizer needs."""

import pytest
import torch

from asyncrl.cluster import megatron_cpu


def test_version_pin():
    assert megatron_cpu.check_megatron_version() == megatron_cpu.SUPPORTED_MEGATRON_CORE
    with pytest.raises(RuntimeError, match=r"megatron-core==0.15.0 .*pip install megatron-core==0.16.1"):
        megatron_cpu.check_megatron_version("0.15.0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
def test_shims_on_cpu():
    assert megatron_cpu.apply_cpu_shims() is True
    assert megatron_cpu.apply_cpu_shims() is True  # idempotent
    assert torch.cuda.current_device() == "cpu"
    # The "CUDA" RNG is the CPU generator: the tracker's fork restores it.
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 11)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        x = torch.rand(3)
    assert torch.equal(before, torch.get_rng_state())
    torch.manual_seed(11)
    assert torch.equal(x, torch.rand(3))  # drawn from the seed-11 state
    with tracker.fork("a"):
        y = torch.rand(3)
    assert not torch.equal(x, y)  # the tracked state advanced

    from megatron.core.transformer.utils import get_default_causal_mask

    m = get_default_causal_mask(4)
    assert m.device.type == "cpu" and m.dtype == torch.bool and m[0, 1] and not m[1, 0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
def test_cuda_as_cpu_scope():
    megatron_cpu.apply_cpu_shims()
    with megatron_cpu.cuda_as_cpu():
        t = torch.zeros(2, device="cuda")
        u = torch.tensor([1.0], dtype=torch.float, device="cuda")
        assert t.device.type == "cpu" and u.device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.is_cuda
    assert t.type() == "torch.FloatTensor"  # outside the scope: untouched
    assert not t.is_cuda
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
