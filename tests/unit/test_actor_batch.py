"""Groups -> samples, the DP split, micro-batching and packing (pure)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.actor.batch import (
    groups_to_samples,
    make_microbatches,
    pack,
    pack_uniform,
    split_balanced,
    uniform_shape,
)
from asyncrl.actor.synthetic import synthetic_groups


def test_groups_to_samples_skips_aborted_and_weights_sum_to_one():
    groups = synthetic_groups(seed=1, num_groups=4, group_size=3, vocab_size=500)
    groups[2].aborted = True
    groups[3].trajectories[1].aborted = True
    s = groups_to_samples(groups, normalize_adv_by_std=True, loss_agg_mode="token_mean")
    assert len(s) == 3 + 3 + 2
    assert all(x.advantage == 0.0 for x in s[:3])  # group 0 has equal rewards
    assert abs(sum(sum(x.agg_weight) for x in s) - 1.0) < 1e-9
    for x in s:
        assert len(x.agg_weight) == len(x.loss_mask) == x.response_len
        assert all(w == 0.0 for w, m in zip(x.agg_weight, x.loss_mask) if m == 0)
    s2 = groups_to_samples(groups, normalize_adv_by_std=False, loss_agg_mode="seq_mean_token_mean")
    assert abs(sum(sum(x.agg_weight) for x in s2) - 1.0) < 1e-9


def test_split_balanced_and_microbatches():
    counts = [10, 50, 20, 30, 40, 5]
    parts = split_balanced(counts, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum(counts[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 5
    assert all(p == sorted(p) for p in parts)
    assert split_balanced([3], 2) == [[0], []]
    mbs = make_microbatches([10, 20, 30, 100, 5, 5], 40)
    assert mbs == [[0, 1], [2], [3], [4, 5]]


def test_pack_positions_mask_and_targets():
    # lengths 4, 3, 1: rows of 4 -> [seq0], [seq1, seq2]
    p = pack([[1, 2, 3, 4], [5, 6, 7], [8]], [2, 1, 1])
    assert p.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert p.labels.tolist() == [3, 4, 6, 7]  # in sequence order; seq2 has no response token
    assert p.pred_index.tolist() == [1, 2, 4, 5]  # flat index into the [2, 4] rows
    assert p.seq_of_token.tolist() == [0, 0, 1, 1]
    m = p.attention_mask[:, 0]
    assert m.shape == (2, 4, 4) and m.dtype == torch.bool
    assert not m[1, 2, 0] and m[1, 0, 1] and m[1, 3, 2] and not m[1, 3, 3]  # causal within, blocked across
    assert p.num_tokens == 8


def test_pack_pads_rows():
    p = pack([[1, 2, 3], [4, 5, 6]], [1, 1], row_len=4)
    assert p.input_ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 0]]
    m = p.attention_mask[0, 0]
    assert not m[3, 3] and m[3, 2]  # a padding position sees only itself: no fully masked row
    assert p.pred_index.tolist() == [0, 1, 4, 5]


@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=8),
    st.integers(0, 12),
)
@settings(max_examples=60, deadline=None)
def test_pack_invariants(shapes, row_len):
    seqs, prompt_lens, tok = [], [], 1
    for p, r in shapes:
        seqs.append(list(range(tok, tok + p + r)))
        prompt_lens.append(p)
        tok += p + r
    b = pack(seqs, prompt_lens, row_len=row_len or None)
    flat = b.input_ids.reshape(-1)
    assert b.num_tokens == sum(len(s) for s in seqs)
    assert sorted(t for t in flat.tolist() if t) == list(range(1, tok))  # every token exactly once
    assert b.labels.tolist() == [t for s, p in zip(seqs, prompt_lens) for t in s[p:]]
    assert torch.equal(flat[b.pred_index + 1], b.labels)  # the next position holds the label
    C = b.input_ids.shape[1]
    mask = b.attention_mask[:, 0]
    for s in seqs:
        start = (flat == s[0]).nonzero()[0].item()
        r, c = divmod(start, C)
        for j in range(len(s)):
            visible = (~mask[r, c + j]).nonzero().flatten().tolist()
            assert visible == list(range(c, c + j + 1))  # own earlier tokens only
            assert b.position_ids[r, c + j].item() == j


@given(st.lists(st.integers(1, 500), max_size=40), st.integers(1, 4), st.integers(1, 800))
@settings(max_examples=80, deadline=None)
def test_split_and_microbatch_invariants(counts, parts, budget):
    split = split_balanced(counts, parts)
    assert len(split) == parts and sorted(i for p in split for i in p) == list(range(len(counts)))
    loads = [sum(counts[i] for i in p) for p in split]
    if counts:
        assert max(loads) - min(loads) <= max(counts)  # greedy longest-first bound
    mbs = make_microbatches(counts, budget)
    assert [i for mb in mbs for i in mb] == list(range(len(counts)))  # order kept, nothing lost
    assert all(len(mb) == 1 or sum(counts[i] for i in mb) <= budget for mb in mbs)


def test_pack_uniform_pads_to_one_shape_without_moving_tokens():
    mbs = [([[5, 6, 7, 8, 9], [1, 2]], [2, 1]), ([[3, 4, 5]], [1]), ([[1, 2, 3], [4, 5, 6], [7, 8]], [1, 1, 1])]
    rows, row_len = uniform_shape([seqs for seqs, _ in mbs])
    assert (rows, row_len) == (2, 5)  # the longest sequence; first fit at that length needs 2 rows at most
    packed = pack_uniform(mbs, rows=3, row_len=6)  # a larger agreed shape also works
    for (seqs, pl), p in zip(mbs, packed):
        assert p.input_ids.shape == (3, 6) and p.attention_mask.shape == (3, 1, 6, 6)
        flat = p.input_ids.reshape(-1)
        assert p.labels.tolist() == [t for s, n in zip(seqs, pl) for t in s[n:]]
        # each response token is predicted from the position just before it, in its own sequence
        assert all(flat[i + 1].item() == lab for i, lab in zip(p.pred_index.tolist(), p.labels.tolist()))
        assert p.num_tokens == sum(len(s) for s in seqs)
        # no query row is fully masked (padding rows are their own causal blocks)
        assert not p.attention_mask.all(dim=-1).any()
    assert uniform_shape([]) == (0, 0)


def test_samples_from_wire_arrays_match_samples_from_lists():
    """The broker's zero-copy arrays (uint8 masks longer than 255 tokens included) give the same samples."""
    import numpy as np

    from asyncrl.actor.scatter import flatten, unflatten
    from asyncrl.broker import protocol as P

    groups = synthetic_groups(seed=3, num_groups=3, group_size=2, vocab_size=500)
    long = groups[0].trajectories[0]
    n = 300
    long.response_ids, long.loss_mask, long.rollout_logprobs = list(range(n)), [1] * n, [-0.1] * n
    long.weight_versions = [0] * n  # every token field aligns with the response
    table, frames = P.pack_groups(groups)
    wired = P.unpack_groups(table, frames)
    assert isinstance(wired[0].trajectories[0].loss_mask, np.ndarray)
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        a = groups_to_samples(groups, normalize_adv_by_std=True, loss_agg_mode=mode)
        b = groups_to_samples(wired, normalize_adv_by_std=True, loss_agg_mode=mode)
        if mode != "seq_mean_token_sum":  # that one sums tokens: its weights add up to tokens / sequences
            assert abs(float(sum(x.agg_weight.sum() for x in b)) - 1.0) < 1e-9
        for x, y in zip(a, b):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask)
            assert torch.equal(x.agg_weight, y.agg_weight) and x.advantage == y.advantage
    back = unflatten(*flatten(b))  # what a DP rank receives
    assert [s.tokens.tolist() for s in back] == [s.tokens.tolist() for s in b]
    assert all(torch.equal(s.agg_weight, t.agg_weight) and s.reward == t.reward for s, t in zip(back, b))
    assert unflatten(*flatten([])) == []
