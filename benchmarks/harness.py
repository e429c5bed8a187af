"""The shared benchmark harness: repeat, interleave, median and spread, machine load, JSON last.

Every benchmark in ``benchmarks/`` compares two sides (the project and its baseline) by a ratio. On a
machine shared with other jobs the load changes from second to second, so:
  * the two sides of a ratio run interleaved, one repetition of each in turn (``interleave``), the order
    alternating from one repetition to the next, so neither side always runs first;
  * a ratio is taken per repetition (the two sides of one repetition saw the same load) and reported as
    the median over repetitions with its spread (``ratio``);
  * ``/proc/loadavg`` is read at the start and the end (``Report``), and the machine's speed measured
    (``speed``: a fixed matrix product and a Python loop), since the same load can run at different speeds;
  * every process that imports the harness keeps its freed heap memory for reuse, as the project's own
    processes do (``asyncrl.cluster.malloc``, applied here at import; recorded as ``malloc``), so a baseline
    in the benchmark's process does not pay the page faults the project's processes no longer pay;
  * the last stdout line is one JSON object: the figures, every ratio under a key ending ``_ratio`` with
    its target beside it, the command, the date and the load; ``--save`` also writes it to
    ``benchmarks/baselines/<name>.json`` (the last few runs are kept);
  * a benchmark that runs under ``Report.condition`` measures twice: ``idle`` (whatever else the machine runs:
    its load is recorded, not controlled) and ``loaded``, under a FIXED background load that the harness adds
    itself (``background_load``: ``LOAD_PROCS`` busy-looping Python processes, started before and stopped by
    PID after, each ending by itself if the benchmark dies); each condition's ratios and figures go under
    ``idle`` and ``loaded`` in the JSON, with the load measured during it (and at its start the cores busy right
    then, ``load_start.busy_cores`` from ``/proc/stat``: the 1-minute average lags a previous run). Targets hold at ``idle``
    (``targets_missed``); the ``loaded`` misses are listed apart (``targets_missed_loaded``). ``--load``
    picks ``both`` (default), ``idle`` or ``loaded``. A benchmark with a JSON of its own (no ``Report``) runs each
    condition under ``under_condition`` and files its record beside its figures; ``condition_view`` reads a run as
    its readers knew it before ``--load`` (the idle condition's figures over the top level).

    rep = Report("engine_bench", argv)
    t = interleave({"engine": run_engine, "hf": run_hf}, reps=5)   # seconds of each repetition
    rep.ratio("c64_speedup_ratio", t["hf"], t["engine"], target=1.5)  # hf / engine per repetition
    rep.emit({"times_s": {k: summary(v) for k, v in t.items()}})

    for cond in conditions(args.load):                      # "idle", then "loaded"
        with rep.condition(cond):                           # "loaded": two busy processes run meanwhile
            rep.ratio(...); rep.record({"times_s": ...})   # filed under doc[cond]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from asyncrl.cluster.cpu_load import busy_cores  # noqa: E402
from asyncrl.cluster.malloc import retain_freed_memory  # noqa: E402
from asyncrl.cluster.ports import free_port  # noqa: E402
from asyncrl.engine.launch import free_rollout_port  # noqa: E402

MALLOC = retain_freed_memory()
BASELINES = REPO / "benchmarks" / "baselines"
MIN_REPS = 5  # the floor: a single run on a shared machine is noise, not a baseline
KEEP_RUNS = 5  # runs kept per baseline file (each a different load condition)


def loadavg() -> dict[str, Any]:
    """``/proc/loadavg``: 1/5/15-minute load and running/total tasks (os.getloadavg elsewhere)."""
    try:
        f = Path("/proc/loadavg").read_text().split()
        return {"1m": float(f[0]), "5m": float(f[1]), "15m": float(f[2]), "tasks": f[3], "cpus": os.cpu_count()}
    except (OSError, IndexError, ValueError):
        one, five, fifteen = os.getloadavg()
        return {"1m": one, "5m": five, "15m": fifteen, "cpus": os.cpu_count()}


CALIBRATION_S = 0.25  # each of the two probes of ``speed``


def speed() -> dict[str, float]:
    """The machine's speed right now, next to its load: the same VM's step times moved by 25% within hours at the
    same load, so a figure is read against this. ``matmul_gflops_1t``: float32 256x256 matrix products on one
    thread; ``python_mops``: a pure-Python loop's iterations per microsecond (the interpreter-bound share of
    every benchmark). Each probe runs ``CALIBRATION_S``; higher is faster."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < CALIBRATION_S:
            for _ in range(20):
                torch.mm(a, b)
            n += 20
        gflops = n * 2 * 256**3 / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(threads)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < CALIBRATION_S:
        x = 0
        for i in range(10_000):
            x += i
        n += 10_000
    return {"matmul_gflops_1t": round(gflops, 2), "python_mops": round(n / (time.perf_counter() - t0) / 1e6, 2)}


def summary(xs: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and relative spread ((max - min) / median) of repeated figures."""
    if not xs:
        raise ValueError("summary of no repetitions")
    med = statistics.median(xs)
    return {
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "spread": (max(xs) - min(xs)) / med if med else float("nan"),
        "n": len(xs),
        "values": list(xs),
    }


def interleave(sides: dict[str, Callable[[], float]], *, reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each side once per repetition, alternating the order (AB, BA, AB, ...); ``warmup`` untimed
    rounds first. Each callable returns its own figure (seconds, or any measure). Returns the figures
    of the timed repetitions by side."""
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for n in names if i % 2 == 0 else names[::-1]:
            out[n].append(float(sides[n]()))
    return out


def fmt(s: dict[str, Any], unit: str = "", scale: float = 1.0) -> str:
    return (
        f"median {s['median'] * scale:.4g}{unit} (min {s['min'] * scale:.4g}, max {s['max'] * scale:.4g}, "
        f"spread {s['spread'] * 100:.0f}%, n={s['n']})"
    )


def add_args(ap: argparse.ArgumentParser, *, reps: int = MIN_REPS, load: bool = False) -> None:
    """The options every benchmark takes: ``--quick``, ``--reps``, ``--save``; and ``--load`` where the benchmark
    runs under ``Report.condition`` (``load=True``; elsewhere there is no such flag to be silently ignored)."""
    ap.add_argument("--quick", action="store_true", help="the small workload (under 2 minutes)")
    ap.add_argument("--reps", type=int, default=reps, help=f"timed repetitions of each side (default {reps})")
    ap.add_argument("--save", action="store_true", help="also write the JSON to benchmarks/baselines/<name>.json")
    if load:
        add_load_arg(ap)


LOAD_PROCS = 2  # the fixed background load: one busy process per core of the 2-core machine the baselines come from
# A busy loop that also ends when its parent (the benchmark, whose PID it is given: reading getppid() at its own start
# would miss a parent that died while it started) is gone: re-parented, getppid() changes.
_BUSY = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    for _ in range(200_000):\n        pass\n"
LOAD_STOP_S = 10.0  # SIGTERM, then SIGKILL after this


def conditions(load: str) -> list[str]:
    """``--load`` -> the conditions to run, in order."""
    if load not in ("both", "idle", "loaded"):
        raise ValueError(f"--load {load!r}: expected 'both', 'idle' or 'loaded'")
    return ["idle", "loaded"] if load == "both" else [load]


@contextlib.contextmanager
def background_load(n: int = LOAD_PROCS) -> Iterator[list[int]]:
    """``n`` busy-looping Python processes (one thread each, each its own process group) for the duration; yields
    their PIDs. Stopped by PID (SIGTERM to its group, SIGKILL after ``LOAD_STOP_S``); each also ends by itself
    within a moment of its parent's death."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BUSY, str(os.getpid())],
                    start_new_session=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(LOAD_STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(LOAD_STOP_S)


@contextlib.contextmanager
def under_condition(name: str) -> Iterator[dict[str, Any]]:
    """One condition of ``--load`` for the duration: ``loaded`` runs ``background_load`` meanwhile. Yields the
    condition's record (``background``: the busy processes' count and PIDs; ``load_start``, ``speed_start``; and
    ``load_end`` once the block is done), for a benchmark with a JSON of its own to file beside its figures under
    ``doc[name]`` (``Report.condition`` does it for a ``Report``)."""
    if name not in ("idle", "loaded"):
        raise ValueError(f"condition {name!r}: expected 'idle' or 'loaded'")
    print(f"--- {name}" + (f" (fixed background load: {LOAD_PROCS} busy processes)" if name == "loaded" else ""))
    with background_load() if name == "loaded" else contextlib.nullcontext([]) as pids:
        info: dict[str, Any] = {"background": {"busy_processes": len(pids), "pids": pids}}
        info["load_start"], info["speed_start"] = loadavg(), speed()
        # the load now: the 1-minute average still counts a previous benchmark's busy processes for a minute or more
        info["load_start"]["busy_cores"] = busy_cores(0.5)
        yield info
        info["load_end"] = loadavg()


def condition_view(doc: dict[str, Any], name: str = "idle") -> dict[str, Any]:
    """A benchmark's JSON as its readers knew it before ``--load``: ``doc[name]``'s ratios and figures over the top
    level (``doc`` itself where it has no such condition: a run from before ``--load``, or one of the other
    condition only)."""
    inner = doc.get(name)
    return {**doc, **inner} if isinstance(inner, dict) else doc


def add_load_arg(ap: argparse.ArgumentParser) -> None:
    """``--load`` alone, for a benchmark with options of its own instead of ``add_args``'s."""
    ap.add_argument(
        "--load",
        choices=("both", "idle", "loaded"),
        default="both",
        help=f"measure idle, under the fixed background load ({LOAD_PROCS} busy processes), or both (default)",
    )


class Report:
    """Collects one benchmark run's ratios and figures; ``emit`` prints the JSON (last) and saves it."""

    def __init__(self, name: str, argv: Sequence[str] | None = None):
        self.name = name
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.t0 = time.perf_counter()
        self.date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.load_start = loadavg()
        self.speed_start = speed()
        self.ratios: dict[str, dict[str, Any]] = {}
        self.conditions: dict[str, dict[str, Any]] = {}  # "idle"/"loaded" -> its ratios, figures and load
        self._cond: str | None = None

    @contextlib.contextmanager
    def condition(self, name: str) -> Iterator[None]:
        """Within it, ``ratio`` and ``record`` file under ``doc[name]``; ``loaded`` runs ``background_load``
        meanwhile (its PIDs and the load during it recorded)."""
        if name not in ("idle", "loaded"):
            raise ValueError(f"condition {name!r}: expected 'idle' or 'loaded'")
        if self._cond is not None:
            raise RuntimeError(f"condition {name!r} inside {self._cond!r}")
        c = self.conditions.setdefault(name, {"ratios": {}, "figures": {}})
        self._cond = name
        try:
            with under_condition(name) as info:
                c.update(info)
                yield
            c.update(info)  # its load_end
        finally:
            self._cond = None

    def record(self, figures: dict[str, Any]) -> None:
        """Figures of the current condition (``doc[condition]``); outside one, an error."""
        if self._cond is None:
            raise RuntimeError("record() outside a condition: pass the figures to emit()")
        self.conditions[self._cond]["figures"].update(figures)

    def ratio(
        self,
        key: str,
        num: Sequence[float],
        den: Sequence[float],
        *,
        target: float,
        at_least: bool = True,
        note: str = "",
    ) -> dict[str, Any]:
        """Per-repetition ratio ``num[i] / den[i]`` (pairs from the same repetition), its median and spread,
        and the target (``>=`` target when ``at_least``, else ``<=``)."""
        if not key.endswith("_ratio"):
            raise ValueError(f"ratio key {key!r} must end in '_ratio'")
        if len(num) != len(den) or not num:
            raise ValueError(f"{key}: {len(num)} and {len(den)} repetitions; the sides must pair up")
        s = summary([a / b for a, b in zip(num, den)])
        s.update(
            target=target,
            target_op=">=" if at_least else "<=",
            met=s["median"] >= target if at_least else s["median"] <= target,
        )
        if note:
            s["note"] = note
        (self.conditions[self._cond]["ratios"] if self._cond else self.ratios)[key] = s
        where = f"[{self._cond}] " if self._cond else ""
        verdict = "met" if s["met"] else "MISSED"
        print(f"{where}{key}: {fmt(s)}; target {s['target_op']} {target} -> {verdict}", flush=True)
        return s

    def emit(self, figures: dict[str, Any], *, save: bool = False) -> dict[str, Any]:
        doc = {
            "benchmark": self.name,
            "command": " ".join(["python", f"benchmarks/{self.name}.py", *self.argv]),
            "date": self.date,
            "load_start": self.load_start,
            "load_end": loadavg(),
            "speed_start": self.speed_start,
            "speed_end": speed(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "malloc": MALLOC,
            "wall_s": time.perf_counter() - self.t0,
            **{k: v for k, v in self.ratios.items()},
            "targets_missed": [k for k, v in self.ratios.items() if not v["met"]],
            **figures,
        }
        if self.conditions:
            doc["targets_missed_loaded"] = []
        for name, c in self.conditions.items():
            doc[name] = {k: v for k, v in c.items() if k not in ("ratios", "figures")} | c["ratios"] | c["figures"]
            missed = [k for k, v in c["ratios"].items() if not v["met"]]
            doc["targets_missed" if name == "idle" else "targets_missed_loaded"] += missed
        if self.conditions:
            self._print_side_by_side()
        text = json.dumps(doc, default=float)
        if save:
            self._save(doc)
        print(text, flush=True)
        return doc

    def _print_side_by_side(self) -> None:
        keys = list(dict.fromkeys(k for c in self.conditions.values() for k in c["ratios"]))
        names = list(self.conditions)
        print(f"{'ratio (median)':40s}" + "".join(f"{n:>10s}" for n in names))
        for k in keys:
            cells = [self.conditions[n]["ratios"].get(k, {}).get("median") for n in names]
            print(f"{k:40s}" + "".join(f"{c:10.3f}" if c is not None else f"{'-':>10s}" for c in cells))

    def _save(self, doc: dict[str, Any]) -> None:
        """Append to ``benchmarks/baselines/<name>.json`` (``runs``, the last ``KEEP_RUNS``): on a shared
        machine one run is one load condition, so a few are kept side by side."""
        path = BASELINES / f"{self.name}.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        prior = old.get("runs") if isinstance(old.get("runs"), list) else [old] if "date" in old else []
        runs = [r for r in prior if isinstance(r, dict) and r.get("benchmark") == self.name and "date" in r]
        runs = (runs + [doc])[-KEEP_RUNS:]
        BASELINES.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"benchmark": self.name, "latest": doc, "runs": runs}, indent=1, default=float) + "\n"
        )


def run_tiny_job(
    run_dir: Path, overrides: Sequence[str], *, timeout_s: float, what: str, threads: int = 1
) -> tuple[float, list[dict]]:
    """``torchrun --nproc_per_node 2 launch/train.py configs/tiny.toml <overrides>`` to its end (inherited
    rendezvous variables dropped, ``threads`` torch threads per process: ``OMP_NUM_THREADS`` for the ranks and
    ``NUM_THREADS_ENV`` for the CPU engine, which the launcher otherwise starts on one; above one, also
    ``OMP_WAIT_POLICY=PASSIVE``, ``OMP_WAIT_POLICY_NOTE``): its wall seconds and ``run_dir``'s metrics records. A
    failed job ends the benchmark naming ``what``, with the tail of its output and where its logs are kept
    (``keep_failed_run``); a job during which the checkout's code changed says which files (``source_stamps``), failed
    or not: on a tree others edit, a job whose processes started at different moments can run half an edit."""
    import subprocess

    from asyncrl.cpu_engine.args import NUM_THREADS_ENV  # here: it imports torch, which the harness itself need not

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = str(threads)
    env.pop(NUM_THREADS_ENV, None)
    if threads != 1:
        env[NUM_THREADS_ENV] = str(threads)
        # OpenMP threads that wait at a barrier sleep instead of spinning (OMP_WAIT_POLICY_NOTE)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += ["--log-dir", str(run_dir / "torchelastic")]  # not a /tmp/torchelastic_* of its own, never removed
    cmd += [str(REPO / "launch/train.py"), "configs/tiny.toml", *overrides]
    before = source_stamps()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall_s = time.perf_counter() - t0
    edited = changed_sources(before, source_stamps())
    torn = f"; the checkout's code changed while it ran (it may have loaded half an edit): {', '.join(edited)}"
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + "\n" + r.stderr[-6000:] + "\n")
        kept = keep_failed_run(run_dir, stdout=r.stdout, stderr=r.stderr)
        raise SystemExit(f"{what} failed (exit {r.returncode}){torn if edited else ''}; its logs are kept under {kept}")
    if edited:
        print(f"warning: {what}{torn}", file=sys.stderr, flush=True)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return wall_s, recs


OMP_WAIT_POLICY_NOTE = """Two threads a process on 2 shared cores: with OpenMP's default wait policy (spin at a
barrier before sleeping) the CPU engine generated 12-18 tok/s instead of 510-1188 with one thread (the tiny model,
concurrency 1 and 4, load 6-12 on 2 cores, 2026-12-07: ``engine_curve.py --levels 1,4 --rounds 1 --threads 2``);
with ``OMP_WAIT_POLICY=PASSIVE`` 694-753 tok/s. A thread spinning at a barrier holds the core its partner needs."""

SOURCE_DIRS = ("asyncrl", "launch", "configs")
"""What a tiny job's processes import or read from the checkout: every rank, the broker and the engine import it anew
when they start, so an edit saved while a job runs can give its processes two halves of one change."""


def source_stamps() -> dict[str, tuple[int, int]]:
    """``{path: (mtime_ns, size)}`` of the checkout's code and configs (``SOURCE_DIRS``; ``.py`` and ``.toml``)."""
    out = {}
    for d in SOURCE_DIRS:
        for f in (REPO / d).rglob("*"):
            if f.suffix in (".py", ".toml") and "__pycache__" not in f.parts:
                try:
                    st = f.stat()
                except FileNotFoundError:  # removed while listing: the comparison reports it
                    continue
                out[str(f.relative_to(REPO))] = (st.st_mtime_ns, st.st_size)
    return out


def changed_sources(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """The paths added, removed or modified between two ``source_stamps``, sorted."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


FAILED_RUNS = REPO / "runs" / "failed"  # gitignored; a failed job's run directory is copied here


def keep_failed_run(run_dir: Path, *, stdout: str, stderr: str) -> Path:
    """Copy a failed job's ``run_dir`` (every rank's, the broker's and the engine's logs, torchrun's) to a new
    directory under ``runs/failed/`` with torchrun's whole stdout and stderr beside it, and return it: the
    benchmarks run their jobs in a ``TemporaryDirectory``, which is removed when the failure ends them."""
    import shutil

    FAILED_RUNS.mkdir(parents=True, exist_ok=True)
    kept = Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%dT%H%M%S')}_{run_dir.name}_", dir=FAILED_RUNS))
    if run_dir.is_dir():
        shutil.copytree(run_dir, kept / run_dir.name, symlinks=True)
    (kept / "torchrun.stdout").write_text(stdout)
    (kept / "torchrun.stderr").write_text(stderr)
    return kept


def tiny_overrides(prep_dir: Path, run_dir: Path, *, steps: int) -> list[str]:
    """``configs/tiny.toml`` overrides of a benchmark job: the artefacts prepared under ``prep_dir``, ``run_dir``,
    a free engine port and ``steps`` steps (callers append their own keys after these)."""
    return [
        f'prepare.dir="{prep_dir}"',
        f'actor.model_path="{prep_dir}/model_sft"',
        f'data.train_path="{prep_dir}/data/train.jsonl"',
        f'data.test_path="{prep_dir}/data/test.jsonl"',
        f'agentloop.tool.corpus_path="{prep_dir}/data/corpus.jsonl"',
        f'logging.run_dir="{run_dir}"',
        f"rollout.port={free_rollout_port()}",
        f"runner.max_steps={steps}",
    ]
