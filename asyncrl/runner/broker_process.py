"""The broker process: ``python -m asyncrl.runner.broker_process CONFIG [key=value ...] [--bind ADDR]
[--address-file PATH] [--prompts PATH]``, and ``start_broker`` to run one as a child (tests, benchmarks, tools).

The broker is a child of actor rank 0 (``asyncrl.runner.roles``). This entry point loads the config exactly as
the launcher does (``load_config``: defaults -> TOML -> overrides), reads the prompts of ``data.train_path`` (or
``--prompts``) with the agent's Search-R1 loader (``asyncrl.agent.data.loaders.load_prompts``) and hands them to
``asyncrl.broker.serve.run_broker``, which binds its ROUTER socket and, once bound, writes the endpoint to
``--address-file`` (atomically) and prints ``ASYNCRL_BROKER_ADDRESS=<endpoint>`` on stdout. Runs until an actor
sends ``shutdown``, SIGINT or SIGTERM; with ``--parent-pid`` (actor rank 0's child) SIGTERM is deferred while that
parent lives and the broker stops when it is gone (``asyncrl.broker.serve.Supervision``). It lives in the
runner because it wires two parts: the broker never imports the agent.

    bp = start_broker("configs/tiny.toml", ["data.rollout_batch_size=4"], log_path="broker.log")
    client = BrokerClient(bp.address); ...; bp.stop()
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from asyncrl.agent.data.loaders import load_prompts
from asyncrl.agent.envs import get_env, tool_cards, tool_specs
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.broker.dataloader import drop_long_prompts
from asyncrl.broker.serve import run_broker
from asyncrl.config import load_config

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
log = logging.getLogger("asyncrl.broker")


@dataclass
class BrokerProcess:
    proc: subprocess.Popen
    address: str

    def stop(self, *, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode


def start_broker(
    config_path: str,
    overrides: list[str] | None = None,
    *,
    bind: str = "tcp://127.0.0.1:0",
    prompts_path: Optional[str] = None,
    log_path: Optional[str] = None,
    log_level: str = "INFO",
    timeout_s: float = 30.0,
    parent_pid: Optional[int] = None,
) -> BrokerProcess:
    """``parent_pid``: run it as a supervised child of that process (``--parent-pid``: SIGTERM deferred while it
    lives; ``BrokerProcess.stop`` then waits ``timeout_s`` and kills, so stop such a broker with SIGINT)."""
    fd, addr_file = tempfile.mkstemp(prefix="asyncrl-broker-", suffix=".addr")
    os.close(fd)
    os.unlink(addr_file)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.runner.broker_process",
        str(config_path),
        *(overrides or []),
        "--bind",
        bind,
        "--address-file",
        addr_file,
        "--log-level",
        log_level,
    ]
    if prompts_path:
        cmd += ["--prompts", str(prompts_path)]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    # stdout inherited: the broker prints its warnings there (the console); everything goes to the log
    proc = subprocess.Popen(cmd, stdout=None, stderr=log, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while not os.path.exists(addr_file):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"broker exited with code {proc.returncode} before binding"
                    + (f"; see {log_path}" if log_path else "")
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"broker did not publish its address within {timeout_s:.0f}s")
            time.sleep(0.02)
        address = Path(addr_file).read_text().strip()
        os.unlink(addr_file)
    finally:
        if log_path:
            log.close()
    return BrokerProcess(proc, address)


def skip_long_prompts(cfg, prompts: list) -> tuple[list, list[tuple[int, int]]]:
    """``data.max_prompt_tokens``: count each prompt as the agent loop will send it (the task's template, the
    rollout tokenizer) and skip the longer ones with one counted warning. Without a task or a tokenizer (a broker
    run on its own) there is nothing to count with: nothing is skipped, with a warning for a missing tokenizer."""
    if not cfg.agentloop.task_name:
        return prompts, []
    env = get_env(cfg.agentloop.task_name)
    cards = tool_cards(tool_specs(cfg, env))
    path = cfg.rollout.model_path or cfg.actor.model_path
    try:
        tok = AgentTokenizer.from_pretrained(path)
    except (ValueError, OSError) as e:  # a broker run on its own (no model): nothing to count with
        log.warning("data.max_prompt_tokens is not applied: no tokenizer to count prompts with (%s)", e)
        return prompts, []
    chat = cfg.agentloop.chat_template

    def count(item) -> int:
        return len(tok.encode(env.prompt(item, tools=cards, chat_template=chat, tokenizer=tok)))

    kept, skipped = drop_long_prompts(prompts, count, cfg.data.max_prompt_tokens)
    if skipped:
        log.warning(
            "data.max_prompt_tokens = %d: skipped %d of %d prompts longer than that (longest %d tokens, "
            "prompt #%d); metric data/skipped_long_prompts",
            cfg.data.max_prompt_tokens,
            len(skipped),
            len(prompts),
            max(n for _, n in skipped),
            max(skipped, key=lambda s: s[1])[0],
        )
    return kept, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.runner.broker_process", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="TOML config path")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint to bind (port 0: OS picks)")
    ap.add_argument("--address-file", default=None, help="write the bound endpoint here")
    ap.add_argument("--prompts", default=None, help="prompt file (default: data.train_path)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="the supervising parent: SIGTERM is deferred while it lives (stop with shutdown or SIGINT)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s broker: %(message)s"
    )
    # operator-facing warnings (no completed groups, dead workers, drops) reach the console too, not only the log
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("[broker] %(levelname)s %(message)s"))
    logging.getLogger().addHandler(console)
    cfg = load_config(args.config, args.overrides)
    path = args.prompts or cfg.data.train_path
    if not path:
        raise ValueError("data.train_path: the broker needs a prompt file (Search-R1 parquet or JSONL)")
    prompts, skipped = skip_long_prompts(cfg, load_prompts(path))
    run_broker(
        cfg,
        prompts,
        source=path,
        bind=args.bind,
        address_file=args.address_file,
        num_skipped_long_prompts=len(skipped),
        parent_pid=args.parent_pid,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
