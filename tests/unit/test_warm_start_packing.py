"""The warm start's packed batches give the loss and gradients of the padded layout; its bfloat16 products
give the float32 loss and gradients to bfloat16's precision."""

import random

import torch

from asyncrl.embedded import warm_start as ws
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder


def _loss_and_grads(model, batch, prefix, P, *, packed, grid=(1, 1)):
    if packed:
        rows, gen, valid, seg = ws._pack_rows(batch, P, 0, grid=grid)
    else:
        (rows, gen, valid), seg = ws._pad_rows(batch, P, 0), None
    h_prefix, h_rows = model.hidden_states_shared_prefix(prefix, rows, seg)
    pred = torch.cat((h_prefix[:, -1:].expand(rows.shape[0], -1, -1), h_rows[:, :-1]), dim=1)
    if packed:
        starts = torch.ones_like(seg, dtype=torch.bool)
        starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
        pred = torch.where(starts[..., None], h_prefix[:, -1:], pred)
    loss = ws._weighted_nll(
        model, pred, rows, gen, valid, h_prefix[0, :-1], prefix[1:], rows=len(batch), context_weight=0.3
    )
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def test_packed_rows_equal_padded_rows(tmp_path):
    model = TorchDecoder.from_pretrained(
        make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=2, num_hidden_layers=2)
    )
    rng = random.Random(0)
    P, V = 9, model.config["vocab_size"]
    prefix_ids = [rng.randrange(1, V) for _ in range(P)]
    batch = []
    for _ in range(12):
        n = rng.choice((3, 5, 8, 20))
        batch.append(
            (prefix_ids + [rng.randrange(1, V) for _ in range(n)], [0] * P + [rng.randrange(2) for _ in range(n)])
        )
    ids, _, valid, _ = ws._pack_rows(batch, P, 0)
    assert ids.shape[0] < len(batch) and int(valid.sum()) == sum(len(i) - P for i, _ in batch)
    prefix = torch.tensor(prefix_ids)
    loss_pad, g_pad = _loss_and_grads(model, batch, prefix, P, packed=False)
    for grid in ((1, 1), (4, 32)):  # on the bfloat16 shape grid too (empty rows, more padding)
        if grid != (1, 1):
            ids, _, valid, _ = ws._pack_rows(batch, P, 0, grid=grid)
            assert ids.shape[0] % 4 == 0 and ids.shape[1] % 32 == 0
            assert int(valid.sum()) == sum(len(i) - P for i, _ in batch)
        loss_pack, g_pack = _loss_and_grads(model, batch, prefix, P, packed=True, grid=grid)
        assert abs(loss_pad.item() - loss_pack.item()) <= 1e-5 * abs(loss_pad.item())
        for a, b in zip(g_pack, g_pad, strict=True):
            assert (a - b).abs().max() <= 2e-5 * b.abs().max()


def test_bfloat16_products_match_float32(tmp_path):
    """``prepare.sft_matmul_dtype = "bfloat16"``: the same loss to 1% and gradients pointing the same way
    (cosine > 0.99 per parameter) as float32 on a batch of the packed layout; the weights stay float32."""
    model = TorchDecoder.from_pretrained(
        make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=3, num_hidden_layers=2)
    )
    rng = random.Random(1)
    P, V = 7, model.config["vocab_size"]
    prefix_ids = [rng.randrange(1, V) for _ in range(P)]
    batch = [
        (prefix_ids + [rng.randrange(1, V) for _ in range(n)], [0] * P + [rng.randrange(2) for _ in range(n)])
        for n in (4, 9, 15, 30, 6, 11)
    ]
    prefix = torch.tensor(prefix_ids)
    params = list(model.parameters())
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        loss = ws._batch_loss(model, batch, prefix, pad=0, context_weight=0.3, dtype=dt)
        assert loss.dtype == torch.float32
        out[dt] = (loss.item(), torch.autograd.grad(loss, params))
    (l32, g32), (l16, g16) = out[torch.float32], out[torch.bfloat16]
    assert l16 != l32  # the products really ran in bfloat16
    assert abs(l16 - l32) <= 0.01 * abs(l32)
    for a, b in zip(g16, g32, strict=True):
        assert a.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    assert ws.matmul_dtype("float32") == torch.float32 and ws.matmul_dtype("bfloat16") == torch.bfloat16
