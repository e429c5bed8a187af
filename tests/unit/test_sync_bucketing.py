"""Bucketing and flattened-bucket packing for the weight sync (pure)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.sync.bucketing import (
    FLATTENED_BUCKET,
    LastBucket,
    bucket_meta,
    byte_ranges,
    dtype_from_name,
    dtype_name,
    flat_nbytes,
    flatten_bucket,
    iter_buckets,
    tensor_nbytes,
    unflatten_bucket,
    update_request,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _named(shapes_dtypes):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        out.append((f"model.layers.{i}.w", t))
    return out


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=12),
    bucket_bytes=st.integers(min_value=1, max_value=200),
)
def test_buckets_keep_order_and_respect_limit(sizes, bucket_bytes):
    named = [(f"p{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]
    buckets = list(iter_buckets(named, bucket_bytes))
    flat = [name for b in buckets for name, _ in b]
    assert flat == [n for n, _ in named]  # every tensor once, in order
    for b in buckets:
        assert b
        total = sum(tensor_nbytes(t) for _, t in b)
        assert total <= bucket_bytes or len(b) == 1  # only an oversized tensor travels alone
    # greedy: a bucket could not have taken the next bucket's first tensor
    for a, b in zip(buckets, buckets[1:]):
        assert sum(tensor_nbytes(t) for _, t in a) + tensor_nbytes(b[0][1]) > bucket_bytes
    # the final bucket, and only it, says so (its update call carries the new weight version)
    assert [isinstance(b, LastBucket) for b in buckets] == [False] * (len(buckets) - 1) + [True] * bool(buckets)


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([("a", torch.zeros(1))], 0))


def test_flatten_roundtrip_mixed_dtypes():
    bucket = _named(
        [
            ((3, 5), torch.float32),
            ((7,), torch.bfloat16),
            ((2, 2, 2), torch.int64),
            ((0,), torch.float32),
            ((), torch.float16),
            ((4, 3), torch.uint8),
        ]
    )
    meta = bucket_meta(bucket)
    assert meta.dtypes == ("float32", "bfloat16", "int64", "float32", "float16", "uint8")
    assert meta.shapes[0] == (3, 5) and meta.shapes[4] == ()
    flat = flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.numel() == flat_nbytes(meta) == sum(tensor_nbytes(t) for _, t in bucket)
    back = unflatten_bucket(flat.clone(), meta)
    assert [n for n, _ in back] == list(meta.names)
    for (n0, t0), (n1, t1) in zip(bucket, back):
        assert n0 == n1 and t0.dtype == t1.dtype and t0.shape == t1.shape
        assert torch.equal(t0, t1)
    # byte ranges are contiguous, unpadded
    ranges = byte_ranges(meta)
    assert ranges[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_flatten_noncontiguous_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous view
    back = unflatten_bucket(flatten_bucket([("w", t)]), bucket_meta([("w", t)]))
    assert torch.equal(back[0][1], t)


def test_unflatten_rejects_wrong_size():
    bucket = _named([((4,), torch.float32)])
    with pytest.raises(ValueError, match="bytes"):
        unflatten_bucket(torch.zeros(15, dtype=torch.uint8), bucket_meta(bucket))


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        bucket_meta([("a", torch.zeros(1)), ("a", torch.zeros(2))])


def test_dtype_names_roundtrip():
    for d in DTYPES:
        assert dtype_from_name(dtype_name(d)) is d
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="complex64"):
        dtype_name(torch.complex64)


def test_update_request_body():
    bucket = _named([((2, 3), torch.bfloat16), ((5,), torch.float32)])
    body = update_request(bucket_meta(bucket), group_name="g", flush_cache=False, flattened=True)
    assert body == {
        "names": ["model.layers.0.w", "model.layers.1.w"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [5]],
        "group_name": "g",
        "flush_cache": False,
        "weight_version": None,
        "load_format": FLATTENED_BUCKET,
    }
    plain = update_request(bucket_meta(bucket), group_name="g", flush_cache=True, flattened=False)
    assert plain["load_format"] is None and plain["flush_cache"] is True
