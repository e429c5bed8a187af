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
