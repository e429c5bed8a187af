"""The CPU engine's ``--dtype`` (SGLang's flag and choices): weights held rounded to it, exactly."""

import pytest
import torch

from asyncrl.cpu_engine.args import DTYPES, parse_args, weight_dtype
from asyncrl.cpu_engine.model import load_model
from asyncrl.models.tiny import make_tiny_checkpoint


def test_flag_choices_are_sglangs():
    assert set(DTYPES) == {"auto", "half", "float16", "bfloat16", "float", "float32"}
    a = parse_args(["--model-path", "m", "--port", "1", "--dtype", "bfloat16", "--custom-weight-loader", "a.b", "c.d"])
    assert weight_dtype(a.dtype) == torch.bfloat16 and a.custom_weight_loader == ("a.b", "c.d")
    assert parse_args(["--model-path", "m", "--port", "1"]).dtype == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--port", "1", "--dtype", "bf16"])


def test_bf16_engine_holds_exactly_the_bf16_values(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=0, num_hidden_layers=1)
    fp32 = load_model(ckpt)
    bf16 = load_model(ckpt, weight_dtype=torch.bfloat16)
    moved = 0
    for name, t in bf16.params.items():
        assert torch.equal(t, t.to(torch.bfloat16).float()), name  # held at bf16 values
        assert torch.equal(t, fp32.params[name].to(torch.bfloat16).float()), name  # rounded as .to(bf16) rounds
        moved += int((t != fp32.params[name]).sum())
    assert moved > 0  # the checkpoint is fp32: rounding changed something
    x = torch.randn(4, bf16.params["model.norm.weight"].numel())
    bf16.load_weights([("model.norm.weight", x[0])])
    assert torch.equal(bf16.params["model.norm.weight"], x[0].to(torch.bfloat16).float())
