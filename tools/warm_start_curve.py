"""How fast a warm-start recipe teaches copying: the embedded default's warm start with config overrides, and at
chosen steps a held-out probe of the skill its RL phase depends on.

    python tools/warm_start_curve.py                                   # the default recipe, probe every 200 steps
    python tools/warm_start_curve.py --at 600,800,850 prepare.sft_steps=850 prepare.sft_lr=3e-3

    python tools/warm_start_curve.py --dir runs/tiny --model runs/tiny/model_sft   # probe a saved warm start

The probe: demonstrations on the HELD-OUT rows (``data/test.jsonl``) that search every hop and then answer,
teacher-forced; ``exact`` is the fraction whose whole ``<answer> NAME </answer>`` span the model predicts
token by token (argmax), ``token`` the fraction of those tokens, ``query`` the fraction of search queries predicted
whole (after their first token). ``train_*``: the same on training rows; a gap between the two is memorized
training facts, which RL's held-out accuracy does not get. It needs no engine and takes ~4 s, so a recipe can be
judged in the minutes of its warm start instead of a full run (``docs/first_run_history.md`` records what it showed).

Measured 2026-12-03 (2 EPYC cores; README first run, ``benchmarks/first_run.py``): the 4-layer recipe (1200
steps at 2e-3) reaches exact 0.013 / 0.18 / 0.46 / 0.58 / 0.67 / 0.65 at steps 300 / 600 / 800 / 900 / 1000 /
1200 (copying appears late, around step 800); its RL runs end at held-out accuracy 0.46-0.57. A bfloat16 warm
start (``prepare.sft_matmul_dtype="bfloat16"``) probed 0.52-0.58 and its RL runs ended at 0.36-0.45. 850-step
recipes ended at 0.55 (lr 2e-3), 0.44 (3e-3), 0.43 (context loss weight 0.6), 0.54 (0.15) and 0.37
(``sft_correct_fraction=0.5``). Data and the random checkpoint are prepared under ``--dir`` (cached, and made
again if the config asks for another data or model recipe; a warm start there is left alone); the warm start is
written to a temporary directory and discarded. A point's ``s``: seconds since the warm start
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
from asyncrl.models.torch_decoder import TorchDecoder  # noqa: E402
from asyncrl.runner.prepare import prepare_if_needed  # noqa: E402

PROBE_DEMOS = 300


def probe_examples(cfg, data_dir: Path, tok, split: str = "test") -> list[tuple[list[int], list[tuple[str, int, int]]]]:
    """Search-and-answer demonstrations on ``data/{split}.jsonl`` as ``(ids, spans)``: each generated segment's
    ``(kind, start, length)``, ``kind`` "query" or "answer"; a query's span leaves out its first token (the
    choice to search at all, which the warm start keeps rare on purpose: ``prepare.sft_correct_fraction``)."""
    bm25 = BM25Retriever(read_corpus(data_dir / "corpus.jsonl"))
    k = cfg.agentloop.tool.topk
    demos = make_sft_demos(
        load_rows(data_dir / f"{split}.jsonl"),
        lambda qs, n: bm25.search(qs, n)[0],
        num_demos=PROBE_DEMOS,
        seed=123,
        topk=k,
        correct_fraction=1.0,
        wrong_copy_fraction=0.0,
    )
    out = []
    for d in demos:
        ids, spans = list(tok.encode(d["prompt"])), []
        for i, seg in enumerate(d["segments"]):
            s = list(tok.encode(seg["text"]))
            if not seg["generated"]:
                s = s[: cfg.agentloop.tool.max_obs_tokens]
            elif i == len(d["segments"]) - 1:
                spans.append(("answer", len(ids), len(s)))
            else:
                spans.append(("query", len(ids) + 1, len(s) - 1))
            ids += s
        if len(ids) <= cfg.agentloop.max_total_tokens:
            out.append((ids, spans))
    return out


@torch.no_grad()
def probe(model, examples) -> dict[str, float]:
    """Teacher-forced argmax over ``probe_examples``: ``exact`` the fraction of answers predicted whole, ``token``
    the fraction of answer tokens, ``query`` the fraction of search queries predicted whole."""
    right = {"answer": 0, "query": 0, "token": 0}
    count = {"answer": 0, "query": 0, "token": 0}
    for ids, spans in examples:
        pred = model(torch.tensor(ids)[None])[0].argmax(-1)
        for kind, start, n in spans:
            ok = pred[start - 1 : start + n - 1] == torch.tensor(ids[start : start + n])
            right[kind] += int(ok.all())
            count[kind] += 1
            if kind == "answer":
                right["token"] += int(ok.sum())
                count["token"] += n
    frac = {k: right[k] / max(1, count[k]) for k in right}
    return {"exact": frac["answer"], "token": frac["token"], "query": frac["query"]}


def probe_point(model, held_out, train) -> dict[str, float]:
    """``probe`` on the held-out examples, and on the training ones as ``train_*``."""
    return {**probe(model, held_out), **{f"train_{k}": v for k, v in probe(model, train).items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs/tiny.toml"))
    ap.add_argument("--dir", default=str(REPO / "runs/warm_start_curve"), help="prepared data and random model")
    ap.add_argument("--at", default="", help="comma-separated steps to probe (default: every 200 and the last)")
    ap.add_argument(
        "--model", help="probe this warm-start checkpoint (e.g. runs/tiny/model_sft) instead of training one"
    )
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    p = cfg.prepare
    root = Path(a.dir)
    # data + the random checkpoint; a warm start already in --dir is left alone (it is this tool's to train)
    prepare_if_needed(load_config(a.config, [*a.overrides, f'prepare.dir="{root}"']), upto="model")
    at = {int(x) for x in a.at.split(",") if x} or {*range(200, p.sft_steps, 200), p.sft_steps}
    tok = AgentTokenizer.from_pretrained(root / "model")
    held_out, train = (probe_examples(cfg, root / "data", tok, split) for split in ("test", "train"))
    points, t0 = [], time.time()
    if a.model:
        model = TorchDecoder.from_pretrained(a.model).eval()
        print(json.dumps({"model": a.model, "points": [probe_point(model, held_out, train)]}))
        return 0

    def probe_at(step: int, model) -> None:  # the warm start's own loop, probed on the way
        if step in at:
            model.eval()
            points.append({"step": step, **probe_point(model, held_out, train), "s": round(time.time() - t0, 1)})
            model.train()
            pt = points[-1]
            print(
                f"step {step}: held-out exact {pt['exact']:.3f} token {pt['token']:.3f} query {pt['query']:.3f}; "
                f"train exact {pt['train_exact']:.3f} query {pt['train_query']:.3f}",
                flush=True,
            )

    with tempfile.TemporaryDirectory() as out:  # the checkpoint it writes is not kept
        ws.warm_start(cfg, data_dir=root / "data", base_dir=root / "model", out_dir=Path(out), on_step=probe_at)
    print(json.dumps({"overrides": a.overrides, "steps": p.sft_steps, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
