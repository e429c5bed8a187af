"""Tiny HF-format checkpoints with random weights, for tests and CPU runs.

``python -m asyncrl.models.tiny --out DIR [--corpus FILE] [--arch qwen2|llama|qwen3|qwen3_moe] [--seed S]``
writes ``config.json``, ``model.safetensors`` (HF parameter names), ``tokenizer.json`` (byte-level
BPE trained with ``tokenizers`` on the corpus or on a built-in text), ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json``. The result loads with
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and with the actor's converter.
``qwen3_moe`` is a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``): 8 experts of width 64, top-2, renormalised top-k
probabilities, every layer sparse; its experts are stored one by one (``mlp.experts.<e>.{gate,up,down}_proj``,
the layout of the published Qwen3-MoE checkpoints and of ``save_pretrained``) beside the router ``mlp.gate``.

Python API::

    from asyncrl.models.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "tiny", arch="qwen2", seed=0, num_hidden_layers=2)

The tool-call tags (``<search>``, ``</search>``, ``<answer>``, ...) are single *added, non-special*
tokens: they survive ``decode(..., skip_special_tokens=True)`` as text. ``<|endoftext|>``,
``<|im_start|>`` and ``<|im_end|>`` are special tokens; ``<|endoftext|>`` is eos and pad.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from asyncrl.models.safetensors_io import save_safetensors
from asyncrl.models.spec import ModelSpec

ARCHES = ("qwen2", "llama", "qwen3", "qwen3_moe")

# Special tokens first so their ids are small and stable: 0, 1, 2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Tags the agent loop parses; added as whole (non-special) tokens so a policy can emit them in one step.
TAG_TOKENS = (
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
    "<think>",
    "</think>",
)
# Total vocab incl. specials and tags: big enough for a useful BPE on short English, small enough
# that the embedding stays a few hundred KB.
DEFAULT_VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_BUILTIN_TEXT = """\
The quick brown fox jumps over the lazy dog. A question is answered by searching for facts.
Question: who wrote the book about the river? Answer: the author who lived by the river.
When a model does not know the answer it can search the corpus and read the information it gets.
Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.
The sun rises in the east and sets in the west. Water boils at one hundred degrees Celsius.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000. Dates: 1990, 2001, 2024.
The answer is yes. The answer is no. I think the answer is the first one, not the second.
Search results list documents; each document has a title and a text about a person or a place.
Reinforcement learning trains a policy with rewards; the policy samples answers to questions.
"""

# Extra built-in words so the BPE reaches ~DEFAULT_VOCAB_SIZE tokens without a corpus file.
_BUILTIN_WORDS = (
    "about after again against also always among animal another answer around because before being "
    "below between both called capital century chemistry children city country during early earth "
    "education element energy english example family father first football found french general "
    "government great group history house human important information island island king known "
    "language large later learning library located London mother mountain music national natural "
    "number often order other people person physics planet player point population president "
    "program question reason research river science second several should small society something "
    "species station still system teacher their there these thing through today together under "
    "united university until village water where which while within without world would writer "
    "written year young zebra Amsterdam Brazil Canada Denmark Egypt Finland Greece Hungary India "
    "Japan Kenya Lisbon Madrid Norway Oslo Peru Quebec Russia Spain Tokyo Uganda Vienna Warsaw"
)


def _builtin_text() -> str:
    words = _BUILTIN_WORDS.split()
    lines = [_BUILTIN_TEXT]
    for i, w in enumerate(words):
        lines.append(f"{w} {words[(i * 7) % len(words)]} {i * 37 % 1000} {w.capitalize()}s {w}ed {w}ing.")
    lines.append(" ".join(str(n) for n in range(0, 2000, 3)))
    return "\n".join(lines)


_COMMON = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "attention_dropout": 0.0,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 4}
_QWEN3 = {"head_dim": 32, "attention_bias": False, **_QWEN_WINDOW}
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_QWEN_WINDOW},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_QWEN3},
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_QWEN3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
}
"""config.json fields of each family beyond ``_COMMON``."""


def _base_config(arch: str) -> dict[str, Any]:
    if arch not in _FAMILY:
        raise ValueError(f"arch={arch!r} is not one of {ARCHES}")
    return {**_COMMON, **_FAMILY[arch]}


def _train_tokenizer(text: str, vocab_size: int):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n_base = vocab_size - len(TAG_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_base,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [ln for ln in text.splitlines() if ln.strip()] or [text]
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


def _tokenizer_config(tok, max_len: int) -> dict[str, Any]:
    added = {}
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _hf_param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, nh, nkv, hd = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    ffn, v = spec.ffn_hidden_size, spec.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if spec.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_moe_layer(i):
            shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (spec.moe_ffn_hidden_size, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (spec.moe_ffn_hidden_size, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, spec.moe_ffn_hidden_size)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    out: dict[str, torch.Tensor] = {}
    for name, shape in _hf_param_shapes(ModelSpec.from_hf_config(cfg)).items():
        if name.endswith("norm.weight"):
            # Near 1, not exactly 1, so a converter that drops a norm is caught by tests.
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t / math.sqrt(2 * cfg["num_hidden_layers"])
        out[name] = t.to(torch.float32).contiguous()
    return out


def _config(arch: str, tokenizer_vocab: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json of a tiny ``arch`` model: the family's base, the tokenizer's vocabulary, the overrides."""
    cfg = _base_config(arch)
    cfg["vocab_size"] = tokenizer_vocab
    cfg.update(overrides)
    if (
        arch in ("qwen2", "qwen3", "qwen3_moe")
        and "num_hidden_layers" in overrides
        and "max_window_layers" not in overrides
    ):
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    if cfg["vocab_size"] < tokenizer_vocab:
        raise ValueError(f"vocab_size={cfg['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    cfg["transformers_version"] = "4.45.0"
    return cfg


def _write_tokenizer_files(out: Path, tok: Any, cfg: dict[str, Any]) -> None:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json beside the weights."""
    tcfg = _tokenizer_config(tok, cfg["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    special_map = {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    corpus_path: str | Path | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    **overrides: Any,
) -> Path:
    """Write a tiny random HF checkpoint of family ``arch`` into ``out_dir`` and return its path.

    ``overrides`` replace config.json fields (e.g. ``num_hidden_layers=2``,
    ``tie_word_embeddings=True``, ``hidden_size=64``). ``vocab_size`` is the tokenizer's target
    size; config.json gets the tokenizer's actual size (BPE may stop short on a small corpus).
    """
    if arch not in ARCHES:
        raise ValueError(f"arch={arch!r} is not one of {ARCHES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if corpus_path is not None:
        p = Path(corpus_path)
        if not p.is_file():
            raise ValueError(f"corpus_path={str(p)!r} is not a file")
        text = p.read_text(encoding="utf-8", errors="replace")
    else:
        text = _builtin_text()
    tok = _train_tokenizer(text, vocab_size)
    tok.save(str(out / "tokenizer.json"))

    cfg = _config(arch, tok.get_vocab_size(), overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    save_safetensors(_random_weights(cfg, seed), out / "model.safetensors")

    _write_tokenizer_files(out, tok, cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.models.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--corpus", default=None, help="text file to train the BPE tokenizer on")
    ap.add_argument("--arch", default="qwen2", choices=ARCHES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = ap.parse_args(argv)
    path = make_tiny_checkpoint(
        args.out, arch=args.arch, corpus_path=args.corpus, seed=args.seed, vocab_size=args.vocab_size
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
