"""What one GPU can check of the actor and the CPU engine's model, in a few minutes; JSON last.

    python benchmarks/gpu_check.py              # one CUDA GPU, < 8 minutes on an H200
    python benchmarks/gpu_check.py --cpu-smoke  # the same code paths on CPU with a tiny model (~1 minute)

On the GPU it builds a Qwen2.5-0.5B-shaped checkpoint with random weights locally
(``asyncrl.models.tiny`` options: hidden 896, 24 layers, 14 heads / 2 KV heads, SwiGLU 4864, tied
embeddings, the vocabulary widened to 151936; no hub, no network), then:

1. ``attention``: the attention path the actor resolves (``te`` / ``varlen-flash`` /
   ``sdpa-flash`` / ``sdpa-efficient`` / ``sdpa-flash-cpu``), torch, CUDA, megatron-core and
   TransformerEngine versions;
2. ``train``: ``Actor.train_step`` in bf16 (Megatron DDP, Adam, a synthetic GRPO batch of Search-R1-like
   lengths in 16384-token micro-batches): median step time, tokens/s, peak CUDA memory, next to the
   per-rank estimate of ``asyncrl.actor.memory`` for the same plan;
3. ``logprob_parity``: the actor's log-probs on CUDA (fp32 and bf16) against an independent fp32
   implementation on CPU (the CPU engine's model, ``asyncrl.cpu_engine.model``); with the
   varlen-flash path, varlen against per-sequence SDPA;
4. ``cpu_engine_model``: the CPU engine's model run on CUDA (``torch.device("cuda")`` as the default
   device) against the same model on CPU (prefill logits), and its batched decode tokens/s;
5. ``weight_sync``: the sync's bf16 broadcast (``push_buckets`` -> ``broadcast_from_rank0``, per tensor and
   ``flattened_bucket``) from a sender process into a receiver process running the CPU engine's receive
   (``WeightUpdates.update_weights_from_distributed``) with its tensors on the same GPU: bytes, dtypes, shapes
   and device of what arrived, the model after the load, and bytes/s (``benchmarks/gpu_check_dist.py``);
6. ``tp_gather``: the actor's TP=2 gather and HF conversion (``iter_hf_buckets``) in two processes on the
   GPU against the unsharded tensors.
5 and 6 try NCCL first and fall back to gloo over the CUDA tensors (NCCL refuses two ranks on one GPU);
``backend`` says which ran, ``attempts`` why the other did not. Each has a deadline (its processes are
killed at it), cut to what is left of ``TIME_BUDGET_S`` (skipped, with the reason, when too little is
left). With ``--cpu-smoke`` they run the same code on CPU with gloo (the NCCL try fails at once).

Each check has a threshold; the process exits 1 when one fails or a phase raises (the JSON says
which, with the error; the traceback goes to stderr and the other phases still run). Without CUDA
(and without ``--cpu-smoke``) it prints the report with every phase skipped and the reason, and exits 2.

Needs: a CUDA build of torch >= 2.11 and, installed offline (``pip install --no-index --no-deps
--find-links WHEELS ...``), exactly these wheels: ``megatron-core==0.16.1`` and its two
dependencies ``numpy`` and ``packaging``; ``safetensors`` (checkpoints); ``tokenizers`` (the
tiny checkpoint's tokenizer). Optional: ``transformer-engine[pytorch]`` (then the TE path is the
one checked). Run it from the repository root (it puts the repo on ``sys.path``; asyncrl need not
be installed). Nothing else: no transformers, no sglang, no network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_dist import FORMATS, check_tp_gather, check_weight_sync  # noqa: E402

from asyncrl.cluster.ports import free_port  # noqa: E402

# the Qwen2.5-0.5B shape (its public config.json); the tiny checkpoint's tokenizer stays small
GPU_MODEL = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
GPU_VOCAB = 151936
SMOKE_MODEL = dict(num_hidden_layers=2)
# thresholds: fp32 CUDA vs fp32 CPU (no TF32) is rounding only; bf16 weights/activations move
# log-probs by ~1e-2 on a random model
FP32_TOL = 2e-3
BF16_MEAN_TOL = 0.05
CPU_ENGINE_TOL = 1e-3
PHASES = ("train", "logprob_parity", "cpu_engine_model", "weight_sync", "tp_gather")
# the lent machine gives the script ~8 minutes; 30 s of it stay for start-up, the report and slack
TIME_BUDGET_S = 450.0
# caps of the two-process checks' deadlines (each also ends by TIME_BUDGET_S); expected, not yet measured on a GPU:
# under a minute each (spawn, CUDA init, the failed NCCL try, the 0.5B model's ~1 GB in bf16 8 times over gloo)
DIST_DEADLINE_S = {"weight_sync": 180.0, "tp_gather": 120.0}
MIN_DEADLINE_S = 30.0  # less than this cannot start two processes and load the model: the check is skipped


def make_model(out: Path, *, smoke: bool) -> Path:
    """A random Qwen2 checkpoint: tiny (smoke) or the 0.5B shape with a full-size vocabulary."""
    from safetensors.torch import load_file, save_file

    from asyncrl.models.spec import load_hf_config
    from asyncrl.models.tiny import make_tiny_checkpoint

    d = make_tiny_checkpoint(out, arch="qwen2", seed=0, **(SMOKE_MODEL if smoke else GPU_MODEL))
    if smoke:
        return d
    cfg = load_hf_config(d)
    weights = load_file(str(d / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            w = weights[name]
            extra = 0.02 * torch.randn(GPU_VOCAB - w.shape[0], w.shape[1], generator=gen)
            weights[name] = torch.cat([w, extra]).contiguous()
    cfg["vocab_size"] = GPU_VOCAB
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def make_batch(vocab: int, *, smoke: bool):
    """Synthetic GRPO groups: Search-R1-like lengths on the GPU, short ones for the smoke run."""
    from asyncrl.actor.synthetic import synthetic_groups

    if smoke:
        return synthetic_groups(
            seed=0, num_groups=4, group_size=4, vocab_size=vocab, prompt_len=(8, 16), response_len=(16, 48)
        )
    return synthetic_groups(
        seed=0, num_groups=32, group_size=4, vocab_size=vocab, prompt_len=(150, 300), response_len=(300, 1200)
    )


def build_actor(hf: Path, *, dtype: str, budget: int):
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    cfg = tiny_actor_config(
        str(hf),
        actor={"params_dtype": dtype, "max_tokens_per_microbatch": budget, "lr": 1e-6},
        runner={"max_steps": 100},
    )
    return Actor(cfg), cfg


def reference_logprobs(hf: Path, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Log-probs of each sequence's tokens after its prompt from the CPU engine's fp32 model, on CPU."""
    from asyncrl.cpu_engine.model import KVPool, load_model

    model = load_model(hf)
    out = []
    for s, p in zip(seqs, prompt_lens):
        kv = KVPool(model.spec, max_rows=1, capacity=len(s))
        h = model.forward(torch.tensor(s), torch.tensor([0]), torch.tensor([len(s)]), kv, row0=0)  # [T, H]
        logz = torch.log_softmax(model.logits(h[p - 1 : len(s) - 1]), dim=-1)
        out.append(logz.gather(-1, torch.tensor(s[p:])[:, None])[:, 0])
    return out


def _diffs(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    d = torch.cat([(g.float().cpu() - r.float()).abs() for g, r in zip(got, ref)])
    return d.max().item(), d.mean().item()


def check_train(hf: Path, *, smoke: bool, device_type: str) -> dict:
    """Train steps in bf16 (fp32 on CPU): time, tokens/s, peak memory next to the estimate."""
    from asyncrl.actor.layer_spec import attention_path
    from asyncrl.actor.memory import ModelShape, estimate_actor_memory
    from asyncrl.models.spec import load_hf_config

    budget = 1024 if smoke else 16384
    actor, _ = build_actor(hf, dtype="bf16", budget=budget)
    groups = make_batch(actor.spec.vocab_size, smoke=smoke)
    num_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    actor.train_step(groups)  # warm-up (allocations, kernels)
    times = []
    for _ in range(2 if smoke else 3):
        m = actor.train_step(groups)
        times.append(m["time/training"])
    step_s = statistics.median(times)
    est = estimate_actor_memory(
        ModelShape.from_hf_config(load_hf_config(hf)),
        tp=1,
        pp=1,
        dp=1,
        bf16=actor.dtype == torch.bfloat16,
        microbatch_tokens=budget,
        row_len=budget,
    )
    out = {
        "attention_path": attention_path(actor.attention, dtype=actor.dtype, device=actor.device),
        "dtype": str(actor.dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in actor.model.parameters()),
        "tokens_per_step": num_tokens,
        "microbatch_tokens": budget,
        "num_microbatches": m["train/num_microbatches"],
        "step_s": [round(t, 3) for t in times],
        "tokens_per_s": round(num_tokens / step_s, 1),
        "grad_norm": m["train/grad_norm"],
        "estimated_gib": round(est.total / 2**30, 2),
        "estimate": est.render(),
    }
    if device_type == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del actor
    return out


def check_logprobs(hf: Path, *, smoke: bool, device_type: str) -> dict:
    """The actor's log-probs (fp32, and bf16 on CUDA) against the CPU engine's fp32 model on CPU."""
    from asyncrl.actor import layer_spec as attn_spec
    from asyncrl.models.spec import ModelSpec

    gen = torch.Generator().manual_seed(2)
    vocab = ModelSpec.from_pretrained(hf).vocab_size
    lens = [(6, 40), (10, 90), (4, 20), (12, 60)] if smoke else [(64, 320), (100, 500), (32, 180), (80, 260)]
    seqs = [torch.randint(3, vocab, (p + r,), generator=gen).tolist() for p, r in lens]
    prompt_lens = [p for p, _ in lens]
    ref = reference_logprobs(hf, seqs, prompt_lens)
    out: dict = {"num_tokens": sum(len(r) for r in ref)}
    actor, _ = build_actor(hf, dtype="fp32", budget=4096)
    got = [lp for lp, _ in actor.compute_logprobs(seqs, prompt_lens)]
    out["fp32_max_abs_diff"], out["fp32_mean_abs_diff"] = _diffs(got, ref)
    del actor
    if device_type != "cuda":
        return out
    actor, _ = build_actor(hf, dtype="bf16", budget=4096)
    got = [lp for lp, _ in actor.compute_logprobs(seqs, prompt_lens)]
    out["bf16_max_abs_diff"], out["bf16_mean_abs_diff"] = _diffs(got, ref)
    if attn_spec.attention_path(actor.attention, dtype=actor.dtype, device=actor.device) == "varlen-flash":
        varlen = attn_spec._varlen_fn
        attn_spec._varlen_fn = lambda: None  # per-sequence SDPA instead
        try:
            per_seq = [lp for lp, _ in actor.compute_logprobs(seqs, prompt_lens)]
        finally:
            attn_spec._varlen_fn = varlen
        out["varlen_vs_sdpa_max_abs_diff"] = _diffs(got, per_seq)[0]
    del actor
    return out


def check_cpu_engine_model(hf: Path, *, device_type: str) -> dict:
    """The CPU engine's model on ``device_type`` against itself on CPU; batched decode tokens/s."""
    from asyncrl.cpu_engine.model import KVPool, load_model
    from asyncrl.models.spec import ModelSpec

    gen = torch.Generator().manual_seed(3)
    B, N, steps = 8, 64, 32
    vocab = ModelSpec.from_pretrained(hf).vocab_size
    tokens = torch.randint(3, vocab, (B, N), generator=gen)
    cpu = load_model(hf)
    kv = KVPool(cpu.spec, max_rows=B, capacity=N)
    # the engine's forward takes the rows' tokens packed ([T]); last_only: each row's last hidden state [B, H]
    ref = cpu.logits(
        cpu.forward(
            tokens.reshape(-1), torch.zeros(B, dtype=torch.long), torch.full((B,), N), kv, row0=0, last_only=True
        )
    )
    del cpu, kv
    with torch.device(device_type):
        model = load_model(hf)
        kv = KVPool(model.spec, max_rows=B, capacity=N + steps)
        past = torch.zeros(B, dtype=torch.long)
        h = model.forward(tokens.reshape(-1).to(device_type), past, torch.full((B,), N), kv, row0=0, last_only=True)
        logits = model.logits(h)
        out = {"device": device_type, "prefill_max_abs_logit_diff": (logits.cpu() - ref).abs().max().item()}
        nxt = logits.argmax(-1, keepdim=True)
        past = past + N
        _sync(device_type)
        t0 = time.perf_counter()
        for _ in range(steps):
            h = model.forward(nxt.reshape(-1), past, torch.ones(B, dtype=torch.long), kv, row0=0, last_only=True)
            nxt = model.logits(h).argmax(-1, keepdim=True)
            past = past + 1
        _sync(device_type)
        out["decode_tokens_per_s"] = round(B * steps / (time.perf_counter() - t0), 1)
    return out


def dist_check(
    fn: Callable[..., dict], hf: Path, name: str, *, t_start: float, device_type: str, tmp: Path, smoke: bool
):
    """A two-process check of ``gpu_check_dist`` under its deadline: its cap, cut to what is left of the budget."""
    left = TIME_BUDGET_S - (time.perf_counter() - t_start)
    deadline_s = min(DIST_DEADLINE_S[name], left)
    if deadline_s < MIN_DEADLINE_S:
        return {"skipped": f"time budget: {left:.0f} s left of {TIME_BUDGET_S:.0f} s"}
    if device_type == "cuda":
        torch.cuda.empty_cache()  # this process's cached blocks back to the GPU: the two ranks share it
    return {
        "deadline_s": round(deadline_s),
        **fn(hf, device_type=device_type, deadline_s=deadline_s, tmp=tmp, smoke=smoke),
    }


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    from asyncrl.actor.layer_spec import te_available

    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": v("megatron-core"),
        "transformer_engine": v("transformer-engine") or v("transformer_engine"),
        "transformer_engine_imports": te_available() if torch.cuda.is_available() else False,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: the script's code paths, no GPU")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    t_start = time.perf_counter()
    if not smoke and not torch.cuda.is_available():
        reason = f"no CUDA device (torch {torch.__version__}); --cpu-smoke runs these code paths on CPU"
        print(f"gpu_check: {reason}", file=sys.stderr)
        result = {"mode": "gpu", **versions(), "skipped": reason, **{name: {"skipped": reason} for name in PHASES}}
        report(result, timings={}, t_start=t_start, out=args.out)
        return 2
    device_type = "cpu" if smoke else "cuda"
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    result: dict = {"mode": "cpu-smoke" if smoke else "gpu", **versions()}
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        t = time.perf_counter()
        hf = make_model(Path(tmp) / "model", smoke=smoke)
        timings["make_model"] = time.perf_counter() - t
        two = dict(t_start=t_start, device_type=device_type, tmp=Path(tmp), smoke=smoke)
        for name, fn in (
            ("train", lambda: check_train(hf, smoke=smoke, device_type=device_type)),
            ("logprob_parity", lambda: check_logprobs(hf, smoke=smoke, device_type=device_type)),
            ("cpu_engine_model", lambda: check_cpu_engine_model(hf, device_type=device_type)),
            ("weight_sync", lambda: dist_check(check_weight_sync, hf, "weight_sync", **two)),
            ("tp_gather", lambda: dist_check(check_tp_gather, hf, "tp_gather", **two)),
        ):
            t = time.perf_counter()
            try:
                result[name] = fn()
            except Exception as e:  # noqa: BLE001 - a diagnostic: report the failed phase (exit 1), run the rest
                traceback.print_exc()
                result[name] = {"error": f"{type(e).__name__}: {e}"}
            timings[name] = time.perf_counter() - t
            print(f"gpu_check: {name} done in {timings[name]:.1f} s", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    report(result, timings=timings, t_start=t_start, out=args.out)
    return 0 if result["ok"] else 1


def report(result: dict, *, timings: dict[str, float], t_start: float, out: str | None) -> None:
    """Complete ``result`` (checks, ok, timings) and print it as one JSON line (also to ``out``)."""
    result["attention_path"] = result["train"].get("attention_path")
    result["checks"] = checks(result)
    result["ok"] = all(result["checks"].values())
    result["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(result)
    if out:
        Path(out).write_text(text + "\n")
    print(text)


def checks(r: dict) -> dict[str, bool]:
    ran = {name: "error" not in r[name] and "skipped" not in r[name] for name in PHASES}
    out = {f"{name}_ran": ran[name] for name in PHASES}
    tr, lp, eng, ws, tg = (r[name] for name in PHASES)
    if ran["train"]:
        out["train_step_finite"] = tr["grad_norm"] == tr["grad_norm"] and tr["tokens_per_s"] > 0
    if ran["logprob_parity"]:
        out["fp32_logprobs_match_cpu_reference"] = lp["fp32_max_abs_diff"] < FP32_TOL
    if ran["cpu_engine_model"]:
        out["cpu_engine_model_on_device_matches_cpu"] = eng["prefill_max_abs_logit_diff"] < CPU_ENGINE_TOL
    if ran["weight_sync"]:  # bitwise_equal: every tensor there with its dtype, shape and bytes
        for fmt in FORMATS:
            f = ws[fmt]
            out[f"weight_sync_{fmt}_received_as_sent"] = (
                f["bitwise_equal"] and f["device_ok"] and f["model_holds_sent"] and f["bytes_per_s"] > 0
            )
    if ran["tp_gather"]:
        out["tp_gather_matches_unsharded"] = tg["bitwise_equal"] and tg["device_ok"] and not tg["unexpected"]
    if "bf16_mean_abs_diff" in lp:
        out["bf16_logprobs_near_cpu_reference"] = lp["bf16_mean_abs_diff"] < BF16_MEAN_TOL
    if "varlen_vs_sdpa_max_abs_diff" in lp:
        out["varlen_matches_per_sequence_sdpa"] = lp["varlen_vs_sdpa_max_abs_diff"] < BF16_MEAN_TOL
    if "peak_memory_gib" in tr:  # the estimate is meant as an upper bound, not a wild one
        out["memory_estimate_bounds_peak"] = tr["peak_memory_gib"] <= tr["estimated_gib"] * 1.1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
