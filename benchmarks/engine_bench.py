"""CPU engine throughput vs HF transformers ``generate`` on the same model and prompts, per generated token.

    python benchmarks/engine_bench.py --quick

Generated tokens/s at concurrency 1 and 64 with mixed output lengths (``ignore_eos``, so every request
produces exactly its length). The engine runs as its own process (real HTTP, the project's SGLang
client), a client keeping ``concurrency`` requests in flight; transformers runs in this process,
``concurrency`` prompts per ``generate`` call, left-padded, ``max_new_tokens`` = ``min_new_tokens`` = the
longest in the call so eos cannot end it early.

Fairness: the HF baseline is BATCHED BY LENGTH: the requests are sorted by output length before they
are cut into batches, so a batch pads to little more than its own requests (the engine's continuous
batching needs no such help). Both sides are credited the same generated tokens (the requested ones);
the tokens HF actually computes (padded rows: batch size x the batch's longest) are printed beside,
with their ratio to the credited ones. The two sides run interleaved, ``--reps`` times each
(``benchmarks/harness.py``); the ratio is HF seconds / engine seconds per repetition = the engine's
speed-up per generated token. Targets (issue 16): >= 1.5 at concurrency 64, >= 1.0 at 1.

Where the engine's time goes: a third side, interleaved with the two, drives the engine's own ``Scheduler`` (same
model, same ``max_running_requests``, same threads, the real tokenizer for the answers' text) in this process with
no HTTP: a finished request's replacement is handed in at once, from its ``deliver`` callback. ``direct_s`` and
``http_path_share`` (1 - direct / engine, medians) say how much of the engine's time is its HTTP path (client
and server, the hop between the engine's HTTP process and its scheduler process, a replacement's round trip)
rather than the model. Cores: the model runs on one torch thread on every side; the engine, as SGLang, answers
HTTP in a process of its own beside its scheduler (the HF side has no HTTP to answer), so ``direct_s`` against
``hf_s`` is the model-and-scheduler comparison with no second process at all.
``--load`` (``benchmarks/harness.py``): idle, under the fixed background load (two busy processes), or both (the
default: the engine and the in-process sides serve both; each condition's ratios and ``levels`` under ``idle`` /
``loaded``). ``--quick --reps 1``: ~20 s idle + loaded on 2 cores; ``--quick`` (11 repetitions): ~3 min.
Prints ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402


async def _engine_run(url: str, prompts, lengths, concurrency: int) -> tuple[float, int]:
    from asyncrl.engine.client import SGLangClient

    sem = asyncio.Semaphore(concurrency)
    async with SGLangClient(url, request_timeout_s=600) as c:

        async def one(p, n):
            async with sem:
                r = await c.generate(
                    p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}, return_logprob=True
                )
                assert len(r.output_ids) == n, (len(r.output_ids), n)
                return n

        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths))))
        return time.perf_counter() - t0, toks


class _Direct:
    """The engine's ``Scheduler`` on a thread of this process (module doc): ``run`` keeps ``concurrency`` requests
    in flight, handing in the next one from a finished one's ``deliver``, and returns the seconds for all."""

    def __init__(self, model_dir: Path, max_running: int):
        import threading

        from tokenizers import Tokenizer

        from asyncrl.cpu_engine.model import load_model
        from asyncrl.cpu_engine.scheduler import Scheduler

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.sched = Scheduler(
            load_model(model_dir),
            lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
            max_running_requests=max_running,
            seed=0,
            weight_version="0",
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sched.run, args=(self.stop,), name="direct-scheduler", daemon=True)
        self.thread.start()
        self.runs = 0

    def run(self, prompts, lengths, concurrency: int) -> float:
        import threading

        from asyncrl.cpu_engine.request import Request
        from asyncrl.cpu_engine.sampling_params import parse_sampling_params

        self.runs += 1
        todo = iter(range(len(prompts)))
        left, done, lock = [len(prompts)], threading.Event(), threading.Lock()

        def submit_next() -> None:
            with lock:
                i = next(todo, None)
            if i is not None:
                params = parse_sampling_params({"max_new_tokens": lengths[i], "temperature": 1.0, "ignore_eos": True})
                r = Request(f"d{self.runs}-{i}", list(prompts[i]), params, finished, return_logprob=True)
                self.sched.submit(r)

        def finished(out: dict) -> None:
            assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
            submit_next()

        t0 = time.perf_counter()
        for _ in range(concurrency):
            submit_next()
        if not done.wait(600):
            raise TimeoutError("the direct scheduler did not finish its requests in 600 s")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _by_length(prompts, lengths):
    """The requests sorted by output length (the HF baseline's batching: little padding per batch)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [prompts[i] for i in order], [lengths[i] for i in order]


def _hf_computed(lengths, concurrency: int) -> int:
    """Generated token rows HF computes: per batch, its size x its longest request."""
    return sum(
        len(lengths[i : i + concurrency]) * max(lengths[i : i + concurrency])
        for i in range(0, len(lengths), concurrency)
    )


def _hf_run(hf, prompts, lengths, concurrency: int, pad_id: int) -> tuple[float, int]:
    import torch

    prompts, lengths = _by_length(prompts, lengths)
    t0 = time.perf_counter()
    toks = 0
    for i in range(0, len(prompts), concurrency):
        ps, ns = prompts[i : i + concurrency], lengths[i : i + concurrency]
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(ps):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(ns),
                min_new_tokens=max(ns),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + max(ns)
        toks += sum(ns)
    return time.perf_counter() - t0, toks


def _levels(rep, url: str, hf, direct, *, n_req: dict[int, int], max_len: int, reps: int) -> dict:
    """Both concurrencies under the current condition (the same prompts in each: a fresh ``Random(0)``); the
    ratios to ``rep``, the figures per level back."""
    rng = random.Random(0)
    targets = {1: 1.0, 64: 1.5}
    levels: dict = {}
    for c, n in n_req.items():
        prompts = [[rng.randrange(3, 900) for _ in range(rng.randint(16, 48))] for _ in range(n)]
        lengths = [rng.randint(8, max_len) for _ in range(n)]
        gen = sum(lengths)
        t = harness.interleave(
            {
                "engine": lambda p=prompts, n=lengths, c=c: asyncio.run(_engine_run(url, p, n, c))[0],
                "hf": lambda p=prompts, n=lengths, c=c: _hf_run(hf, p, n, c, pad_id=0)[0],
                "direct": lambda p=prompts, n=lengths, c=c: direct.run(p, n, c),
            },
            reps=reps,
            warmup=1,
        )
        computed = _hf_computed(sorted(lengths), c)
        rep.ratio(
            f"c{c}_speedup_ratio",
            t["hf"],
            t["engine"],
            target=targets[c],
            note="HF s / engine s for the same generated tokens = speed-up per generated token (HF batched by length)",
        )
        levels[str(c)] = {
            "requests": n,
            "generated_tokens": gen,
            "hf_computed_tokens": computed,
            "hf_computed_over_generated": computed / gen,
            "engine_s": harness.summary(t["engine"]),
            "hf_s": harness.summary(t["hf"]),
            "direct_s": harness.summary(t["direct"]),
            "http_path_share": 1 - statistics.median(t["direct"]) / statistics.median(t["engine"]),
            "engine_generated_tok_s": gen / statistics.median(t["engine"]),
            "hf_generated_tok_s": gen / statistics.median(t["hf"]),
            "hf_computed_tok_s": computed / statistics.median(t["hf"]),
        }
        print(f"concurrency {c}: {levels[str(c)]}", file=sys.stderr)
    return levels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 11 by default: with 5, the c64 median moved between 1.29 and 1.77 across five --quick runs within one hour
    # (2026-12-03 evening, 2 cores): one repetition of each side is ~0.5 s and the machine's speed swings
    harness.add_args(ap, reps=11, load=True)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for each side (1 is stable on a shared machine: OMP spin-waits with "
        "more threads than free cores slow both sides down many-fold)",
    )
    a = ap.parse_args(argv)
    rep = harness.Report("engine_bench", argv)
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.cpu_engine.testing import running_cpu_engine
    from asyncrl.models.tiny import make_tiny_checkpoint

    torch.set_num_threads(a.threads)
    # more requests than the concurrency: a client keeps `concurrency` in flight (the agent loop's
    # pattern); transformers takes them `concurrency` at a time, sorted by length
    n_req = {1: 3, 64: 128} if a.quick else {1: 8, 64: 256}
    max_len = 48 if a.quick else 128
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_checkpoint(Path(d) / "model", arch="qwen2", seed=0)  # 4 layers, hidden 128
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        direct = _Direct(Path(model), max_running=64)
        with running_cpu_engine(
            model, log_dir=Path(d) / "logs", max_running_requests=64, extra=["--num-threads", str(a.threads)]
        ) as sup:
            for cond in harness.conditions(a.load):
                with rep.condition(cond):
                    rep.record({"levels": _levels(rep, sup.url, hf, direct, n_req=n_req, max_len=max_len, reps=a.reps)})
        direct.close()
    rep.emit(
        {
            "model": "tiny qwen2 (4 layers, hidden 128, vocab ~1k), fp32",
            "threads": a.threads,
            "hf_batching": "by length (requests sorted by output length, then cut into batches of the concurrency)",
        },
        save=a.save,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
