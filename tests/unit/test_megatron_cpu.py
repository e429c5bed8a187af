"""The CPU shims' version pin (the shims themselves are checked in their own process by
tests/integration/test_megatron_tp.py, since they patch torch.cuda process-wide)."""

import pytest

from asyncrl.cluster import megatron_cpu


def test_version_pin():
    assert megatron_cpu.check_megatron_version() == megatron_cpu.SUPPORTED_MEGATRON_CORE
    with pytest.raises(RuntimeError, match=r"megatron-core==0.15.0 .*pip install megatron-core==0.16.1"):
        megatron_cpu.check_megatron_version("0.15.0")
