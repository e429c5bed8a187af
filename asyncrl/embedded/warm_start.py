"""The embedded default's supervised warm start: demonstrations of the tool format, and the loop that trains on them.

Contract
- ``build_demo_examples(cfg, data_dir=, tokenizer=, num_demos=)``: demonstration trajectories of the config's
  environment (``asyncrl.embedded.DATA_MODULES``: the synthetic search-QA's ``synth.make_sft_demos`` with BM25 over
  the corpus, or ``arith.make_demos``) as ``(ids, loss_mask)``, each segment tokenized on its own as the agent loop
  does (generated turns mask 1, prompt and observations 0).
- ``warm_start(cfg, data_dir=, base_dir=, out_dir=)``: trains the plain-PyTorch decoder
  (``asyncrl.models.torch_decoder``, one process, before any Megatron world exists) on fresh demonstrations
  (``prepare.sft_*``), writes the HF checkpoint into ``out_dir`` and returns its loss figures. Only
  ``prepare.sft_correct_fraction`` of the demos use the tool and copy the right answer, so RL has room to improve.
  Deterministic for a given ``prepare.seed``. Its torch threads: ``choose_threads`` (pure) from the load average at
  its start, unless ``prepare.num_threads`` sets them; one log line says how many and why.

Called by ``asyncrl.runner.prepare.prepare_if_needed`` (the stages and their markers)::

    stats = warm_start(cfg, data_dir=root / "data", base_dir=root / "model", out_dir=root / "model_sft")
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.cluster.cpu_load import BUSY_WINDOW_S, busy_cores
from asyncrl.embedded import data_module
from asyncrl.models.torch_decoder import TorchDecoder

log = logging.getLogger("asyncrl.prepare")

MAX_DEMOS = 25_000  # bounds the demo set's memory and build time (~1 KB and ~0.4 ms each); each is seen ~3 times


def build_demo_examples(cfg, *, data_dir: Path, tokenizer, num_demos: int) -> list[tuple[list[int], list[int]]]:
    """Demonstrations of the config's environment (``asyncrl.embedded.data_module``: its ``warm_start_demos``) as
    (ids, loss_mask): prompt (mask 0), each segment tokenized on its own as the agent loop does (generated turns
    mask 1, observations mask 0, cut to ``agentloop.tool.max_obs_tokens``)."""
    demos = data_module(cfg.agentloop.task_name).warm_start_demos(cfg, data_dir=data_dir, num_demos=num_demos)
    encoded: dict[str, list[int]] = {}  # prompts, queries and retrieved blocks repeat across demos

    def encode(text: str) -> list[int]:
        if text not in encoded:
            encoded[text] = list(tokenizer.encode(text))
        return encoded[text]

    out = []
    for d in demos:
        ids = list(encode(d["prompt"]))
        mask = [0] * len(ids)
        for seg in d["segments"]:
            seg_ids = encode(seg["text"])
            if not seg["generated"]:
                seg_ids = seg_ids[: cfg.agentloop.tool.max_obs_tokens]
            ids += seg_ids
            mask += [1 if seg["generated"] else 0] * len(seg_ids)
        out.append((ids[: cfg.agentloop.max_total_tokens], mask[: cfg.agentloop.max_total_tokens]))
    return out


LENGTH_GROUPS = 4
"""Batches are drawn LENGTH_GROUPS at a time and cut from one length-sorted draw, so rows of a
batch have similar lengths (demos range from a direct answer to two searches). Measured on the
embedded default: useful/computed tokens 0.32 for plain random batches, 0.71 with 4, 0.84 with 8
(padded; ``_bucket_rows`` then buckets a batch to ~0.96)."""


def _length_grouped_batches(examples: list, batch_size: int, rng: random.Random) -> list[list]:
    n = min(batch_size, len(examples))
    draw = sorted(rng.sample(examples, min(LENGTH_GROUPS * n, len(examples))), key=lambda e: len(e[0]))
    batches = [draw[i : i + n] for i in range(0, len(draw) - n + 1, n)]
    rng.shuffle(batches)
    return batches


def _common_prefix_len(seqs: list[list[int]]) -> int:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        i = 0
        while i < n and i < len(s) and s[i] == first[i]:
            i += 1
        n = i
    return n


def _pad_rows(
    batch: list[tuple[list[int], list[int]]], P: int, pad: int, *, rows: int = 0, width_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's tokens after the shared prefix of length ``P``, one sequence per row, right-padded:
    ``(ids, generated, valid)`` ``[B, S]``; at least ``rows`` rows (empty ones added) and ``S`` a multiple of
    ``width_multiple``."""
    B = max(len(batch), rows)
    S = -(-(max(len(ids) for ids, _ in batch) - P) // width_multiple) * width_multiple
    rows_BS = torch.full((B, S), pad, dtype=torch.long)
    gen_BS = torch.zeros((B, S), dtype=torch.bool)
    valid_BS = torch.zeros((B, S), dtype=torch.bool)
    for b, (ids, mask) in enumerate(batch):
        n = len(ids) - P
        rows_BS[b, :n] = torch.tensor(ids[P:])
        gen_BS[b, :n] = torch.tensor(mask[P:], dtype=torch.bool)
        valid_BS[b, :n] = True
    return rows_BS, gen_BS, valid_BS


ROWS_PER_BUCKET = 8
"""``_bucket_rows``: a batch's sequences, sorted by length, go ROWS_PER_BUCKET to a bucket, each bucket padded
to its own longest. Measured on the embedded default (batches of 64, 200 batches): 2,958 computed tokens per
batch for 2,839 useful (3,056 when packing several sequences per row with a block mask, as before) and 30% less
attention work (549k query-key pairs against 780k: packed rows attend across their whole width); 16 per
bucket: 3,106 and 590k."""

SHAPE_GRID = (4, 32)
"""With bfloat16 products, buckets are ``[B, S]`` with B a multiple of 4 and S of 32 (empty rows and padding
added): oneDNN makes (JIT-compiles and caches) its bfloat16 matmul kernels per shape, and free shapes made ~100
distinct ones in 300 steps, the process growing by ~1 GB (measured with packed rows: 18 shapes on the grid,
memory flat, same step time)."""


def _bucket_rows(
    batch: list[tuple[list[int], list[int]]], P: int, pad: int, *, grid: tuple[int, int] = (1, 1)
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's tokens after the shared prefix of length ``P`` in buckets of similar lengths
    (``ROWS_PER_BUCKET``; ``TorchDecoder.hidden_states_buckets``): ``(ids per bucket [B, S], generated [N],
    valid [N], row starts [N])``, the flat masks over the buckets' tokens back to back. ``grid`` ``(r, s)``:
    each bucket's B rounded up to a multiple of r and S of s (``SHAPE_GRID``)."""
    order = sorted(range(len(batch)), key=lambda b: len(batch[b][0]))
    gr, gs = grid
    buckets, gens, valids, starts = [], [], [], []
    for i in range(0, len(order), ROWS_PER_BUCKET):
        members = [batch[b] for b in order[i : i + ROWS_PER_BUCKET]]
        ids_BS, gen_BS, valid_BS = _pad_rows(members, P, pad, rows=-(-len(members) // gr) * gr, width_multiple=gs)
        start_BS = torch.zeros_like(valid_BS)
        start_BS[:, 0] = True
        buckets.append(ids_BS)
        gens.append(gen_BS.reshape(-1))
        valids.append(valid_BS.reshape(-1))
        starts.append(start_BS.reshape(-1))
    return buckets, torch.cat(gens), torch.cat(valids), torch.cat(starts)


def _weighted_nll(
    model, pred_VH, targets_V, *, gen_V, pred_prefix_PH, prefix_targets_P, rows: int, context_weight: float
):
    """Next-token loss over the real tokens (``pred_VH`` predicts ``targets_V``): generated tokens weigh 1,
    prompt/tool tokens ``context_weight`` (the shared prefix's terms times ``rows``), normalised by the total
    weight; generated tokens only when ``context_weight`` is 0 (the LM head then skips every other position)."""
    if context_weight <= 0:
        return F.cross_entropy(model.lm_logits(pred_VH[gen_V]), targets_V[gen_V])
    nll = F.cross_entropy(model.lm_logits(pred_VH), targets_V, reduction="none")
    w = torch.where(gen_V, 1.0, context_weight)
    nll_prefix = F.cross_entropy(model.lm_logits(pred_prefix_PH), prefix_targets_P, reduction="none")
    w_prefix = context_weight * rows
    return ((nll * w).sum() + w_prefix * nll_prefix.sum()) / (w.sum() + w_prefix * nll_prefix.numel())


def _lr_at(step: int, *, lr: float, num_steps: int) -> float:
    """Linear warm-up over 20 steps, then a linear decay to a tenth of ``lr`` at the last step."""
    return lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / max(1, num_steps)))


def matmul_dtype(setting: str) -> torch.dtype:
    """``prepare.sft_matmul_dtype`` resolved: the dtype of the warm start's matrix products."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


def _batch_loss(
    model,
    batch: list[tuple[list[int], list[int]]],
    prefix_P: torch.Tensor,
    *,
    pad: int,
    context_weight: float,
    dtype: torch.dtype = torch.float32,
):
    """The warm-start loss of one batch (``_weighted_nll``), its rows bucketed after the shared prefix ``prefix_P``.
    ``dtype`` bfloat16: the decoder's linear layers take bfloat16 inputs (CPU autocast; attention, norms,
    residuals, the LM head and the loss stay float32, as do the weights and the optimizer)."""
    grid = SHAPE_GRID if dtype == torch.bfloat16 else (1, 1)
    buckets, gen_N, valid_N, start_N = _bucket_rows(batch, prefix_P.shape[0], pad, grid=grid)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        h_prefix, h_NH = model.hidden_states_buckets(prefix_P, buckets)
    h_prefix, h_NH = h_prefix.float(), h_NH.float()
    # position t predicts token t + 1; a row's first token is predicted by the prefix's last position (row N)
    N = h_NH.shape[0]
    src_N = torch.arange(-1, N - 1)
    src_N[start_N] = N
    pred_VH = torch.cat((h_NH, h_prefix[0, -1:]))[src_N[valid_N]]
    targets_V = torch.cat([b.reshape(-1) for b in buckets])[valid_N]
    return _weighted_nll(
        model,
        pred_VH,
        targets_V,
        gen_V=gen_N[valid_N],
        pred_prefix_PH=h_prefix[0, :-1],
        prefix_targets_P=prefix_P[1:],
        rows=len(batch),
        context_weight=context_weight,
    )


def _train(
    model,
    examples: list,
    prefix_P: torch.Tensor,
    p,
    *,
    pad: int,
    dtype: torch.dtype,
    on_step: Optional[Callable[[int, torch.nn.Module], None]] = None,
) -> list[float]:
    """``p.sft_steps`` AdamW steps on length-grouped batches of ``examples``; the loss of each step.
    ``on_step(step, model)`` after each step (1-based; ``tools/warm_start_curve.py`` probes there)."""
    # fused: one kernel per parameter instead of ~10 small ops each (same update)
    opt = torch.optim.AdamW(model.parameters(), lr=p.sft_lr, weight_decay=p.sft_weight_decay, fused=True)
    rng = random.Random(p.seed)
    losses: list[float] = []
    batches: list[list[tuple[list[int], list[int]]]] = []
    t0 = time.time()
    for step in range(p.sft_steps):
        if not batches:
            batches = _length_grouped_batches(examples, p.sft_batch_size, rng)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, lr=p.sft_lr, num_steps=p.sft_steps)
        loss = _batch_loss(
            model, batches.pop(), prefix_P, pad=pad, context_weight=p.sft_context_loss_weight, dtype=dtype
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, model)
        if step % 50 == 0 or step == p.sft_steps - 1:
            s_per_step = (time.time() - t0) / (step + 1)
            log.info(
                "prepare: warm start step %d/%d loss %.3f (%.2f s/step)", step + 1, p.sft_steps, losses[-1], s_per_step
            )
    return losses


def choose_threads(
    *, requested: int, usable: int, cpus: int, load: Optional[float], source: str = "load average"
) -> tuple[int, str]:
    """The warm start's torch thread count, and why in words (pure).

    ``requested``: ``prepare.num_threads`` (0: choose); ``usable``: the cores this process may run on
    (``sched_getaffinity``); ``cpus``: the machine's (``os.cpu_count()``, what the load counts over);
    ``load``: the runnable tasks, this process counted (None: unknown), as ``source`` says it was read: the cores
    other work kept busy over the last second plus this process (``busy_cores``), or the 1-minute load average where
    ``/proc/stat`` is absent. This process is up to one of the runnable tasks; the rest is other work. It gets as many
    threads as cores stay idle of that work, rounded, at least 1 and at most ``usable``: a thread more than the idle
    cores waits on the others at every matrix product (measured, 2 cores shared by other jobs at load 7-14: 2.2-3 s a
    step on one thread, 7-9 s on two)."""
    if requested:
        return requested, f"prepare.num_threads = {requested}"
    if load is None:
        return usable, f"every usable core ({usable}; no load average on this system)"
    idle = cpus - max(0.0, load - 1.0)
    n = max(1, min(usable, int(idle + 0.5)))
    why = f"{source} {load:.1f} on {cpus} CPUs (this process counts for up to 1) leaves {max(0.0, idle):.1f} idle"
    if n == usable:
        return n, f"every usable core ({usable}): {why}"
    return n, f"{n} of {usable} usable cores: {why}; more threads would oversubscribe (prepare.num_threads sets it)"


def _thread_choice(requested: int) -> tuple[int, str]:
    """``choose_threads`` on this machine, now (the 1-minute load average lags: after a heavy job ends it still
    counts it for a minute or more, and the warm start would take 1 thread on idle cores)."""
    cpus = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    if requested:
        return choose_threads(requested=requested, usable=usable, cpus=cpus, load=None)
    busy = busy_cores()
    if busy is not None:
        source = f"cores busy over the last {BUSY_WINDOW_S:g} s (/proc/stat) + this process:"
        return choose_threads(requested=0, usable=usable, cpus=cpus, load=busy + 1.0, source=source)
    try:
        load: Optional[float] = os.getloadavg()[0]
    except (OSError, AttributeError):  # not on every platform
        load = None
    return choose_threads(requested=requested, usable=usable, cpus=cpus, load=load)


def warm_start(
    cfg,
    *,
    data_dir: Path,
    base_dir: Path,
    out_dir: Path,
    on_step: Optional[Callable[[int, torch.nn.Module], None]] = None,
) -> dict:
    """Supervised warm start (plain PyTorch, one process): next-token loss on generated tokens. ``on_step``: see
    ``_train`` (``tools/warm_start_curve.py`` probes there)."""
    p = cfg.prepare
    torch.manual_seed(p.seed)
    tok = AgentTokenizer.from_pretrained(base_dir)
    # Fresh demonstrations for (almost) every step: with a small fixed set the tiny model memorizes
    # the demos (wrong answers included) instead of learning to search and copy.
    num_demos = min(MAX_DEMOS, max(512, p.sft_steps * p.sft_batch_size))
    t_build = time.time()
    examples = build_demo_examples(cfg, data_dir=data_dir, tokenizer=tok, num_demos=num_demos)
    log.info("prepare: %d demonstrations built in %.1fs", len(examples), time.time() - t_build)
    model = TorchDecoder.from_pretrained(base_dir)
    # Every demo starts with the same prompt template: its tokens are run once per batch, not per
    # row (hidden_states_buckets), which halves the cost of a step. Same loss as running rows
    # whole: the prefix's next-token terms count once per row.
    P = min(_common_prefix_len([ids for ids, _ in examples]), min(len(ids) for ids, _ in examples) - 1)
    prefix_P = torch.tensor(examples[0][0][:P], dtype=torch.long)
    threads_before = torch.get_num_threads()
    # One process on the idle cores. Measured (2026-12-03, 2 EPYC cores, the 3-layer default): data-parallel over two
    # single-threaded processes (gloo, each half of every batch, gradients summed) ran at 0.18-0.19 s/step
    # against 0.17-0.18 here (300 steps, interleaved twice), so it was not adopted. (An A/B under torchrun first
    # showed 0.84 of this time, but there torchrun's OMP_NUM_THREADS=1 handicapped the one-process side.)
    threads, why = _thread_choice(p.num_threads)
    log.info("prepare: warm start on %d torch thread(s): %s", threads, why)
    torch.set_num_threads(threads)
    dtype = matmul_dtype(p.sft_matmul_dtype)
    log.info(
        "prepare: warm start of %d steps on %d demos (shared prefix %d tokens, %d threads, %s products, torch's %s "
        "CPU kernels)",
        p.sft_steps,
        len(examples),
        P,
        torch.get_num_threads(),
        str(dtype).removeprefix("torch."),
        torch.backends.cpu.get_cpu_capability(),  # the held-out figures are measured per kernel kind (first_run_history)
    )
    t_train = time.perf_counter()
    try:
        losses = _train(model, examples, prefix_P, p, pad=tok.eos_token_ids[0], dtype=dtype, on_step=on_step)
    finally:
        torch.set_num_threads(threads_before)
    t_train = time.perf_counter() - t_train
    model.save_pretrained(out_dir, copy_from=base_dir)
    stats = {
        "steps": p.sft_steps,
        "s_per_step": round(t_train / max(1, p.sft_steps), 4),  # the machine's speed: first-run figures vary with it
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-10:]) / max(1, len(losses[-10:])) if losses else None,
    }
    (out_dir / "warm_start.json").write_text(json.dumps(stats) + "\n")
    return stats
