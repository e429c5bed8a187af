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
