"""An external eval backend for the end-to-end test (``eval.eval_function_path = "eval_helpers:ChecksumEval"``,
with this folder on PYTHONPATH): a real ``CheckpointEvalFn`` that loads the snapshot as the CPU engine and
``TorchDecoder`` would, and reports a checksum of its weights and the step the snapshot says it holds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from asyncrl.eval.backends import SNAPSHOT_META, CheckpointEvalFn, EvalSkip, snapshot_dir


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
        from asyncrl.cpu_engine.model import load_model

        d = Path(checkpoint_dir)
        meta = json.loads((d / SNAPSHOT_META).read_text())
        if meta["step"] != input.step:
            raise EvalSkip(f"snapshot {d} holds step {meta['step']}, asked for {input.step}")
        load_model(d)  # the CPU engine loads it too
        return {
            "checksum": weights_checksum(d),
            "snapshot_step": float(meta["step"]),
            "weight_version": float(meta["weight_version"]),
            "num_datasets": float(len(input.datasets)),
        }


class LateChecksumEval(ChecksumEval):
    """A point that finishes only once the last step's record is in metrics.jsonl: it is logged after that record,
    at its own earlier step (a record whose step is below the one before it)."""

    def evaluate_checkpoint(self, checkpoint_dir, input):  # noqa: A002
        wait_for_record(Path(self.cfg.logging.run_dir), self.cfg.runner.max_steps)
        return super().evaluate_checkpoint(checkpoint_dir, input)


class EverySkipReasonEval(ChecksumEval):
    """Every skip reason of Miles' page really happening in one run (``eval.eval_interval = 1``,
    ``eval.eval_overflow_policy = "skip"``, ``eval.eval_max_in_flight = 4``, ``runner.max_steps = 6``, a plain
    file where step 1's snapshot directory goes): step 1's export raises (``skipped_export_failed``); the
    step-2 point holds the one eval thread until step 6's record is logged with ``eval/skipped_busy`` (points
    2-5 in flight), removes step 3's completion marker (``skipped_ckpt_missing``) and raises
    ``EvalSkip("no free slot")``; step 4 crashes (``skipped_crashed``); step 5 measures."""

    def evaluate_checkpoint(self, checkpoint_dir, input):  # noqa: A002
        if input.step == 2:
            last = wait_for_record(Path(self.cfg.logging.run_dir), self.cfg.runner.max_steps)
            if "eval/skipped_busy" not in last:
                raise RuntimeError(f"the last step found a free eval slot: {last}")
            (snapshot_dir(self.cfg.eval.eval_hf_dir, 3) / SNAPSHOT_META).unlink()
            raise EvalSkip("no free slot")
        if input.step == 4:
            raise RuntimeError("the eval server went away")
        return super().evaluate_checkpoint(checkpoint_dir, input)


def wait_for_record(run_dir: Path, step: int, timeout_s: float = 240.0) -> dict:
    """Step ``step``'s training record in metrics.jsonl, once it is there (the timeout is a failure bound)."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # whole lines only
        for r in map(json.loads, filter(str.strip, lines)):
            if r.get("step") == step and "time/step" in r:
                return r
        time.sleep(0.1)
    raise TimeoutError(f"no record of step {step} in {path} within {timeout_s:.0f}s")


def drop_every_fifth(group):
    """A dynamic-sampling filter (``rollout_buffer.dynamic_sampling_filter_path``): drops one group in five."""
    return "every_fifth" if group.group_id % 5 == 4 else None


def _hook_log(args, record: dict) -> None:
    with open(Path(args.logging.run_dir) / "hook_calls.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """Miles' ``--custom-rollout-log-function-path`` signature; False keeps the default logging."""
    _hook_log(
        args,
        {
            "kind": "rollout",
            "step": rollout_id,
            "samples": len(samples),
            "time": rollout_time,
            "staleness": rollout_extra_metrics.get("rollout/data_staleness/mean"),
        },
    )
    return False


def log_eval_rollout_data(rollout_id, args, data, extra_metrics):
    """Miles' ``--custom-eval-rollout-log-function-path`` signature; False keeps the default logging."""
    _hook_log(args, {"kind": "eval", "step": rollout_id, "datasets": sorted(data), "n": len(extra_metrics)})
    return False
