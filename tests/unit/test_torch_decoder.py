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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_shared_prefix_equals_full_rows_values_and_gradients(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=5, num_hidden_layers=2)
    model = TorchDecoder.from_pretrained(path)
    V = model.config["vocab_size"]
    torch.manual_seed(0)
    prefix, rows = torch.randint(0, V, (7,)), torch.randint(0, V, (3, 5))
    full = torch.cat((prefix[None].expand(3, -1), rows), dim=1)

    h_full = model.hidden_states(full)
    loss_full = (h_full[:, :7] ** 2).sum() + (h_full[:, 7:] ** 3).sum()
    g_full = torch.autograd.grad(loss_full, list(model.model.parameters()))

    h_prefix, h_rows = model.hidden_states_shared_prefix(prefix, rows)
    assert h_prefix.shape == (1, 7, h_full.shape[-1]) and h_rows.shape == (3, 5, h_full.shape[-1])
    assert torch.allclose(h_prefix[0], h_full[0, :7], atol=1e-5)
    assert torch.allclose(h_rows, h_full[:, 7:], atol=1e-5), (h_rows - h_full[:, 7:]).abs().max()
    # the prefix, computed once, stands for all three rows: weight its loss by the row count
    loss_shared = 3 * (h_prefix ** 2).sum() + (h_rows ** 3).sum()
    g_shared = torch.autograd.grad(loss_shared, list(model.model.parameters()))
    for a, b in zip(g_full, g_shared):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
