"""``python -m asyncrl.broker CONFIG [key=value ...] [--bind ADDR] [--address-file PATH] [--prompts PATH]``

The broker process (spawned by actor rank 0). Loads the config exactly as the launcher does
(``load_config``: defaults -> TOML -> overrides), reads the prompts of ``data.train_path`` (or
``--prompts``) with ``asyncrl.agent.data.loaders.load_prompts``, binds its ROUTER socket and, once
bound, writes the endpoint to ``--address-file`` (atomically) and prints
``ASYNCRL_BROKER_ADDRESS=<endpoint>`` on stdout. Runs until an actor sends ``shutdown`` or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys

from asyncrl.broker.server import run_broker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.broker", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="TOML config path")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint to bind (port 0: OS picks)")
    ap.add_argument("--address-file", default=None, help="write the bound endpoint here")
    ap.add_argument("--prompts", default=None, help="prompt file (default: data.train_path)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s broker: %(message)s")
    # operator-facing warnings (no completed groups, dead workers, drops) reach the console too, not only the log
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("[broker] %(levelname)s %(message)s"))
    logging.getLogger().addHandler(console)
    from asyncrl.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_broker(cfg, bind=args.bind, address_file=args.address_file, prompts_path=args.prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
