"""The engine side of the delta sync (asyncrl.sync.delta_loader), called as SGLang calls a custom weight loader."""

import torch

from asyncrl.sync import delta as codec
from asyncrl.sync.delta_loader import REPORT, load_delta, path_tensor, report_file


class Model:
    def __init__(self):
        self.loaded = []

    def load_weights(self, named):
        self.loaded += list(named)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_delta_loader_without_a_base_reports_instead_of_raising(tmp_path):
    """The loader never raises (it would kill SGLang's scheduler): a delta with no base is reported."""
    m = Model()
    old = torch.randn(100).to(torch.bfloat16)
    new = old.clone()
    new[3] = 7.0
    parts = codec.to_tensors(codec.encode(old, new, max_density=0.5), "w")
    load_delta(m, [*parts.items(), (REPORT, path_tensor(str(tmp_path / "r")))])
    report = report_file(tmp_path / "r", 0).read_text()
    assert '"w"' in report and "no base" in report and m.loaded == []
    load_delta(m, [("w", old), (REPORT, path_tensor(str(tmp_path / "r")))])  # whole: the base
    load_delta(m, [*parts.items(), (REPORT, path_tensor(str(tmp_path / "r")))])
    assert torch.equal(_bits(m.loaded[-1][1]), _bits(new))


def test_config_keys_reach_the_engine_commands_and_bad_values_fail_naming_the_key():
    import pytest

    from asyncrl.config.loader import load_config
    from asyncrl.config.schema import DELTA_LOADER
    from asyncrl.engine.launch import cpu_engine_command, sglang_command

    cfg = load_config("configs/tiny.toml", ["sync.delta=true", "sync.wire_dtype=bfloat16"], resolve=False)
    cpu = cpu_engine_command(cfg, port=1)
    assert cpu[cpu.index("--dtype") + 1] == "bfloat16"
    assert cpu[cpu.index("--custom-weight-loader") + 1] == DELTA_LOADER
    gpu = sglang_command(cfg, port=1, base_gpu_id=0)
    assert gpu[gpu.index("--custom-weight-loader") + 1] == DELTA_LOADER and "--dtype" not in gpu
    plain = cpu_engine_command(load_config("configs/tiny.toml", [], resolve=False), port=1)
    assert "--dtype" not in plain and "--custom-weight-loader" not in plain
    for bad, key in (
        ("sync.wire_dtype=bf16", "sync.wire_dtype"),
        ("sync.delta_max_density=0", "sync.delta_max_density"),
    ):
        with pytest.raises(ValueError, match=key):
            load_config("configs/tiny.toml", bad.split(), resolve=False)
