"""The CPU engine's throughput curve: generated tokens/s and per-request latency against concurrency.

    python benchmarks/engine_curve.py --quick      # concurrency 1, 2, 4, 8, 16, 32, 64; 3 rounds, ~2 min a condition
    python benchmarks/engine_curve.py --out benchmarks/baselines/engine_curve.json

What the simulator's engine model is fitted to (``asyncrl.simulate``: ``--engine-curve`` takes the
file this writes). One CPU engine process (real HTTP, the project's SGLang client) on the tiny
Qwen2 model (4 layers, hidden 128), ``--max-running-requests`` = the largest concurrency, so no
level queues inside the engine. At concurrency ``c`` a closed loop keeps ``c`` requests in flight
(the agent loop's pattern): ``c`` clients, each sending its next request when the last one returns,
every request a fresh random prompt (no prefix-cache hits) of ``--prompt-tokens`` and exactly
``--output-tokens`` generated (``ignore_eos``). Tokens/s = generated tokens / wall time of the level;
latency = each request's wall time (median over the level).

The machine is shared: the levels run interleaved (``--rounds`` passes, alternately ascending and
descending, so a slow spell of the machine does not land on one level), the figure per level is the
median over the rounds, and ``/proc/loadavg`` is recorded before and after every measurement.
The last stdout line is one JSON object (also written to ``--out``), with the fit of the simulator's
engine model (``asyncrl.simulate.fit_saturation``) and its relative error per concurrency.

``--load`` (``benchmarks/harness.py``): idle, under the fixed background load (two busy processes), or both (the
default), one engine serving both; each condition's ``curve`` and ``fit`` under ``idle`` / ``loaded``, and the top
level's ``curve`` and ``fit`` (what ``--engine-curve`` reads) are the first condition's (``curve_condition``: idle
where it ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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

LEVELS = (1, 2, 4, 8, 16, 32, 64)
MIN_TOKENS_PER_LEVEL = 1536  # ~1-4 s of generation a level on the tiny model: long enough to dwarf the ramp


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


async def _level(url: str, c: int, *, rng: random.Random, prompt_tokens: int, output_tokens: int, vocab: int) -> dict:
    from asyncrl.engine.client import SGLangClient

    per_client = max(2, -(-MIN_TOKENS_PER_LEVEL // (c * output_tokens)))
    latencies: list[float] = []
    async with SGLangClient(url, request_timeout_s=600) as client:

        async def one_client() -> int:
            toks = 0
            for _ in range(per_client):
                prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
                t0 = time.perf_counter()
                r = await client.generate(
                    prompt, {"max_new_tokens": output_tokens, "temperature": 1.0, "ignore_eos": True}
                )
                latencies.append(time.perf_counter() - t0)
                assert len(r.output_ids) == output_tokens, (len(r.output_ids), output_tokens)
                toks += output_tokens
            return toks

        load_before = _loadavg()
        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one_client() for _ in range(c))))
        wall = time.perf_counter() - t0
    return {
        "concurrency": c,
        "requests": c * per_client,
        "tok_s": toks / wall,
        "latency_s": statistics.median(latencies),
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
    }


def measure(
    *, levels: tuple[int, ...], rounds: int, prompt_tokens: int, output_tokens: int, threads: int, load: str = "idle"
) -> dict[str, dict]:
    """The curve under each condition of ``load`` (``harness.conditions``), one engine serving them all:
    ``{condition: {"curve", "samples", and the condition's load record}}``."""
    from asyncrl.cpu_engine.testing import running_cpu_engine
    from asyncrl.models.spec import ModelSpec
    from asyncrl.models.tiny import make_tiny_checkpoint

    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_checkpoint(Path(d) / "model", arch="qwen2", seed=0)  # 4 layers, hidden 128
        vocab = ModelSpec.from_pretrained(model).vocab_size
        with running_cpu_engine(
            model, log_dir=Path(d) / "logs", max_running_requests=max(levels), extra=["--num-threads", str(threads)]
        ) as sup:
            for cond in harness.conditions(load):
                with harness.under_condition(cond) as info:
                    rng = random.Random(0)  # the same prompts in each condition
                    kw = dict(rng=rng, prompt_tokens=prompt_tokens, output_tokens=output_tokens, vocab=vocab)
                    out[cond] = _rounds(sup.url, levels, rounds, kw)
                out[cond].update(info)
    return out


def _rounds(url: str, levels: tuple[int, ...], rounds: int, kw: dict) -> dict:
    """A warm-up level, then ``rounds`` interleaved passes over the levels; the curve (medians) and the samples."""
    samples: dict[int, list[dict]] = {c: [] for c in levels}
    asyncio.run(_level(url, min(8, max(levels)), **kw))  # warm-up: allocator, first compiles
    for k in range(rounds):
        for c in levels if k % 2 == 0 else tuple(reversed(levels)):
            s = asyncio.run(_level(url, c, **kw))
            samples[c].append(s)
            print(
                f"round {k} c={c}: {s['tok_s']:.0f} tok/s, latency {s['latency_s']:.3f} s, "
                f"load {s['loadavg_before']} -> {s['loadavg_after']}",
                file=sys.stderr,
                flush=True,
            )
    curve = [
        {
            "concurrency": c,
            "tok_s": round(statistics.median(x["tok_s"] for x in samples[c]), 1),
            "latency_s": round(statistics.median(x["latency_s"] for x in samples[c]), 4),
            "tok_s_rounds": [round(x["tok_s"], 1) for x in samples[c]],
            "loadavg": [x["loadavg_before"] for x in samples[c]],
        }
        for c in levels
    ]
    return {"curve": curve, "samples": samples}


def _fit(curve: list[dict]) -> dict:
    """The simulator's engine model fitted to ``curve``, printed beside it; its parameters and relative errors."""
    from asyncrl.simulate import curve_fit_report, fit_saturation

    points = [(p["concurrency"], p["tok_s"]) for p in curve]
    peak, c_half = fit_saturation(points)
    report = curve_fit_report(points, peak, c_half)
    print(f"{'concurrency':>11} {'tok/s':>8} {'latency_s':>9} {'fit tok/s':>9} {'rel.err':>7}")
    for p, r in zip(curve, report):
        print(
            f"{p['concurrency']:>11} {p['tok_s']:8.0f} {p['latency_s']:9.3f} {r['fit_tok_s']:9.0f} {r['rel_err']:+7.1%}"
        )
    print(f"fit: tok/s(c) = {peak:.0f} x c / (c + {c_half:.2f})")
    return {
        "model": "tok_s(c) = peak x c / (c + c_half)",
        "peak_tok_s": round(peak, 1),
        "c_half": round(c_half, 3),
        "rel_err": {str(r["concurrency"]): round(r["rel_err"], 4) for r in report},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default levels, 3 rounds (the minimum for a median)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved passes over the levels (median of these)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=24, help="per request (configs/tiny.toml's tokens per turn)")
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch threads (the trainer runs it with 1)")
    ap.add_argument("--out", help="also write the JSON here (e.g. benchmarks/baselines/engine_curve.json)")
    harness.add_load_arg(ap)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    levels = tuple(sorted({int(x) for x in a.levels.split(",")}))
    t0 = time.time()
    ms = measure(
        levels=levels,
        rounds=a.rounds,
        prompt_tokens=a.prompt_tokens,
        output_tokens=a.output_tokens,
        threads=a.threads,
        load=a.load,
    )
    by_cond = {}
    for cond, m in ms.items():
        print(f"--- {cond}: load {m['load_start']['1m']} -> {m['load_end']['1m']}")
        by_cond[cond] = {"curve": m["curve"], "fit": _fit(m["curve"])} | {
            k: m[k] for k in ("background", "load_start", "load_end", "speed_start")
        }
    first = next(iter(by_cond))  # idle where it ran: the curve the simulator reads (load_curve: the top "curve")
    result = {
        "benchmark": "engine_curve",
        "command": "python benchmarks/engine_curve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}; shared",
        "model": "tiny qwen2 (4 layers, hidden 128), fp32, engine threads " + str(a.threads),
        "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens,
        "rounds": a.rounds,
        "curve_condition": first,
        "curve": by_cond[first]["curve"],
        "fit": by_cond[first]["fit"],
        **by_cond,
        "wall_s": round(time.time() - t0, 1),
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
