"""How fast a warm-start recipe teaches copying: the embedded default's warm start with config overrides, and at
chosen steps a held-out probe of the skill its RL phase depends on.

    python tools/warm_start_curve.py                                   # the default recipe, probe every 200 steps
    python tools/warm_start_curve.py --at 600,800,850 prepare.sft_steps=850 prepare.sft_lr=3e-3

The probe: demonstrations on the HELD-OUT rows (``data/test.jsonl``) that search every hop and then answer,
teacher-forced; ``exact`` is the fraction whose whole ``<answer> NAME </answer>`` span the model predicts
token by token (argmax), ``token`` the fraction of those tokens. It needs no engine and takes ~2 s, so a
recipe can be judged in the minutes of its warm start instead of a full run.

Measured 2026-12-03 (2 EPYC cores; README first run, ``benchmarks/first_run.py``): the 4-layer recipe (1200
steps at 2e-3) reaches exact 0.013 / 0.18 / 0.46 / 0.58 / 0.67 / 0.65 at steps 300 / 600 / 800 / 900 / 1000 /
1200 (copying appears late, around step 800); its RL runs end at held-out accuracy 0.46-0.57. A bfloat16 warm
start (``prepare.sft_matmul_dtype="bfloat16"``) probed 0.52-0.58 and its RL runs ended at 0.36-0.45. 850-step
recipes ended at 0.55 (lr 2e-3), 0.44 (3e-3), 0.43 (context loss weight 0.6), 0.54 (0.15) and 0.37
(``sft_correct_fraction=0.5``). Data and the random checkpoint are prepared under ``--dir`` (cached); the
warm start is written to a temporary directory and discarded. A point's ``s``: seconds since the warm start
began (its demonstrations built).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.agent.data.loaders import load_rows  # noqa: E402
from asyncrl.agent.tokenizer import AgentTokenizer  # noqa: E402
from asyncrl.agent.tools.bm25 import BM25Retriever, read_corpus  # noqa: E402
from asyncrl.config import load_config  # noqa: E402
from asyncrl.embedded import warm_start as ws  # noqa: E402
from asyncrl.embedded.synth import make_sft_demos  # noqa: E402
from asyncrl.runner.prepare import prepare_if_needed  # noqa: E402

PROBE_DEMOS = 300


def probe_examples(cfg, data_dir: Path, tok) -> list[tuple[list[int], int, int]]:
    """Held-out search-and-answer demonstrations as ``(ids, answer_start, answer_len)``."""
    bm25 = BM25Retriever(read_corpus(data_dir / "corpus.jsonl"))
    k = cfg.agentloop.tool.topk
    demos = make_sft_demos(
        load_rows(data_dir / "test.jsonl"),
        lambda qs, n: bm25.search(qs, n)[0],
        num_demos=PROBE_DEMOS,
        seed=123,
        topk=k,
        correct_fraction=1.0,
        wrong_copy_fraction=0.0,
    )
    out = []
    for d in demos:
        ids = list(tok.encode(d["prompt"]))
        for seg in d["segments"][:-1]:  # the searches and their information blocks
            s = list(tok.encode(seg["text"]))
            ids += s if seg["generated"] else s[: cfg.agentloop.tool.max_obs_tokens]
        answer = list(tok.encode(d["segments"][-1]["text"]))
        if len(ids) + len(answer) <= cfg.agentloop.max_total_tokens:
            out.append((ids + answer, len(ids), len(answer)))
    return out


@torch.no_grad()
def probe(model, examples) -> dict[str, float]:
    exact = hit = total = 0
    for ids, start, n in examples:
        logits = model(torch.tensor(ids)[None])[0]
        ok = logits[start - 1 : start + n - 1].argmax(-1) == torch.tensor(ids[start : start + n])
        exact += int(ok.all())
        hit, total = hit + int(ok.sum()), total + n
    return {"exact": exact / len(examples), "token": hit / total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs/tiny.toml"))
    ap.add_argument("--dir", default=str(REPO / "runs/warm_start_curve"), help="prepared data and random model")
    ap.add_argument("--at", default="", help="comma-separated steps to probe (default: every 200 and the last)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    p = cfg.prepare
    root = Path(a.dir)
    prep = load_config(a.config, [*a.overrides, f'prepare.dir="{root}"', "prepare.sft_steps=0"])
    prepare_if_needed(prep)  # data + the random checkpoint (the 0-step "warm start" it also writes is not used)
    at = {int(x) for x in a.at.split(",") if x} or {*range(200, p.sft_steps, 200), p.sft_steps}
    held_out = probe_examples(cfg, root / "data", AgentTokenizer.from_pretrained(root / "model"))
    points, t0 = [], time.time()

    def probe_at(step: int, model) -> None:  # the warm start's own loop, probed on the way
        if step in at:
            model.eval()
            points.append({"step": step, **probe(model, held_out), "s": round(time.time() - t0, 1)})
            model.train()
            print(f"step {step}: exact {points[-1]['exact']:.3f} token {points[-1]['token']:.3f}", flush=True)

    with tempfile.TemporaryDirectory() as out:  # the checkpoint it writes is not kept
        ws.warm_start(cfg, data_dir=root / "data", base_dir=root / "model", out_dir=Path(out), on_step=probe_at)
    print(json.dumps({"overrides": a.overrides, "steps": p.sft_steps, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
