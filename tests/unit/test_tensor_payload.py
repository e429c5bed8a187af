"""Payloads of ``/update_weights_from_tensor`` by value (asyncrl.cluster.tensor_payload)."""

import base64
import pickle

import pytest
import torch

from asyncrl.cluster.tensor_payload import (
    PACK_DATA,
    PayloadError,
    deserialize_named_tensors,
    pack_named_tensors,
    serialize_named_tensors,
    unpack_named_tensors,
)


def _named():
    base = torch.randn(6, 5)
    return [
        ("a", base.to(torch.bfloat16)[1:4]),  # a view: travels alone, not its base
        ("b", torch.arange(7, dtype=torch.int64)),
        ("c", torch.tensor(3.5)),
        ("d", torch.zeros(0, dtype=torch.uint8)),
    ]


def _same(x, y):
    assert [n for n, _ in x] == [n for n, _ in y]
    for (_, s), (_, t) in zip(x, y):
        assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t)


def test_round_trips_by_value_and_packed():
    named = _named()
    _same(deserialize_named_tensors(serialize_named_tensors(named)), named)
    packed = deserialize_named_tensors(serialize_named_tensors([*pack_named_tensors(named), ("x", torch.ones(2))]))
    assert len(packed) == 3
    _same(unpack_named_tensors(packed), [*named, ("x", torch.ones(2))])
    assert unpack_named_tensors(named) == named  # nothing packed: the identity


def test_refuses_what_is_not_a_list_of_named_tensors():
    with pytest.raises(PayloadError, match="refused global"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps(print)).decode())
    with pytest.raises(PayloadError, match="not a list"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps({"a": 1})).decode())
    with pytest.raises(PayloadError, match="unreadable"):
        deserialize_named_tensors("not base64!")
    short = [(n, t[:3] if n == PACK_DATA else t) for n, t in pack_named_tensors(_named())]
    with pytest.raises(PayloadError, match="packed"):
        unpack_named_tensors(short)
