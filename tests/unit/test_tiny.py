"""The tiny checkpoint maker writes HF checkpoints that transformers loads as-is."""

import json

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.models.tiny import TAG_TOKENS, main, make_tiny_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_loads_in_transformers(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=3, num_hidden_layers=2)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is False
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == cfg["vocab_size"] >= 900
    # Every tensor in the file was used by HF (none missing, none unexpected).
    sd = load_file(str(path / "model.safetensors"))
    hf_sd = model.state_dict()
    assert set(sd) == set(hf_sd)
    for k, v in sd.items():
        torch.testing.assert_close(hf_sd[k], v, rtol=0, atol=0)
    assert ("model.layers.0.self_attn.q_proj.bias" in sd) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in sd) == (arch == "qwen3")
    ids = tok("<think>hi</think>")["input_ids"]
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_tokenizer_tags_are_single_text_tokens(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "t")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    for tag in TAG_TOKENS:
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, tag
    text = "<search> capital of France </search><answer>Paris</answer>"
    ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert len(tok("<|im_start|>", add_special_tokens=False)["input_ids"]) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_with_corpus_and_seed(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta\n" * 50 + "epsilon zeta eta theta\n" * 50)
    assert main(["--out", str(tmp_path / "a"), "--corpus", str(corpus), "--seed", "1"]) == 0
    assert main(["--out", str(tmp_path / "b"), "--corpus", str(corpus), "--seed", "2"]) == 0
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    tok = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    assert "alpha" in tok["model"]["vocab"] or "Ġalpha" in tok["model"]["vocab"]
    with pytest.raises(ValueError, match="corpus_path"):
        make_tiny_checkpoint(tmp_path / "c", corpus_path=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="arch"):
        make_tiny_checkpoint(tmp_path / "d", arch="gpt2")
