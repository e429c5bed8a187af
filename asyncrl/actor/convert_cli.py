"""HF <-> actor checkpoint conversion, for users::

    python -m asyncrl.actor.convert_cli hf-to-actor --hf DIR --out CKPT [--tp 2]
    python -m asyncrl.actor.convert_cli actor-to-hf --ckpt CKPT --out DIR

The tensor mapping is ``asyncrl.actor.convert``; the checkpoint format ``asyncrl.actor.checkpoint``.
"""

from __future__ import annotations

import argparse

from asyncrl.actor import checkpoint as ckpt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.actor.convert_cli", description="HF <-> actor checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-actor", help="HF checkpoint dir -> actor checkpoint dir (model only)")
    a.add_argument("--hf", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--tp", type=int, default=1)
    b = sub.add_parser("actor-to-hf", help="actor checkpoint dir -> HF checkpoint dir")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "hf-to-actor":
        path = ckpt.hf_to_actor_checkpoint(args.hf, args.out, tp=args.tp)
    else:
        path = ckpt.actor_checkpoint_to_hf(args.ckpt, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
