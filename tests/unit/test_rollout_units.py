"""Pure parts of the rollout package: sampling-param validation, command builders, parsers, and
the CPU model's parity with HF transformers (in process, no server)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.config.schema import Config, RolloutConfig, SGLangConfig
from asyncrl.cpu_engine.sampling_params import RequestError, parse_sampling_params
from asyncrl.engine.client import (
    EngineError,
    _server_message,
    confirms_weight_version,
    parse_generate_response,
    parse_prometheus,
)
from asyncrl.engine.launch import cpu_engine_command, engine_command, engine_port, sglang_command

LOGPROB_REL = 1e-5  # float32 log-prob parity, relative to the largest |log-prob| (see the parity test)


def test_sampling_params_unknown_and_bad_values_name_the_key():
    p = parse_sampling_params({"max_new_tokens": 3, "temperature": 0, "stop": "x", "stop_token_ids": [5]})
    assert p.greedy and p.stop == ("x",) and p.stop_token_ids == (5,)
    with pytest.raises(RequestError, match="bogus"):
        parse_sampling_params({"bogus": 1})
    with pytest.raises(RequestError, match="top_p"):
        parse_sampling_params({"top_p": 0})
    with pytest.raises(RequestError, match="regex"):
        parse_sampling_params({"regex": "a+"})
    assert parse_sampling_params({"regex": None, "frequency_penalty": 0.0}).max_new_tokens == 128


def _cfg(**rollout) -> Config:
    r = RolloutConfig(
        model_path="/m",
        max_running_requests=32,
        tensor_parallel_size=2,
        port=30000,
        sglang=SGLangConfig(mem_fraction_static=0.7, extra_args=["--log-level", "warning"]),
        **rollout,
    )
    return dataclasses.replace(Config(), rollout=r)


def test_sglang_command_from_config_without_sglang_installed():
    cmd = sglang_command(_cfg(), port=30010, base_gpu_id=8, host="0.0.0.0", python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    flags = {a: cmd[i + 1] for i, a in enumerate(cmd) if a.startswith("--") and i + 1 < len(cmd)}
    assert flags["--model-path"] == "/m" and flags["--tp-size"] == "2" and flags["--base-gpu-id"] == "8"
    assert flags["--port"] == "30010" and flags["--mem-fraction-static"] == "0.7"
    assert flags["--max-running-requests"] == "32" and flags["--weight-version"] == "0"
    assert flags["--random-seed"] == str(Config().runner.seed)
    assert "--enable-metrics" in cmd and cmd[-2:] == ["--log-level", "warning"]
    assert engine_port(_cfg(), 2) == 30020


def test_cpu_command_selected_by_backend():
    cfg = _cfg(rollout_backend="cpu")
    cmd = engine_command(cfg, port=31000, python="py")
    assert cmd == cpu_engine_command(cfg, port=31000, python="py")
    assert cmd[:3] == ["py", "-m", "asyncrl.cpu_engine.server"] and "--max-running-requests" in cmd
    assert "sglang.launch_server" in engine_command(_cfg(), port=1, python="py")


def test_prometheus_and_generate_parsers():
    text = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"} 3.0\n'
        'sglang:num_running_reqs{tp_rank="1"} 1.0\nsglang:cache_hit_rate{a="b"} 0.5\n'
        'sglang:cache_hit_rate{a="c"} 0.25\nsglang:generation_tokens_total 12\nother_metric 9\n'
    )
    m = parse_prometheus(text)
    assert m == {"num_running_reqs": 4.0, "cache_hit_rate": 0.375, "generation_tokens_total": 12.0}
    r = parse_generate_response(
        {
            "text": "a",
            "output_ids": [4, 5],
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "length", "length": 2},
                "weight_version": "3",
                "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}],
                "output_token_logprobs": [[-0.5, 4, None], [-1.5, 5, None]],
                "num_retractions": 1,
            },
        }
    )
    assert r.output_logprobs == [-0.5, -1.5] and r.versions == ["2", "3"] and not r.aborted
    assert _server_message('{"error": {"message": "boom"}}') == "boom"
    assert _server_message('{"success": false, "message": "nope"}') == "nope"
    validation = '{"object": "error", "message": "body.mode: bad", "type": "Bad Request", "param": null, "code": 400}'
    assert _server_message(validation) == "body.mode: bad"  # SGLang's validation 400
    assert _server_message('{"error": "unknown field `foo`"}') == "unknown field `foo`"  # its /generate contract check
    assert _server_message('{"detail": "Not Found"}') == "Not Found"
    e = EngineError("http://h:1", "/generate", "boom", 400)
    assert "http://h:1/generate" in str(e) and "400" in str(e) and e.message == "boom"


def test_update_answer_confirms_the_weight_version():
    """SGLang's answer to an update that set ``weight_version`` (its message), and what must not count."""
    ok = {"success": True, "message": "Succeeded to update parameter online. Weight version updated to 7."}
    assert confirms_weight_version(ok, "7")
    assert not confirms_weight_version(ok, "17") and not confirms_weight_version(ok, "8")
    assert not confirms_weight_version({**ok, "success": False}, "7")
    assert not confirms_weight_version({"success": True, "message": "Succeeded to update parameter online."}, "7")
    assert not confirms_weight_version({"text": "Weight version updated to 7."}, "7") and not confirms_weight_version(
        None, "7"
    )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cpu_model_matches_transformers(tmp_path, arch):
    """Prompt log-probs, and a mixed batch (a decode row, a cached continuation, a shorter fresh request), match HF
    within 1e-5 of the log-probs' scale."""
    transformers = pytest.importorskip("transformers")
    from asyncrl.cpu_engine.model import KVPool, load_model

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)  # HF's random init too: the same weights on every run
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=5000.0)
        hf = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True)
        hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():  # random, non-trivial norms and biases too
            p.add_(0.1 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    kv = KVPool(model.spec, max_rows=3)
    full = torch.log_softmax(model.logits(model.forward(ids[0], torch.tensor([0]), torch.tensor([24]), kv, row0=0)), -1)
    # log-probs reach about -20 here; float32 rounding grows with that scale and differs between processors and
    # kernels: allow LOGPROB_REL x max|ref| (measured worst |diff| 1.2e-5 = 6e-7 of the scale, default and avx2)
    tol = LOGPROB_REL * ref.abs().max().item()
    assert (full - ref).abs().max().item() < tol
    # one mixed batch (decode rows lead): row 0 decodes token 17 after 17 cached, row 1 continues with 14 tokens
    # after a prefix of 10, row 2 is a shorter fresh request (rows 1 and 2 attend as a padded block)
    model.forward(ids[0, :17], torch.tensor([0]), torch.tensor([17]), kv, row0=0)
    model.forward(ids[0, :10], torch.tensor([0]), torch.tensor([10]), kv, row0=1)
    other = ids[:, 3:9]
    toks = torch.cat((ids[0, 17:18], ids[0, 10:], other[0]))
    h = model.forward(toks, torch.tensor([17, 10, 0]), torch.tensor([1, 14, 6]), kv, row0=0)
    assert h.shape == (21, 64)
    assert (torch.log_softmax(model.logits(h[0]), -1) - ref[17]).abs().max().item() < tol
    assert (torch.log_softmax(model.logits(h[1:15]), -1) - ref[10:]).abs().max().item() < tol
    with torch.no_grad():
        ref_other = torch.log_softmax(hf(other).logits[0].float(), -1)
    other_tol = LOGPROB_REL * ref_other.abs().max().item()
    assert (torch.log_softmax(model.logits(h[15:]), -1) - ref_other).abs().max().item() < other_tol
    # last_only (the engine's sampling path): the same batch again (it rewrites the same KV) gives each row's last
    # token alone, equal to the full forward's
    h_last = model.forward(toks, torch.tensor([17, 10, 0]), torch.tensor([1, 14, 6]), kv, row0=0, last_only=True)
    assert h_last.shape == (3, 64)
    assert torch.allclose(h_last, h[[0, 14, 20]], atol=1e-5)


def test_decode_attention_matches_a_per_row_reference(tmp_path):
    """The batched one-query attention (rows of different lengths, grouped-query heads, the additive -inf bias of
    ``_plan``) equals softmax(q k^T) v computed row by row over each row's own keys; the cache beyond a row's length
    holds garbage (a previous occupant's KV), which must not leak in."""
    transformers = pytest.importorskip("transformers")
    from asyncrl.cpu_engine.model import KVPool, load_model

    cfg = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    s = model.spec
    nh, nkv, d = s.num_attention_heads, s.num_query_groups, s.head_dim
    g = torch.Generator().manual_seed(0)
    kv = KVPool(s, max_rows=6)
    kc, vc = kv.k[0], kv.v[0]
    kc.copy_(torch.randn(kc.shape, generator=g) * 3)
    vc.copy_(torch.randn(vc.shape, generator=g))
    past_B = torch.tensor([7, 0, 12, 3, 9])  # rows 1..5 of the pool (row0 = 1), each decoding one token
    R = past_B.shape[0]
    plan = model._plan(past_B, torch.ones(R, dtype=torch.long), kv, row0=1, last_only=False)
    assert plan.num_decode == R and plan.dec_L == 13
    q_RHd = torch.randn(R, nh, d, generator=g)
    got = model._one_query(q_RHd, kc, vc, r0=1, L=plan.dec_L, bias_R11L=plan.dec_bias)
    want = torch.empty(R, nh, d)
    for b in range(R):
        n = int(past_B[b]) + 1  # the cached keys and the new token's own
        for h in range(nh):
            keys, vals = kc[1 + b, h // (nh // nkv), :n], vc[1 + b, h // (nh // nkv), :n]
            want[b, h] = torch.softmax(q_RHd[b, h] @ keys.T, dim=-1) @ vals
    assert got.shape == (R, nh * d)
    assert torch.allclose(got, want.view(R, nh * d), atol=1e-5, rtol=1e-5)


def test_prefix_cache_matches_a_brute_force_lru():
    """The head-indexed prefix cache gives what a scan of every entry gives: the longest common prefix (of at
    least MIN_PREFIX_TOKENS tokens, capped at the limit), the least recently used of equal ones, the same LRU
    evictions (by tokens and by entries), across inserts, hits, evictions and a clear."""
    import collections
    import random

    from asyncrl.cpu_engine.prefix_cache import MAX_PREFIX_ENTRIES, MIN_PREFIX_TOKENS, PrefixCache, common_prefix_len

    rng = random.Random(0)
    for _ in range(300):
        a = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        b = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == want
    cache, ref = PrefixCache(max_tokens=3000), collections.OrderedDict()
    heads = [tuple(rng.randrange(50) for _ in range(MIN_PREFIX_TOKENS)) for _ in range(3)]
    for step in range(3000):
        toks = list(rng.choice(heads)) + [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.3:
            toks[rng.randrange(len(toks))] = 99  # sometimes the head itself differs
        if step == 2000:
            cache.clear()
            ref.clear()
        if rng.random() < 0.5:
            key = tuple(toks)
            marker = torch.tensor([step])
            cache.insert(key, marker, marker)
            if MIN_PREFIX_TOKENS <= len(key) and key not in ref:
                ref[key] = marker
                while sum(map(len, ref)) > 3000 or len(ref) > MAX_PREFIX_ENTRIES:
                    ref.popitem(last=False)
        else:
            limit = rng.randrange(len(toks) + 1)
            best, best_key = 0, None
            for key in ref:
                lcp = common_prefix_len(key, tuple(toks[:limit]))
                if lcp > best:
                    best, best_key = lcp, key
            if best < MIN_PREFIX_TOKENS:
                best, best_key = 0, None
            hit, kv = cache.lookup(toks, limit)
            assert hit == best
            if best_key is None:
                assert kv is None
            else:
                assert kv[0] is ref[best_key]
                ref.move_to_end(best_key)
        assert list(cache.entries) == list(ref)
        assert cache.tokens == sum(map(len, ref))
