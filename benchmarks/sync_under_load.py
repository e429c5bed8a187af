"""What runs while a weight sync runs in a real run: engines generating and an actor training, switched on and off.

``weight_sync_bench.py --during-load generate+train`` times the same sync on quiet engines and while
  * ``generate``: a steady stream of ``/generate`` requests keeps every engine full (``GenerationStream``: a process
    of its own, as the agent workers are, with per engine ``concurrency`` client loops, each sending its next request
    as the last one returns, the agent loop's pattern; short requests, ``ignore_eos``, so a pause drains quickly);
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

Every wait has a deadline (``LOAD_TIMEOUT_S``; the trainer's start ``START_TIMEOUT_S``); both processes end with
their parent (the trainer watches ``getppid``, the stream ends at the end of its stdin) and are stopped by PID
(SIGCONT, SIGTERM, SIGKILL after a grace) when the block ends. A failed request ends the benchmark naming the
engine.
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
LOAD_TIMEOUT_S = 120.0  # a switch of the load on or off
START_TIMEOUT_S = 600.0  # the trainer's start-up: Megatron's import, the model's build and a first step of 575 MB
STOP_GRACE_S = 10.0
RUNNING_CPU_S = 0.02  # the trainer's CPU time that shows it running again after SIGCONT (two clock ticks)
NEW_TOKENS = 16  # per request: short, so the stream drains within a decode step or two when switched off
PROMPT_TOKENS = 32


class _Lines:
    """A child's stdout read on a thread of its own, line by line; ``next`` waits with a deadline."""

    def __init__(self, proc: subprocess.Popen, what: str, log: Path):
        self.proc, self.what, self.log = proc, what, log
        self._cond = threading.Condition()
        self._lines: list[str] = []
        self._closed = False
        self.count = 0
        """Lines read so far."""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self._lines.append(line.rstrip("\n"))
                self.count += 1
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next(self, what: str, timeout_s: float = LOAD_TIMEOUT_S) -> str:
        """The next line not taken yet; an error naming the child if it ends first or ``timeout_s`` passes."""
        with self._cond:
            got = self._cond.wait_for(lambda: self._lines or self._closed, timeout=timeout_s)
            if self._lines:
                return self._lines.pop(0)
        if got:
            raise RuntimeError(
                f"{self.what} pid {self.proc.pid} ended (exit {self.proc.wait(STOP_GRACE_S)}; {self.log})"
            )
        raise TimeoutError(f"{self.what} pid {self.proc.pid}: still not {what} after {timeout_s} s ({self.log})")

    def join(self) -> None:
        self._thread.join(STOP_GRACE_S)


def _spawn(args: list[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python sync_under_load.py <args> <this pid>``: its own process group, stdout a pipe, stderr to ``log``."""
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, __file__, *args, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen) -> None:
    """By its process group: SIGCONT (a stopped one cannot die), SIGTERM, SIGKILL after ``STOP_GRACE_S``."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_GRACE_S)


class GenerationStream:
    """The request stream, a process of its own as the agent workers are (``_stream_main``), driven over its stdin:
    ``on`` / ``off``, each answered on its stdout once done (``on <tokens>``, ``off <tokens>``: tokens generated so
    far), or ``error <what>``."""

    def __init__(self, urls: list[str], *, concurrency: int, vocab_size: int, log: Path):
        self.concurrency = concurrency
        self.tokens = 0
        self.proc = _spawn(
            ["--stream", json.dumps({"urls": urls, "concurrency": concurrency, "vocab": vocab_size})], log=log
        )
        self._out = _Lines(self.proc, "generation stream", log)

    def _say(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        kind, _, rest = self._out.next(f"answering {cmd!r}").partition(" ")
        if kind != cmd:
            raise RuntimeError(f"generation stream: {kind} {rest}")
        self.tokens = int(rest)

    def on(self) -> None:
        """Switch on; return once every engine has answered a request since."""
        self._say("on")

    def off(self) -> None:
        """Switch off; return once no request is in flight."""
        self._say("off")

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # its end of input: it ends by itself
            self.proc.wait(STOP_GRACE_S)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        finally:
            if self.proc.poll() is None:
                _stop(self.proc)
            self._out.join()


async def _stream_main(spec: dict) -> int:
    """The stream process: ``concurrency`` closed-loop clients per engine, switched by stdin lines (see
    ``GenerationStream``); ends at the end of its input (its parent gone or done). A failed request is answered
    ``error``, naming the engine."""
    from asyncrl.engine.client import SGLangClient

    loop = asyncio.get_running_loop()
    active, idle, closing = asyncio.Event(), asyncio.Event(), asyncio.Event()
    idle.set()
    state = {"in_flight": 0, "tokens": 0, "error": None, "answered": {u: 0 for u in spec["urls"]}}
    changed = asyncio.Condition()

    async def client(c, k: int) -> None:
        rng = random.Random(k)
        while not closing.is_set():
            await active.wait()
            if closing.is_set():
                return
            state["in_flight"] += 1
            prompt = [rng.randrange(3, spec["vocab"]) for _ in range(PROMPT_TOKENS)]
            try:
                r = await c.generate(prompt, {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}, return_logprob=False)
                err = None if len(r.output_ids) == NEW_TOKENS else f"{len(r.output_ids)} tokens of {NEW_TOKENS}"
            except Exception as e:  # noqa: BLE001 - any failure of the stream is reported, naming its engine
                err = f"{type(e).__name__}: {e}"
            state["in_flight"] -= 1
            if err:
                state["error"] = state["error"] or f"request to {c.url}: {err}"
                active.clear()
            else:
                state["answered"][c.url] += 1
                state["tokens"] += NEW_TOKENS
            async with changed:
                changed.notify_all()

    async def command(cmd: str) -> str:
        async with changed:
            if cmd == "on":
                start = dict(state["answered"])
                active.set()
                await changed.wait_for(
                    lambda: state["error"] or all(state["answered"][u] > start[u] for u in spec["urls"])
                )
            else:
                active.clear()
                await changed.wait_for(lambda: state["in_flight"] == 0)
        return f"error {state['error']}" if state["error"] else f"{cmd} {state['tokens']}"

    clients = [SGLangClient(u, request_timeout_s=LOAD_TIMEOUT_S) for u in spec["urls"]]
    tasks = [asyncio.create_task(client(c, k)) for c in clients for k in range(spec["concurrency"])]
    try:
        while cmd := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            print(await command(cmd), flush=True)
    finally:
        closing.set()
        active.set()  # let the waiting clients see the close
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            await c.close()
    return 0


class Trainer:
    """The actor process (``_trainer_main``), stopped (SIGSTOP, by its PID) until ``on``."""

    def __init__(self, checkpoint: Path, log: Path):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))}
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        self.log = log
        self.proc = _spawn(["--trainer", str(checkpoint)], log=log, env=env)
        self._out = _Lines(self.proc, "trainer", log)
        self._out.next("through its warm-up step", START_TIMEOUT_S)
        os.killpg(self.proc.pid, signal.SIGSTOP)

    @property
    def steps(self) -> int:
        """Steps finished so far (its warm-up included)."""
        return self._out.count

    def cpu_s(self) -> float:
        """CPU seconds the trainer has used (``/proc/<pid>/stat``: user + system, every thread)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def on(self) -> None:
        """Resume; return once it is running again: its CPU time has grown by ``RUNNING_CPU_S`` (a step of the default
        575 MB model takes seconds on one thread: waiting for one would make every busy repetition that long)."""
        start = self.cpu_s()
        os.killpg(self.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while self.cpu_s() < start + RUNNING_CPU_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer pid {self.proc.pid} exited with {self.proc.returncode} ({self.log})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer pid {self.proc.pid}: not running {LOAD_TIMEOUT_S} s after SIGCONT")
            time.sleep(0.005)

    def off(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def close(self) -> None:
        try:
            _stop(self.proc)
        finally:
            self._out.join()


class DuringLoad:
    """``load`` (one of ``LOADS``) on the engines at ``urls``, switched on and off around each busy sync."""

    def __init__(self, urls: list[str], load: str, *, checkpoint: Path, tmp: Path, concurrency: int, vocab_size: int):
        if load not in LOADS:
            raise ValueError(f"--during-load {load!r}: expected one of {', '.join(LOADS)}")
        self.load = load
        self.stream = (
            GenerationStream(urls, concurrency=concurrency, vocab_size=vocab_size, log=tmp / "stream.log")
            if "generate" in load
            else None
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
    if len(sys.argv) == 4 and sys.argv[1] == "--stream":
        sys.exit(asyncio.run(_stream_main(json.loads(sys.argv[2]))))
    raise SystemExit(
        f"usage: {sys.argv[0]} --trainer CHECKPOINT PARENT_PID | --stream SPEC PARENT_PID (weight_sync_bench.py "
        "--during-load runs them)"
    )
