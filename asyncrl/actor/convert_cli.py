"""HF <-> actor checkpoint conversion, for users::

    python -m asyncrl.actor.convert_cli hf-to-actor --hf DIR --out CKPT [--tp 2]
    python -m asyncrl.actor.convert_cli actor-to-hf --ckpt CKPT --out DIR

The tensor mapping is ``asyncrl.actor.convert``; the checkpoint format ``asyncrl.actor.checkpoint``.
Guide: "Converting checkpoints" in docs/guide.md.
"""

from __future__ import annotations

import argparse

from asyncrl.actor import checkpoint as ckpt


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m asyncrl.actor.convert_cli",
        description="Convert between a HF checkpoint directory (Qwen2/Qwen2.5, Qwen3, Llama) and an actor "
        "checkpoint (the layout runner.resume_from reads). Prints the directory it wrote.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{hf-to-actor,actor-to-hf}")
    a = sub.add_parser(
        "hf-to-actor",
        help="HF checkpoint dir -> actor checkpoint dir (model only: training from it starts a fresh optimizer)",
    )
    a.add_argument("--hf", required=True, metavar="DIR", help="HF checkpoint: config.json, *.safetensors, tokenizer")
    a.add_argument("--out", required=True, metavar="CKPT", help="actor checkpoint directory to write (made if absent)")
    a.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="TP shards to write; must equal actor.tensor_model_parallel_size of the run that loads it (default 1)",
    )
    b = sub.add_parser("actor-to-hf", help="actor checkpoint dir (any TP and PP) -> HF checkpoint dir")
    b.add_argument(
        "--ckpt", required=True, metavar="CKPT", help="actor checkpoint: a step_NNNNNN/ directory with meta.json"
    )
    b.add_argument("--out", required=True, metavar="DIR", help="HF checkpoint directory to write (made if absent)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "hf-to-actor":
        path = ckpt.hf_to_actor_checkpoint(args.hf, args.out, tp=args.tp)
    else:
        path = ckpt.actor_checkpoint_to_hf(args.ckpt, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
