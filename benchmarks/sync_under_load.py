"""What runs while a weight sync runs in a real run: engines generating and an actor training, switched on and off.

``weight_sync_bench.py --during-load generate+train`` times the same sync on quiet engines and while
  * ``generate``: a steady stream of ``/generate`` requests keeps every engine full (``GenerationStream``: per
    engine ``concurrency`` client loops, each sending its next request as the last one returns, the agent loop's
    pattern; short requests, ``ignore_eos``, so a pause drains quickly);
  * ``train``: an actor process steps (``Trainer``: the project's Megatron ``Actor`` on the synced checkpoint, a
    gloo world of one, one torch thread as a torchrun rank has, ``train_step`` on synthetic GRPO groups in a loop);
both switched on before the timed sync and off after it (``DuringLoad.on`` / ``off``), so the quiet and busy syncs
run interleaved on the same engines. ``on`` returns once the load really runs: every engine has answered a request
since, and the trainer's CPU time has grown since it was resumed. ``off`` returns once no request is in flight and
the trainer is stopped (``SIGSTOP`` by its PID; ``SIGCONT`` resumes it, so its start-up is paid once). The sync's
own pause (``retract``) holds the engines' running requests meanwhile; they finish after it.

    with DuringLoad(urls, "generate+train", checkpoint=ckpt, tmp=tmp) as load:
        load.on(); t = timed_sync(); load.off()
        load.figures()   # tokens/s generated and the trainer's CPU (cores) while on

Every wait has a deadline (``LOAD_TIMEOUT_S``); the trainer ends with its parent (it watches ``getppid``) and is
stopped by PID (SIGCONT, SIGTERM, SIGKILL after a grace) when the block ends. A failed request ends the benchmark
naming the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from asyncrl.cluster.ports import free_port  # noqa: E402

LOADS = ("generate", "train", "generate+train")
LOAD_TIMEOUT_S = 120.0  # a switch of the load (the trainer's start-up: Megatron's import and the model's build)
STOP_GRACE_S = 10.0
RUNNING_CPU_S = 0.02  # the trainer's CPU time that shows it running again after SIGCONT (two clock ticks)
NEW_TOKENS = 16  # per request: short, so the stream drains within a decode step or two when switched off
PROMPT_TOKENS = 32


class GenerationStream:
    """``concurrency`` closed-loop clients per engine on a thread of its own (an asyncio loop); ``on``/``off``."""

    def __init__(self, urls: list[str], *, concurrency: int, vocab_size: int):
        self.urls, self.concurrency, self.vocab_size = urls, concurrency, vocab_size
        self._cond = threading.Condition()
        self._active = False
        self._closing = False
        self.in_flight = 0
        self.completed = {u: 0 for u in urls}
        self.tokens = 0
        self.error: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()

    async def _main(self) -> None:
        from asyncrl.engine.client import SGLangClient

        clients = [SGLangClient(u, request_timeout_s=LOAD_TIMEOUT_S) for u in self.urls]
        try:
            await asyncio.gather(*(self._client(c, k) for c in clients for k in range(self.concurrency)))
        finally:
            for c in clients:
                await c.close()

    async def _client(self, client, k: int) -> None:
        rng = random.Random(k)
        while True:
            with self._cond:
                if self._closing:
                    return
                go = self._active and self.error is None
                if go:
                    self.in_flight += 1
            if not go:
                await asyncio.sleep(0.01)  # switched off: look again (the switch is a flag under the condition)
                continue
            prompt = [rng.randrange(3, self.vocab_size) for _ in range(PROMPT_TOKENS)]
            try:
                r = await client.generate(
                    prompt, {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}, return_logprob=False
                )
                err = None if len(r.output_ids) == NEW_TOKENS else f"{len(r.output_ids)} tokens of {NEW_TOKENS}"
            except Exception as e:  # noqa: BLE001 - any failure of the stream is reported, naming its engine
                err, r = f"{type(e).__name__}: {e}", None
            with self._cond:
                self.in_flight -= 1
                if err is not None:
                    self.error = self.error or f"generation stream to {client.url}: {err}"
                else:
                    self.completed[client.url] += 1
                    self.tokens += NEW_TOKENS
                self._cond.notify_all()

    def _wait(self, pred, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: pred() or self.error is not None, timeout=LOAD_TIMEOUT_S):
                raise TimeoutError(f"generation stream: still not {what} after {LOAD_TIMEOUT_S} s")
            if self.error:
                raise RuntimeError(self.error)

    def on(self) -> None:
        """Switch on; return once every engine has answered a request since."""
        with self._cond:
            start = dict(self.completed)
            self._active = True
        self._wait(lambda: all(self.completed[u] > start[u] for u in self.urls), "answered by every engine")

    def off(self) -> None:
        """Switch off; return once no request is in flight."""
        with self._cond:
            self._active = False
        self._wait(lambda: self.in_flight == 0, "drained")

    def close(self) -> None:
        with self._cond:
            self._active, self._closing = False, True
        self._thread.join(LOAD_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"generation stream: its thread still running after {LOAD_TIMEOUT_S} s")


class Trainer:
    """The actor process (``python sync_under_load.py --trainer``), stopped (SIGSTOP) until ``on``."""

    def __init__(self, checkpoint: Path, log: Path):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1"}
        env.update(MASTER_PORT=str(free_port("127.0.0.1")), LOCAL_RANK="0", PYTHONPATH=str(REPO))
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--trainer", str(checkpoint), str(os.getpid())],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._cond = threading.Condition()
        self.steps = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait(lambda: self.steps >= 1, "through its warm-up step")
        self._signal(signal.SIGSTOP)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("step "):
                with self._cond:
                    self.steps += 1
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait(self, pred, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: pred() or self.proc.poll() is not None, timeout=LOAD_TIMEOUT_S)
        if self.proc.poll() is not None:
            raise RuntimeError(f"trainer pid {self.proc.pid} exited with {self.proc.returncode} (log {self._log.name})")
        if not ok:
            raise TimeoutError(f"trainer pid {self.proc.pid}: still not {what} after {LOAD_TIMEOUT_S} s")

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def cpu_s(self) -> float:
        """CPU seconds the trainer has used (``/proc/<pid>/stat``: user + system, every thread)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def on(self) -> None:
        """Resume; return once it is running again: its CPU time has grown by ``RUNNING_CPU_S`` (a step of the default
        575 MB model takes seconds on one thread: waiting for one would make every busy repetition that long)."""
        start = self.cpu_s()
        self._signal(signal.SIGCONT)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while self.cpu_s() < start + RUNNING_CPU_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer pid {self.proc.pid} exited with {self.proc.returncode} ({self._log.name})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer pid {self.proc.pid}: not running {LOAD_TIMEOUT_S} s after SIGCONT")
            time.sleep(0.005)

    def off(self) -> None:
        self._signal(signal.SIGSTOP)

    def close(self) -> None:
        try:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(STOP_GRACE_S)
        finally:
            self._reader.join(STOP_GRACE_S)
            self._log.close()


class DuringLoad:
    """``load`` (one of ``LOADS``) on the engines at ``urls``, switched on and off around each busy sync."""

    def __init__(self, urls: list[str], load: str, *, checkpoint: Path, tmp: Path, concurrency: int, vocab_size: int):
        if load not in LOADS:
            raise ValueError(f"--during-load {load!r}: expected one of {', '.join(LOADS)}")
        self.load = load
        self.stream = (
            GenerationStream(urls, concurrency=concurrency, vocab_size=vocab_size) if "generate" in load else None
        )
        try:
            self.trainer = Trainer(checkpoint, tmp / "trainer.log") if "train" in load else None
        except BaseException:
            if self.stream:
                self.stream.close()
            raise
        self.on_s = 0.0
        self.tokens_on = 0
        self.trainer_cpu_s = 0.0
        self._t_on: float | None = None
        self._at_on = (0, 0)

    def __enter__(self) -> DuringLoad:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.stream:
                self.stream.close()
        finally:
            if self.trainer:
                self.trainer.close()

    def _counts(self) -> tuple[int, float]:
        return (self.stream.tokens if self.stream else 0, self.trainer.cpu_s() if self.trainer else 0.0)

    def on(self) -> None:
        self._t_on, self._at_on = time.perf_counter(), self._counts()
        if self.trainer:
            self.trainer.on()
        if self.stream:
            self.stream.on()

    def off(self) -> None:
        assert self._t_on is not None, "off() before on()"
        if self.trainer:
            self.trainer.off()
        if self.stream:
            self.stream.off()
        self.on_s += time.perf_counter() - self._t_on
        tokens, cpu_s = self._counts()
        self.tokens_on += tokens - self._at_on[0]
        self.trainer_cpu_s += cpu_s - self._at_on[1]
        self._t_on = None

    def figures(self) -> dict:
        """While on (from ``on`` to the end of ``off``: the ramp, the busy sync, the drain): generated tokens/s and the
        trainer's CPU (cores: CPU seconds / second). Each ``on`` waits for an answer per engine and for the trainer's
        CPU time to grow, so neither is 0 where it ran."""
        on = self.on_s or float("nan")
        return {
            "load": self.load,
            "on_s": self.on_s,
            "generated_tokens_per_s": self.tokens_on / on if self.stream else None,
            "trainer_cpu_cores": self.trainer_cpu_s / on if self.trainer else None,
            "trainer_steps_total": self.trainer.steps if self.trainer else None,
            "stream_concurrency_per_engine": self.stream.concurrency if self.stream else None,
        }


def _trainer_main(checkpoint: str, parent: int) -> int:
    """The actor process: build the Actor on ``checkpoint``, step on synthetic groups until the parent is gone."""
    import torch
    import torch.distributed as dist

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.models.spec import ModelSpec

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    dist.init_process_group("gloo")
    vocab = ModelSpec.from_pretrained(checkpoint).vocab_size
    groups = synthetic_groups(
        seed=0, num_groups=2, group_size=4, vocab_size=vocab, prompt_len=(16, 32), response_len=(32, 64)
    )
    actor = Actor(
        tiny_actor_config(checkpoint, actor={"max_tokens_per_microbatch": 4096}, runner={"max_steps": 1_000_000})
    )
    step = 0
    while os.getppid() == parent:
        t = actor.train_step(groups, step=step)["time/training"]
        print(f"step {step} {json.dumps(t)}", flush=True)
        step += 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--trainer":
        sys.exit(_trainer_main(sys.argv[2], int(sys.argv[3])))
    raise SystemExit(
        f"usage: {sys.argv[0]} --trainer CHECKPOINT PARENT_PID (weight_sync_bench.py --during-load runs it)"
    )
