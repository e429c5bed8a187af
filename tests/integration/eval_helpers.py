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


class SkippingChecksumEval(ChecksumEval):
    """``ChecksumEval`` whose step-1 point is skipped (``EvalSkip("no free slot")``) and step-3 point crashes."""

    def evaluate_checkpoint(self, checkpoint_dir, input):  # noqa: A002
        if input.step == 1:
            raise EvalSkip("no free slot")
        if input.step == 3:
            raise RuntimeError("the eval server went away")
        return super().evaluate_checkpoint(checkpoint_dir, input)


def drop_every_fifth(group):
    """A dynamic-sampling filter (``rollout_buffer.dynamic_sampling_filter_path``): drops one group in five."""
    return "every_fifth" if group.group_id % 5 == 4 else None


def _hook_log(args, record: dict) -> None:
    with open(Path(args.logging.run_dir) / "hook_calls.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """Miles' ``--custom-rollout-log-function-path`` signature; False keeps the default logging."""
    _hook_log(args, {"kind": "rollout", "step": rollout_id, "samples": len(samples), "time": rollout_time,
                     "staleness": rollout_extra_metrics.get("rollout/data_staleness/mean")})
    return False


def log_eval_rollout_data(rollout_id, args, data, extra_metrics):
    """Miles' ``--custom-eval-rollout-log-function-path`` signature; False keeps the default logging."""
    _hook_log(args, {"kind": "eval", "step": rollout_id, "datasets": sorted(data), "n": len(extra_metrics)})
    return False
