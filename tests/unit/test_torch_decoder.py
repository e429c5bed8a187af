"""The plain-PyTorch decoder (warm start, benchmark baseline) equals HF transformers and round-trips."""

import pytest
import torch

from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder


@pytest.mark.parametrize("arch,extra", [("qwen2", {}), ("llama", {"tie_word_embeddings": True}), ("qwen3", {})])
def test_logits_match_transformers_and_round_trip(tmp_path, arch, extra):
    transformers = pytest.importorskip("transformers")
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=3, num_hidden_layers=2, **extra)
    ours = TorchDecoder.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    ref.eval()
    ids = torch.randint(0, ours.config["vocab_size"], (2, 17))
    with torch.no_grad():
        a = ours(ids)
        b = ref(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()

    with torch.no_grad():
        for prm in ours.parameters():
            prm.add_(0.01)
    ours.save_pretrained(tmp_path / "out", copy_from=path)
    again = TorchDecoder.from_pretrained(tmp_path / "out")
    for (k1, v1), (k2, v2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
