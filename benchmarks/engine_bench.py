"""CPU engine throughput vs HF transformers ``generate`` on the same model and prompts.

    python benchmarks/engine_bench.py --quick

Output tokens/s at concurrency 1, 8 and 64 with mixed output lengths (``ignore_eos``, so every
request produces exactly its length). The engine runs as its own process (real HTTP, the project's
SGLang client); transformers runs in this process, batched ``concurrency`` prompts at a time
(left-padded, ``max_new_tokens`` = the longest in the batch, ``min_new_tokens`` = the same so eos
cannot end it early); both count only the requested tokens. Target: engine >= 1.5x at 64.
Prints ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def _engine_run(url: str, prompts, lengths, concurrency: int) -> tuple[float, int]:
    from asyncrl.engine.client import SGLangClient

    sem = asyncio.Semaphore(concurrency)
    async with SGLangClient(url, request_timeout_s=600) as c:
        async def one(p, n):
            async with sem:
                r = await c.generate(p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
                                     return_logprob=True)
                assert len(r.output_ids) == n, (len(r.output_ids), n)
                return n

        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths))))
        return time.perf_counter() - t0, toks


def _hf_run(hf, prompts, lengths, concurrency: int, pad_id: int) -> tuple[float, int]:
    import torch

    t0 = time.perf_counter()
    toks = 0
    for i in range(0, len(prompts), concurrency):
        ps, ns = prompts[i: i + concurrency], lengths[i: i + concurrency]
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(ps):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns),
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
        assert out.shape[1] == width + max(ns)
        toks += sum(ns)
    return time.perf_counter() - t0, toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workload, under 60 s")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for each side (1 is stable on a shared machine: OMP spin-waits with "
                         "more threads than free cores slow both sides down many-fold)")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny import make_tiny_checkpoint
    from asyncrl.rollout.testing import running_cpu_engine

    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    levels = [1, 8, 64]
    # more requests than the concurrency: a client keeps `concurrency` in flight (the agent loop's
    # pattern); transformers takes them `concurrency` at a time
    n_req = {1: 4, 8: 32, 64: 192} if a.quick else {1: 16, 8: 128, 64: 512}
    max_len = 64 if a.quick else 128
    results: dict = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "threads": a.threads,
                     "quick": a.quick, "levels": {}}
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_checkpoint(Path(d) / "model", arch="qwen2", seed=0)  # 4 layers, hidden 128
        results["model"] = "tiny qwen2 (4 layers, hidden 128, vocab ~1k), fp32"
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with running_cpu_engine(model, log_dir=Path(d) / "logs", max_running_requests=64,
                                extra=["--num-threads", str(a.threads)]) as sup:
            for c in levels:
                n = n_req[c]
                prompts = [[rng.randrange(3, 900) for _ in range(rng.randint(16, 48))] for _ in range(n)]
                lengths = [rng.randint(8, max_len) for _ in range(n)]
                e_s, e_tok = asyncio.run(_engine_run(sup.url, prompts, lengths, c))
                h_s, h_tok = _hf_run(hf, prompts, lengths, c, pad_id=0)
                results["levels"][str(c)] = {
                    "requests": n, "output_tokens": e_tok,
                    "engine_tok_s": round(e_tok / e_s, 1), "hf_tok_s": round(h_tok / h_s, 1),
                    "speedup": round((e_tok / e_s) / (h_tok / h_s), 2)}
                print(f"concurrency {c}: {results['levels'][str(c)]}", file=sys.stderr)
    results["speedup_at_64"] = results["levels"]["64"]["speedup"]
    results["target_met"] = results["speedup_at_64"] >= 1.5
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
