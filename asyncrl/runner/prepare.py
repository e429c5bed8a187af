"""Preparation of the embedded default, made on first use and cached under ``prepare.dir``.

    dir/data/{corpus,train,test}.jsonl (+ .parquet, tokenizer_text.txt)   synthetic search-QA
    dir/model/                                                            tiny Qwen2, random weights,
                                                                          tokenizer trained on the data
    dir/model_sft/                                                        supervised warm start on
                                                                          synthetic demonstrations

Runs on global rank 0 before any role starts, only when ``prepare.enabled``. Each stage is
skipped when its output exists (a ``.done`` marker is written last, so an interrupted stage is
redone). The warm start teaches the tool format from demonstrations of which only
``prepare.sft_correct_fraction`` search and copy the right answer, so RL has room to improve.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

log = logging.getLogger("asyncrl.prepare")

MAX_DEMOS = 50_000  # bounds the demo set's memory and build time (~1 KB and well under 1 ms each)


def _done(path: Path) -> bool:
    return (path / ".done").is_file()


def _mark(path: Path) -> None:
    (path / ".done").write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))


def prepare_if_needed(cfg) -> dict[str, Path]:
    p = cfg.prepare
    if not p.enabled:
        return {}
    root = Path(p.dir)
    data, base, sft = root / "data", root / "model", root / "model_sft"
    if not _done(data):
        from asyncrl.agent.data.synth import write_dataset

        t0 = time.time()
        write_dataset(data, seed=p.seed, num_countries=p.num_entities)
        _mark(data)
        log.info("prepare: synthetic data in %s (%.1fs)", data, time.time() - t0)
    if not _done(base):
        from asyncrl.models.tiny import make_tiny_checkpoint

        t0 = time.time()
        make_tiny_checkpoint(base, arch="qwen2", corpus_path=data / "tokenizer_text.txt", seed=p.seed,
                             vocab_size=p.vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers,
                             intermediate_size=p.hidden_size * 11 // 4)
        _mark(base)
        log.info("prepare: tiny Qwen2 checkpoint in %s (%.1fs)", base, time.time() - t0)
    if not _done(sft):
        t0 = time.time()
        stats = warm_start(cfg, data_dir=data, base_dir=base, out_dir=sft)
        _mark(sft)
        log.info("prepare: warm start in %s (%.1fs): %s", sft, time.time() - t0, stats)
    return {"data": data, "model": base, "model_sft": sft}


def build_demo_examples(cfg, *, data_dir: Path, tokenizer, num_demos: int) -> list[tuple[list[int], list[int]]]:
    """Demonstrations as (ids, loss_mask): prompt (mask 0), each segment tokenized on its own as
    the agent loop does (generated turns mask 1, information blocks mask 0)."""
    from asyncrl.agent.data.loaders import load_rows
    from asyncrl.agent.data.synth import make_sft_demos
    from asyncrl.agent.tools.bm25 import BM25Retriever, read_corpus

    rows = load_rows(data_dir / "train.jsonl")
    bm25 = BM25Retriever(read_corpus(data_dir / "corpus.jsonl"))
    topk = cfg.agentloop.tool.topk
    demos = make_sft_demos(rows, lambda q, k: bm25.search(q, k)[0], num_demos=num_demos, seed=cfg.prepare.seed + 1,
                           topk=topk, correct_fraction=cfg.prepare.sft_correct_fraction)
    out = []
    for d in demos:
        ids = list(tokenizer.encode(d["prompt"]))
        mask = [0] * len(ids)
        for seg in d["segments"]:
            seg_ids = tokenizer.encode(seg["text"])
            if not seg["generated"]:
                seg_ids = seg_ids[: cfg.agentloop.tool.max_obs_tokens]
            ids += seg_ids
            mask += [1 if seg["generated"] else 0] * len(seg_ids)
        out.append((ids[: cfg.agentloop.max_total_tokens], mask[: cfg.agentloop.max_total_tokens]))
    return out


def warm_start(cfg, *, data_dir: Path, base_dir: Path, out_dir: Path) -> dict:
    """Supervised warm start (plain PyTorch, one process): next-token loss on generated tokens."""
    import torch
    import torch.nn.functional as F

    from asyncrl.agent.tokenizer import AgentTokenizer
    from asyncrl.models.torch_decoder import TorchDecoder

    p = cfg.prepare
    torch.manual_seed(p.seed)
    tok = AgentTokenizer.from_pretrained(base_dir)
    # Fresh demonstrations for (almost) every step: with a small fixed set the tiny model memorizes
    # the demos (wrong answers included) instead of learning to search and copy.
    num_demos = min(MAX_DEMOS, max(512, p.sft_steps * p.sft_batch_size))
    examples = build_demo_examples(cfg, data_dir=data_dir, tokenizer=tok, num_demos=num_demos)
    model = TorchDecoder.from_pretrained(base_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=p.sft_lr, weight_decay=0.0)
    rng = random.Random(p.seed)
    losses = []
    pad = tok.eos_token_ids[0]
    for step in range(p.sft_steps):
        batch = rng.sample(examples, min(p.sft_batch_size, len(examples)))
        T = max(len(ids) for ids, _ in batch)
        ids_BT = torch.full((len(batch), T), pad, dtype=torch.long)
        mask_BT = torch.zeros((len(batch), T))
        valid_BT = torch.zeros((len(batch), T), dtype=torch.bool)
        for b, (ids, mask) in enumerate(batch):
            ids_BT[b, : len(ids)] = torch.tensor(ids)
            mask_BT[b, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
            valid_BT[b, : len(ids)] = True
        lr = p.sft_lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / max(1, p.sft_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        hidden = model.hidden_states(ids_BT[:, :-1])
        targets, gen = ids_BT[:, 1:], mask_BT[:, 1:] > 0
        if p.sft_context_loss_weight > 0:
            valid = valid_BT[:, 1:]
            nll = F.cross_entropy(model.lm_logits(hidden[valid]), targets[valid], reduction="none")
            w = torch.where(gen[valid], 1.0, p.sft_context_loss_weight)
            loss = (nll * w).sum() / w.sum()
        else:  # only generated tokens are trained: skip the LM head elsewhere
            loss = F.cross_entropy(model.lm_logits(hidden[gen]), targets[gen])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == p.sft_steps - 1:
            log.info("prepare: warm start step %d/%d loss %.3f", step + 1, p.sft_steps, loss.item())
    model.save_pretrained(out_dir, copy_from=base_dir)
    stats = {"steps": p.sft_steps, "first_loss": losses[0] if losses else None,
             "last_loss": sum(losses[-10:]) / max(1, len(losses[-10:])) if losses else None}
    (out_dir / "warm_start.json").write_text(json.dumps(stats) + "\n")
    return stats
