"""The warm start's bucketed batches give the loss and gradients of one padded row per sequence; its bfloat16
products give the float32 loss and gradients to bfloat16's precision."""

import random

import torch

from asyncrl.embedded import warm_start as ws
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder


def _padded_loss_and_grads(model, batch, prefix, P):
    """The reference: every sequence in its own row of one padded batch, run whole."""
    rows, gen, valid = ws._pad_rows(batch, P, 0)
    h_prefix, h_rows = model.hidden_states_shared_prefix(prefix, rows)
    pred = torch.cat((h_prefix[:, -1:].expand(rows.shape[0], -1, -1), h_rows[:, :-1]), dim=1)
    loss = ws._weighted_nll(
        model,
        pred[valid],
        rows[valid],
        gen_V=gen[valid],
        pred_prefix_PH=h_prefix[0, :-1],
        prefix_targets_P=prefix[1:],
        rows=len(batch),
        context_weight=0.3,
    )
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def test_bucketed_rows_equal_padded_rows(tmp_path):
    model = TorchDecoder.from_pretrained(
        make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=2, num_hidden_layers=2)
    )
    rng = random.Random(0)
    P, V = 9, model.config["vocab_size"]
    prefix_ids = [rng.randrange(1, V) for _ in range(P)]
    batch = []
    for _ in range(ws.ROWS_PER_BUCKET + 5):  # two buckets, the second not full
        n = rng.choice((3, 5, 8, 20))
        batch.append(
            (prefix_ids + [rng.randrange(1, V) for _ in range(n)], [0] * P + [rng.randrange(2) for _ in range(n)])
        )
    prefix = torch.tensor(prefix_ids)
    loss_pad, g_pad = _padded_loss_and_grads(model, batch, prefix, P)
    useful = sum(len(i) - P for i, _ in batch)
    for grid in ((1, 1), ws.SHAPE_GRID):  # the bfloat16 shape grid adds empty rows and padding, no token
        buckets, gen, valid, start = ws._bucket_rows(batch, P, 0, grid=grid)
        assert len(buckets) == 2 and int(valid.sum()) == useful
        assert int(start.sum()) == sum(b.shape[0] for b in buckets)
        assert all(b.shape[0] % grid[0] == 0 and b.shape[1] % grid[1] == 0 for b in buckets)
    # sorted by length: the first bucket holds the shortest sequences, padded only to their own longest
    assert ws._bucket_rows(batch, P, 0)[0][0].shape[1] == sorted(len(i) - P for i, _ in batch)[ws.ROWS_PER_BUCKET - 1]
    loss = ws._batch_loss(model, batch, prefix, pad=0, context_weight=0.3)
    g = torch.autograd.grad(loss, list(model.parameters()))
    assert abs(loss_pad.item() - loss.item()) <= 1e-5 * abs(loss_pad.item())
    for a, b in zip(g, g_pad, strict=True):
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()


def test_bfloat16_products_match_float32(tmp_path):
    """``prepare.sft_matmul_dtype = "bfloat16"``: the same loss to 1% and gradients pointing the same way
    (cosine > 0.99 per parameter) as float32 on a bucketed batch; the weights stay float32."""
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
