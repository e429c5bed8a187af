"""megatron-core GPTModel on CPU (shims of asyncrl.cluster.megatron_cpu): TP=2 equals TP=1.

The pytest test launches this same file under ``torchrun --nproc_per_node 2`` (gloo). The worker
builds the tiny Qwen2 model at TP=1 (DP=2), then at TP=2, from the same HF weights: the full
logits must agree, and one SGD step through Megatron's DDP + ``get_megatron_optimizer`` (with
grad clipping) must give the same weights and the same grad norm. The worker also checks each
CPU shim (RNG tracker on the CPU generator, the default causal mask, the ``cuda_as_cpu`` scope) in
its own process, since the shims patch ``torch.cuda`` process-wide.
"""

import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch
import torch.distributed as dist

from asyncrl.cluster.megatron_cpu import apply_cpu_shims, cuda_as_cpu

REPO = Path(__file__).resolve().parents[2]


def run_torchrun(script: Path, args: list[str], *, nproc: int = 2, timeout_s: float = 120):
    return proc_helpers.run_torchrun(script, args, nproc=nproc, timeout_s=timeout_s)


@pytest.mark.slow
def test_tp2_equals_tp1(tmp_path):
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", num_hidden_layers=2, vocab_size=1000)  # vocab padded to 1024
    out = tmp_path / "out.json"
    proc = run_torchrun(Path(__file__), [str(hf), str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["same_names"]
    assert r["logits_std"] > 0.05  # the comparison is not vacuous
    assert r["logits_max_diff"] < 1e-5
    assert r["weights_changed"] > 1e-3  # the step moved the weights
    assert r["weights_max_diff"] < 1e-6
    assert abs(r["grad_norm_tp1"] - r["grad_norm_tp2"]) < 1e-4 * r["grad_norm_tp1"]
    if not torch.cuda.is_available():
        failed = [k for k, ok in r["shim_checks"].items() if not ok]
        assert len(r["shim_checks"]) == 10 and not failed, failed


def run(tp: int, hf_dir: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from asyncrl.actor.model import ModelSpec, build_gpt_model
    from asyncrl.actor.weights import iter_hf_tensors, load_hf_into_model

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    spec = ModelSpec.from_pretrained(hf_dir)
    model = build_gpt_model(spec, tp=tp)
    load_hf_into_model(model, hf_dir, spec, tp_rank=ps.get_tensor_model_parallel_rank(), tp=tp)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    with cuda_as_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, clip_grad=1.0), [ddp])

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(24).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(24, 24, dtype=torch.bool), 1)[None, None]

    logits = ddp(ids, pos, mask)  # [b, s, V/tp]
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        full_logits = torch.cat(parts, dim=-1)
    else:
        full_logits = logits
    full_logits = full_logits[..., : spec.vocab_size].detach().clone()

    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(ids, pos, mask, labels=labels).mean()  # vocab-parallel cross-entropy inside
    loss.backward()
    finalize_model_grads([ddp])
    with cuda_as_cpu():
        ok, grad_norm, _ = opt.step()
    assert ok
    weights = dict(iter_hf_tensors(ddp.module, spec, tp_group=ps.get_tensor_model_parallel_group(), tp=tp))
    ps.destroy_model_parallel()
    return full_logits, weights, float(grad_norm)


def shim_checks() -> dict[str, bool]:
    """What the shims promise, checked in a process of its own (they patch torch.cuda globally)."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.utils import get_default_causal_mask

    checks = {"current_device_cpu": torch.cuda.current_device() == "cpu"}
    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 11)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        x = torch.rand(3)
    checks["fork_restores_default_state"] = torch.equal(before, torch.get_rng_state())
    torch.manual_seed(11)
    checks["fork_draws_from_tracked_seed"] = torch.equal(x, torch.rand(3))
    with tracker.fork("a"):
        y = torch.rand(3)
    checks["tracked_state_advances"] = not torch.equal(x, y)
    torch.set_rng_state(before)
    m = get_default_causal_mask(4)
    checks["causal_mask_cpu"] = m.device.type == "cpu" and bool(m[0, 1]) and not bool(m[1, 0])
    with cuda_as_cpu():
        t = torch.zeros(2, device="cuda")
        u = torch.tensor([1.0], device="cuda")
        checks["scope_factories_cpu"] = t.device.type == "cpu" and u.device.type == "cpu"
        checks["scope_cuda_noop"] = t.cuda() is t
        checks["scope_type_name"] = t.type() == "torch.cuda.FloatTensor" and t.is_cuda
    checks["outside_scope_untouched"] = t.type() == "torch.FloatTensor" and not t.is_cuda
    try:
        torch.zeros(1, device="cuda")
        checks["outside_scope_cuda_fails"] = False
    except (AssertionError, RuntimeError):
        checks["outside_scope_cuda_fails"] = True
    return checks


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    assert apply_cpu_shims() or torch.cuda.is_available()
    assert apply_cpu_shims() or torch.cuda.is_available()  # idempotent
    checks = shim_checks() if not torch.cuda.is_available() else {}
    l1, w1, g1 = run(1, hf_dir)
    l2, w2, g2 = run(2, hf_dir)
    result = {
        "logits_max_diff": (l1 - l2).abs().max().item(),
        "logits_std": l1.std().item(),
        "weights_max_diff": max((w1[k] - w2[k]).abs().max().item() for k in w1),
        "weights_changed": max((w1[k] - w0).abs().max().item() for k, w0 in _hf(hf_dir).items()),
        "same_names": sorted(w1) == sorted(w2) == sorted(_hf(hf_dir)),
        "grad_norm_tp1": g1,
        "grad_norm_tp2": g2,
        "shim_checks": checks,
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _hf(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{hf_dir}/model.safetensors")


if __name__ == "__main__":
    main()
