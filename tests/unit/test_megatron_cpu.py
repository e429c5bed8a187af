"""The CPU shims' version pin (the shims themselves are checked in their own process by
tests/integration/test_megatron_tp.py, since they patch torch.cuda process-wide)."""

import pytest

from asyncrl.cluster import megatron_cpu


def test_version_pin():
    assert megatron_cpu.check_megatron_version() == megatron_cpu.SUPPORTED_MEGATRON_CORE
    with pytest.raises(RuntimeError, match=r"megatron-core==0.15.0 .*pip install megatron-core==0.16.1"):
        megatron_cpu.check_megatron_version("0.15.0")


def test_schedule_torch_proxy_puts_cuda_factories_on_cpu():
    """Shim 4 (the pipeline schedules' `device="cuda"` counter), checked without patching anything."""
    import torch

    proxy = megatron_cpu._TorchWithCpuFactories()
    t = proxy.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu" and t.dtype == torch.int and t.item() == 0
    assert proxy.empty(2, 3, device=torch.device("cuda", 0)).shape == (2, 3)
    assert proxy.Tensor is torch.Tensor and proxy.cat is torch.cat  # everything else is torch itself


@pytest.mark.parametrize("exact_mapping", [False, True])
def test_packed_rope_frequencies_are_megatrons_per_segment_slices(exact_mapping):
    """Shim 6: one gather gives the frequencies Megatron's thd RoPE slices segment by segment (cp = 1)."""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    freqs = torch.randn(16 if exact_mapping else 9, 1, 1, 8)
    t = torch.zeros(16, 2, 8)
    want = torch.cat(
        [
            _get_thd_freqs_on_this_cp_rank(0, 1, x, freqs, int(cu[i]) if exact_mapping else 0)
            for i, x in enumerate(torch.split(t, (cu[1:] - cu[:-1]).tolist()))
        ]
    )
    got = megatron_cpu.freqs_of_packed_positions(cu, freqs)
    assert got.shape == want.shape and torch.equal(got, want)


def test_packed_rope_is_megatrons_thd_rope_bit_for_bit_with_its_gradient():
    """Shim 6 against megatron-core's own unfused thd RoPE: same output and input gradient, bit for bit,
    also on the cached second call (the next layer) and after the packed batch changes."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    original = getattr(rope_utils._apply_rotary_pos_emb_thd, "megatron", rope_utils._apply_rotary_pos_emb_thd)
    ours = megatron_cpu.packed_rope_thd(original)
    group = type("OneRankGroup", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    g = torch.Generator().manual_seed(0)
    freqs = torch.randn(9, 1, 1, 8, generator=g)
    for cu in (torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32), torch.tensor([0, 9, 12], dtype=torch.int32)):
        for _ in range(2):
            t = torch.randn(int(cu[-1]), 3, 8, generator=g, requires_grad=True)
            w = torch.randn(t.shape, generator=g)
            want = original(t, cu, freqs, cp_group=group)
            got = ours(t, cu, freqs, cp_group=group)
            assert torch.equal(got, want)
            assert torch.equal(torch.autograd.grad((got * w).sum(), t)[0], torch.autograd.grad((want * w).sum(), t)[0])
