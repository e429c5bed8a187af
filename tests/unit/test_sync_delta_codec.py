"""The delta codec (asyncrl.sync.delta): exact round trips at the bit level, the cases that go full, and the
checksum catching a corrupted delta or a wrong base."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.sync import delta as D


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(D._INT_VIEWS[t.element_size()])


def _changed(old: torch.Tensor, frac: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=g)[: int(frac * old.numel())]
    flat = new.view(-1)
    flat[idx] = (flat[idx].float() * 1.5 + 0.25).to(old.dtype)
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(dtype):
    old = torch.randn(64, 33).to(dtype)
    new = _changed(old, 0.05)
    d = D.encode(old, new, max_density=0.5)
    assert d is not None and 0 < d.density <= 0.05 and d.values.dtype == dtype
    out = D.apply(old, d, name="w")
    assert torch.equal(_bits(out), _bits(new)) and out.shape == new.shape
    assert not torch.equal(_bits(old), _bits(new))  # apply leaves the base alone


def test_signed_zero_and_nan_payloads_are_exact():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0] * 20, dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # equal as floats, different bits
    nan2 = _bits(old)[2] | 1  # another NaN payload
    _bits(new)[2] = nan2
    d = D.encode(old, new, max_density=0.5)
    assert d is not None and d.count == 2
    assert torch.equal(_bits(D.apply(old, d, name="w")), _bits(new))
    same = D.encode(old, old.clone(), max_density=0.5)  # a NaN equals itself bitwise: nothing changed
    assert same is not None and same.count == 0 and torch.equal(_bits(D.apply(old, same, name="w")), _bits(old))


def test_goes_full_when_it_does_not_pay():
    old = torch.randn(1000).to(torch.bfloat16)
    assert D.encode(old, _changed(old, 0.3), max_density=0.2) is None  # over max_density
    assert D.encode(old, (old.float() + 1000).to(old.dtype), max_density=1.0) is None  # every element: not smaller
    assert D.encode(old, old.float(), max_density=1.0) is None  # dtype differs
    assert D.encode(old, old.view(10, 100), max_density=1.0) is None  # shape differs


def test_index_is_compact():
    old = torch.randn(1 << 20).to(torch.bfloat16)
    new = _changed(old, 0.03)
    d = D.encode(old, new, max_density=0.5)
    assert len(d.index) < d.count * 1.2  # ~1 byte a gap at 3% (int32 would be 4)
    assert d.nbytes < 0.1 * old.numel() * 2


def test_varint_large_gaps_round_trip():
    gaps = np.array([1, 127, 128, 16383, 16384, 2**31 + 5, 2**62], np.int64)
    assert np.array_equal(D._unvarint(D._varint(gaps)), gaps)
    with pytest.raises(ValueError, match="ends inside"):
        D._unvarint(D._varint(gaps)[:-1])


def test_corrupted_value_is_caught_and_named():
    old = torch.randn(256).to(torch.bfloat16)
    d = D.encode(old, _changed(old, 0.1), max_density=0.5)
    named = D.to_tensors(d, "model.norm.weight")
    _bits(named["model.norm.weight.delta_val"])[0] ^= 1  # flip one bit in flight
    with pytest.raises(D.ChecksumError, match="model.norm.weight") as e:
        D.apply(old, D.from_tensors(named, "model.norm.weight"), name="model.norm.weight")
    assert e.value.name == "model.norm.weight"


def test_corrupted_index_and_wrong_base_are_caught():
    old = torch.randn(4096).to(torch.bfloat16)
    d = D.encode(old, _changed(old, 0.02), max_density=0.5)
    bad = D.Delta(d.shape, bytes(b ^ 0x55 for b in d.index), d.values, d.compressed, d.checksum)
    with pytest.raises(D.ChecksumError, match="'w'"):
        D.apply(old, bad, name="w")
    with pytest.raises(D.ChecksumError, match="checksum"):
        D.apply(_changed(old, 0.01, seed=7), d, name="w")  # a base the delta was not made against
    with pytest.raises(D.ChecksumError, match="does not fit"):
        D.apply(old.float(), d, name="w")


def test_checksum_covers_dtype_shape_and_bytes():
    t = torch.randn(8, 4).to(torch.bfloat16)
    assert D.checksum(t) == D.checksum(t.clone()) and len(D.checksum(t)) == 16
    assert D.checksum(t) != D.checksum(t.view(4, 8))
    assert D.checksum(t) != D.checksum(t.view(torch.float16))
    assert D.checksum(t.t()) == D.checksum(t.t().contiguous())


def test_safetensors_round_trip(tmp_path):
    old = torch.randn(300, 7).to(torch.bfloat16)
    new = _changed(old, 0.04)
    named = D.to_tensors(D.encode(old, new, max_density=0.5), "a.b")
    save_file(named, tmp_path / "d.safetensors")
    back = D.from_tensors(load_file(tmp_path / "d.safetensors"), "a.b")
    assert torch.equal(_bits(D.apply(old, back, name="a.b")), _bits(new))
    with pytest.raises(D.ChecksumError, match="missing"):
        D.from_tensors({}, "a.b")


def test_unchanged_tensor_is_an_empty_delta_that_still_checks():
    old = torch.randn(50).to(torch.bfloat16)
    d = D.from_tensors(D.to_tensors(D.encode(old, old.clone(), max_density=0.5), "n"), "n")
    assert d.count == 0 and d.nbytes == 0
    assert torch.equal(_bits(D.apply(old, d, name="n")), _bits(old))
    with pytest.raises(D.ChecksumError, match="'n'"):
        D.apply(_changed(old, 0.1), d, name="n")
