"""The warm start's packed batches give the loss and gradients of the padded layout."""

import random

import torch

from asyncrl.embedded import warm_start as ws
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder


def _loss_and_grads(model, batch, prefix, P, *, packed):
    if packed:
        rows, gen, valid, seg = ws._pack_rows(batch, P, 0)
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
    loss_pack, g_pack = _loss_and_grads(model, batch, prefix, P, packed=True)
    assert abs(loss_pad.item() - loss_pack.item()) <= 1e-5 * abs(loss_pad.item())
    for a, b in zip(g_pack, g_pad, strict=True):
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()
