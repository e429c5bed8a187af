"""vocab_parallel_logprobs at TP=1: padding columns excluded, temperature, gradients."""

import torch

from asyncrl.actor.logprobs import vocab_parallel_logprobs


def test_matches_log_softmax_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 12, generator=g)
    labels = torch.tensor([0, 3, 9, 9, 1])
    padded = torch.cat([z, torch.full((5, 4), 3.0)], dim=-1)  # 4 padded vocab columns with big logits
    for temp in (1.0, 0.7):
        lp, ent = vocab_parallel_logprobs(padded, labels, vocab_start=0, true_vocab=12, temperature=temp)
        ref = torch.log_softmax(z / temp, -1)
        torch.testing.assert_close(lp, ref.gather(-1, labels[:, None])[:, 0])
        torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def test_gradient_matches_autograd_reference():
    z = torch.randn(3, 8, requires_grad=True)
    labels = torch.tensor([1, 2, 7])
    lp, ent = vocab_parallel_logprobs(z, labels, vocab_start=0, true_vocab=8)
    (lp.sum() + 0.1 * ent.sum()).backward()
    g1 = z.grad.clone()
    z.grad = None
    ref = torch.log_softmax(z, -1)
    (ref.gather(-1, labels[:, None]).sum() + 0.1 * (-(ref.exp() * ref).sum())).backward()
    torch.testing.assert_close(g1, z.grad)


def test_gradient_with_padding_temperature_and_without_entropy():
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(6, 10, generator=g) * 3
    labels = torch.tensor([0, 9, 4, 4, 2, 7])
    w_lp, w_ent = torch.randn(6, generator=g), torch.randn(6, generator=g)
    padded = torch.cat([z0, torch.full((6, 6), 5.0)], dim=-1)
    for with_entropy in (True, False):
        z = padded.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(
            z, labels, vocab_start=0, true_vocab=10, temperature=0.8, with_entropy=with_entropy
        )
        assert (ent is None) == (not with_entropy)
        ((lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)).backward()
        zr = z0.clone().requires_grad_(True)
        ref = torch.log_softmax(zr / 0.8, -1)
        ref_lp = ref.gather(-1, labels[:, None])[:, 0]
        ref_ent = -(ref.exp() * ref).sum(-1)
        torch.testing.assert_close(lp, ref_lp)
        ((ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0.0)).backward()
        torch.testing.assert_close(z.grad[:, :10], zr.grad)
        assert torch.all(z.grad[:, 10:] == 0)  # padded vocabulary columns get no gradient
