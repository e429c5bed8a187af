"""An external eval backend for the end-to-end test (``eval.eval_function_path = "eval_helpers:ChecksumEval"``,
with this folder on PYTHONPATH): a real ``CheckpointEvalFn`` that loads the snapshot as the CPU engine and
``TorchDecoder`` would, and reports a checksum of its weights and the step the snapshot says it holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from asyncrl.runner.evaluation import SNAPSHOT_META, CheckpointEvalFn, EvalSkip


def weights_checksum(model_dir: str | Path) -> float:
    """Sum over every parameter of sum(|w| * (1 + position % 7)) in float64: changes with any weight."""
    from asyncrl.models.torch_decoder import TorchDecoder

    model = TorchDecoder.from_pretrained(model_dir)
    total = 0.0
    for _, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1).to(torch.float64)
        total += float((flat.abs() * (1 + torch.arange(flat.numel(), dtype=torch.float64) % 7)).sum())
    return total


class ChecksumEval(CheckpointEvalFn):
    def evaluate_checkpoint(self, checkpoint_dir, input):  # noqa: A002
        from asyncrl.rollout.cpu_model import load_model

        d = Path(checkpoint_dir)
        meta = json.loads((d / SNAPSHOT_META).read_text())
        if meta["step"] != input.step:
            raise EvalSkip(f"snapshot {d} holds step {meta['step']}, asked for {input.step}")
        load_model(d)  # the CPU engine loads it too
        return {"checksum": weights_checksum(d), "snapshot_step": float(meta["step"]),
                "weight_version": float(meta["weight_version"]), "num_datasets": float(len(input.datasets))}
