"""Shared helpers of the integration tests: free ports, torchrun jobs (scripts, and jobs of the embedded default
``configs/tiny.toml`` on the session's ``prepared`` artefacts, see conftest.py), leftover-process checks, and the
float tolerances of the parity tests (which must hold on any x86: kernels, thread counts and reduction orders
differ)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.cluster.ports import free_port
from asyncrl.engine.launch import free_rollout_port

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PREPARE_OVERRIDES = ["prepare.num_entities=60", "prepare.sft_steps=2", "prepare.sft_batch_size=8"]
"""The shared prepared artefacts' recipe (conftest's ``prepared``): 60 countries (the held-out set has 34 prompts)
and a warm start of 2 steps of 8 demos. Every job of the default passes it too, so its
preparation finds them made by its own recipe (``asyncrl.runner.prepare``)."""
TRAIN = REPO / "launch" / "train.py"

# float32 parity, relative to max(1, max|reference|): log-probs of a 1000-token vocabulary reach ~10 and entropies
# ~7, so one rounding step (eps 1.2e-7) there is ~1e-6 absolute; measured worst 1.4e-7 of the scale.
SCALED_REL = 1e-5
# a gradient norm sums squares over every parameter in a layout-dependent order: measured worst relative 2e-6
GRAD_NORM_REL = 1e-4
# weights after one Adam step from the same start: the step is ~lr per element whatever the gradient's size, and an
# element whose gradient is near Adam's eps turns float32 rounding of that gradient into up to 2.5e-6 at lr 1e-3
# (measured); lr/20 is still far below the ~lr a wrong gradient direction moves an element.
ADAM_STEP_REL = 0.05


def run_torchrun(
    script: Path, args: list[str], *, nproc: int = 2, timeout_s: float = 180
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N script args`` with the repo importable, one thread per rank."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


def run_benchmark(script: str, *args: str, timeout_s: float = 600) -> dict:
    """``python benchmarks/<script> args`` from the repo root, one OpenMP thread: asserts it exited 0 (else fails
    with the tail of its output) and returns its last stdout line's JSON (the benchmarks' report)."""
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),  # the script puts the repo on sys.path itself
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def scaled_maxdiff(a, b) -> float:
    """max |x - y| over paired tensors, divided by max(1, max |y|) (compare with ``SCALED_REL``)."""
    pairs = list(zip(a, b, strict=True))
    err = max((x - y).abs().max().item() for x, y in pairs)
    return err / max(1.0, max(y.abs().max().item() for _, y in pairs))


def pids_mentioning(text: str) -> list[int]:
    """PIDs (other than this one) whose command line contains ``text``, e.g. a test's run directory."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(int(d.name))
    return out


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...; sessions do not matter): a job's processes as
    Slurm's cgroup sees them, e.g. torchrun's ranks and their broker and engines."""
    parent = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def wait_for(pred, what: str, timeout_s: float = 30.0):
    """``pred()``'s first truthy value, polled every 50 ms; the test fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def ppid(pid: int) -> int:
    """``pid``'s parent (-1 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


def cmdline(pid: int) -> str:
    """``pid``'s command line, space-joined ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def assert_nothing_left(run_dir: Path, *, within_s: float) -> None:
    """No process whose command line names ``run_dir`` is left after ``within_s`` (a failure bound: polled)."""
    deadline = time.monotonic() + within_s
    while pids_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids_mentioning(str(run_dir)) == [], "processes of the run are left"


# ------------------------------------------------------------ jobs of the embedded default (configs/tiny.toml)


def tiny_overrides(prep: Path, run_dir: Path, *extra: str) -> list[str]:
    """``configs/tiny.toml`` overrides of a test job: the prepared artefacts under ``prep`` (conftest's
    ``prepared``, ``PREPARE_OVERRIDES``), ``run_dir``, a free broker port, 4 prompts x 2 samples a step, no
    before/after eval; then ``extra`` (a later override of the same key wins)."""
    return [
        f'prepare.dir="{prep}"',
        *PREPARE_OVERRIDES,
        f'actor.model_path="{prep}/model_sft"',
        f'data.train_path="{prep}/data/train.jsonl"',
        f'data.test_path="{prep}/data/test.jsonl"',
        f'agentloop.tool.corpus_path="{prep}/data/corpus.jsonl"',
        f'logging.run_dir="{run_dir}"',
        f"rollout.port={free_rollout_port()}",
        "data.rollout_batch_size=4",
        "algorithm.group_size=2",
        "runner.eval_before_after=false",
        *extra,
    ]


def tiny_env(**extra: str) -> dict[str, str]:
    """The job's environment: no inherited torchrun rendezvous variables, this folder (the test plug-ins:
    eval_helpers, nan_rewards, slow_filter) and the repo on PYTHONPATH, one OpenMP thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def tiny_cmd(
    prep: Path,
    run_dir: Path,
    *extra: str,
    nproc: int = 2,
    torchrun_args: tuple[str, ...] = (),
    config: str = "configs/tiny.toml",
) -> list[str]:
    """``torchrun --nproc_per_node N --master_port <free> [torchrun_args] launch/train.py <config> ...`` (``config``:
    configs/tiny.toml or a variant of it, such as configs/tiny_moe.toml)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        *torchrun_args,
        str(TRAIN),
        config,
        *tiny_overrides(prep, run_dir, *extra),
    ]


def run_job(
    prep: Path,
    run_dir: Path,
    *extra: str,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout_s: float = 300,
    config: str = "configs/tiny.toml",
) -> subprocess.CompletedProcess:
    """A job of the embedded default run to its end (``extra``: overrides); its exit status and output. A job still
    running after ``timeout_s`` is killed (its ranks follow their agent: the parent watchdog) and the error carries
    the last lines it printed, so a hang in CI shows where it hung."""
    try:
        return subprocess.run(
            tiny_cmd(prep, run_dir, *extra, nproc=nproc, config=config),
            cwd=REPO,
            env=env or tiny_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        tails = []
        for name, data in (("stdout", e.stdout), ("stderr", e.stderr)):
            text = data.decode(errors="replace") if isinstance(data, bytes) else data or ""
            tails.append(f"--- last lines of its {name}:\n" + "\n".join(text.splitlines()[-40:]))
        raise TimeoutError(f"job in {run_dir} did not finish within {timeout_s:g} s\n" + "\n".join(tails)) from None


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a finished run."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


class TinyJob:
    """A job of the embedded default started in the background (stdout+stderr into ``<run_dir>.out``), for tests
    that act on it while it runs. Waits are on conditions (a step in metrics.jsonl, a pid), never bare sleeps."""

    def __init__(
        self,
        prep: Path,
        run_dir: Path,
        *extra: str,
        nproc: int = 2,
        torchrun_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = run_dir.parent / f"{run_dir.name}.out"
        self._out = open(self.out_path, "w")  # noqa: SIM115 - closed in finish() / kill_all()
        self.proc = subprocess.Popen(
            tiny_cmd(prep, run_dir, *extra, nproc=nproc, torchrun_args=torchrun_args),
            cwd=REPO,
            env=env or tiny_env(),
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def records(self) -> list[dict]:
        """metrics.jsonl so far (a line being written is left out)."""
        p = self.run_dir / "metrics.jsonl"
        if not p.is_file():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
        return out

    def wait_for(self, what: str, pred, timeout_s: float = 120.0):
        """``pred()``'s first truthy value; fails the test if the job exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            if self.proc.poll() is not None:
                pytest.fail(f"job exited ({self.proc.returncode}) while waiting for {what}:\n{self.output()[-6000:]}")
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{self.output()[-6000:]}")

    def wait_step(self, step: int, timeout_s: float = 120.0) -> dict:
        return self.wait_for(
            f"step {step} in metrics.jsonl",
            lambda: next((r for r in self.records() if r.get("step", 0) >= step), None),
            timeout_s,
        )

    def engine_pid(self) -> int | None:
        """The CPU engine: the child of one of this job's ranks."""
        ranks = set(pids_mentioning(str(self.run_dir)))
        pids = [p for p in pids_mentioning("asyncrl.cpu_engine.server") if ppid(p) in ranks]
        return pids[0] if len(pids) == 1 else None

    def engine_port(self) -> int:
        argv = cmdline(self.engine_pid() or 0).split()
        return int(argv[argv.index("--port") + 1])

    def finish(self, timeout_s: float = 300.0) -> int:
        """The job's exit status (``subprocess.TimeoutExpired`` if it runs past ``timeout_s``)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._out.close()

    def kill_all(self) -> None:
        """Teardown of a failed test: SIGKILL torchrun and whatever of the job it left."""
        for pid in [self.proc.pid, *self.leftovers()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        self._out.close()

    def leftovers(self) -> list[int]:
        """The job's processes: torchrun, ranks and broker name the run directory; engines are children of ranks."""
        mine = set(pids_mentioning(str(self.run_dir)))
        return sorted(mine | {p for p in pids_mentioning("asyncrl.cpu_engine.server") if ppid(p) in mine})
