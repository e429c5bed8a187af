"""A real Slurm: a preempted job of the embedded default is requeued by Slurm and resumes by itself.

A one-node cluster made here: Debian's ``slurm-wlm`` and ``munge`` (installed with apt when missing; the test skips,
saying why, only where apt cannot install them), ``munged`` (unless one already answers), ``slurmctld`` and
``slurmd`` started by this test with a ``slurm.conf`` it writes under its temporary directory, and stopped by PID at
the end (with any job left). The job is submitted as a user would (``launch/slurm/submit.sh configs/tiny.toml``
with ``--requeue``); after step 3 ``scancel -s USR1`` sends Slurm's preemption notice to the job's step (the first
run holds its fourth batch until the notice arrived, ``preempt_hooks``, so it checkpoints step 3 or 4 however fast
the machine; CI once saw step 6 of 6 trained before the notice without it). The job
must write its checkpoint, requeue itself (``scontrol requeue`` in the script: Restarts=1, same job id, same run
directory), resume from that checkpoint (the launcher's and the leader's log lines), log every step once in
metrics.jsonl and end COMPLETED 0:0.

Slurm holds a requeued job PENDING for the credential lifetime (``AuthInfo=cred_expire``, 120 s by default) before
it may start again; the cluster here sets it to ``CRED_EXPIRE_S``. Measured on 2 shared CPUs (Slurm 22.05.8 already
installed; apt adds about a minute): cluster up in 1-5 s, step 3 at 11-34 s, requeued within 3 s of the signal,
running again 23-47 s later, COMPLETED at 68-88 s; 72-94 s for the whole test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import REPO, free_port, read_metrics, tiny_env, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.slurm]  # its own CI step: python -m pytest -m slurm tests

CRED_EXPIRE_S = 20
"""Seconds a requeued job waits before it may start again (Slurm: cred_expire + 1)."""
MAX_STEPS = 6
SIGNAL_AFTER_STEP = 3
DEADLINE_S = 420
"""The whole job: both runs and the requeue between them."""


def _run(*cmd: str, env=None, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}: {r.stdout}{r.stderr}")
    return r


def _ensure_slurm_installed() -> None:
    """Debian's slurm-wlm and munge, installed with apt when missing; a clear skip where apt cannot."""
    need = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "munged", "munge")
    if all(shutil.which(c) for c in need):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and apt-get cannot install it here (not root, or no apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ("apt-get", "install", "-y", "-q", "slurm-wlm", "munge")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:  # a stale package index: refresh it once
        subprocess.run(("apt-get", "update", "-q"), env=env, capture_output=True, text=True, timeout=300)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not all(shutil.which(c) for c in need):
        pytest.skip(f"apt-get could not install slurm-wlm and munge: {(r.stdout + r.stderr)[-600:]}")


def _munge_answers() -> bool:
    enc = subprocess.run(("munge", "-n"), capture_output=True, timeout=10)
    if enc.returncode != 0:
        return False
    return subprocess.run(("unmunge",), input=enc.stdout, capture_output=True, timeout=10).returncode == 0


def _wait(what: str, cond, timeout_s: float, detail=lambda: ""):
    """Poll ``cond`` until it returns something true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; {detail()}")
        time.sleep(0.5)


SLURM_CONF = """\
ClusterName=asyncrltest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire={cred_expire}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=600
KillWait=30
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged (when none answers), slurmctld and slurmd of a one-node cluster, each started here in the
    foreground, so its PID is the daemon's; ``stop`` ends what it started, by PID."""

    def __init__(self, d: Path):
        self.d, self.procs = d, []
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True)
        host = socket.gethostname().split(".")[0]
        conf = SLURM_CONF.format(
            host=host,
            ctld_port=free_port(),
            d_port=free_port(),
            cred_expire=CRED_EXPIRE_S,
            d=d,
            cpus=os.cpu_count() or 1,
        )
        (d / "slurm.conf").write_text(conf)
        self.env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))

    def _start(self, name: str, *cmd: str, **kw) -> None:
        log = open(self.d / f"{name}.out", "w")  # noqa: SIM115  (closed with the process in stop)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, **kw)
        self.procs.append((name, p, log))

    def start(self) -> None:
        if not _munge_answers():
            for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
                Path(d).mkdir(parents=True, exist_ok=True)
                shutil.chown(d, "munge", "munge")
            self._start("munged", "munged", "--foreground", user="munge", group="munge")
            _wait("munged to answer", _munge_answers, 30, lambda: (self.d / "munged.out").read_text())
        conf = str(self.d / "slurm.conf")
        self._start("slurmctld", "slurmctld", "-D", "-i", "-f", conf)
        _wait("slurmctld", lambda: "UP" in self.scontrol("ping", check=False).stdout, 60, self.logs)
        self._start("slurmd", "slurmd", "-D", "-f", conf)
        idle = lambda: _run("sinfo", "-h", "-o", "%T", env=self.env, check=False).stdout.strip() == "idle"  # noqa: E731
        _wait("the node to be idle", idle, 60, self.logs)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("scontrol", *args, env=self.env, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        out = self.scontrol("show", "job", "-o", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def logs(self) -> str:
        return "".join(
            f"\n--- {p.name}:\n" + p.read_text(errors="replace")[-3000:]
            for p in sorted(self.d.glob("*.log")) + sorted(self.d.glob("*.out"))
        )

    def stop(self) -> None:
        for _name, p, log in reversed(self.procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
            log.close()


@pytest.fixture
def cluster(tmp_path):
    _ensure_slurm_installed()
    c = Cluster(tmp_path / "slurm")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").is_file() else []


def test_preempted_job_is_requeued_by_slurm_and_resumes(cluster, prepared, tmp_path):
    t0 = time.monotonic()
    timeline = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s  {what}")

    mark("cluster up")
    run_dir, out = tmp_path / "run", tmp_path / "job-%j.out"
    env = tiny_env(SLURM_CONF=cluster.env["SLURM_CONF"])
    env.update(
        RUN_DIR=str(run_dir),
        RDZV_PORT=str(free_port()),
        PYTHON=sys.executable,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]),  # this Python's torchrun
    )
    env["ASYNCRL_TEST_HOLD_MARK"] = str(tmp_path / "held")  # the first run holds batch 4 until the notice came
    hold = 'rollout_buffer.sample_filter_path="preempt_hooks:hold_fourth_batch_until_sigusr1"'
    overrides = tiny_overrides(prepared, run_dir, f"runner.max_steps={MAX_STEPS}", hold)
    sub = subprocess.run(
        ["bash", "launch/slurm/submit.sh", "configs/tiny.toml", *overrides, "--"]
        + ["--requeue", "--open-mode=append", f"--output={out}", "--job-name=asyncrl-slurm-test"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    assert "--nodes=1 --cpus-per-task=2" in sub.stdout and "--gpus-per-node" not in sub.stdout, sub.stdout
    job_id = re.search(r"Submitted batch job (\d+)", sub.stdout).group(1)
    log = Path(str(out).replace("%j", job_id))
    text = lambda: log.read_text(errors="replace") if log.is_file() else ""  # noqa: E731
    detail = lambda: f"job {cluster.job(job_id)}\n--- job log:\n{text()[-4000:]}{cluster.logs()}"  # noqa: E731
    try:
        mark(f"job {job_id} submitted")
        _wait(f"step {SIGNAL_AFTER_STEP}", lambda: max(_steps(run_dir), default=0) >= SIGNAL_AFTER_STEP, 240, detail)
        mark(f"step {max(_steps(run_dir))} logged: scancel -s USR1")
        _run("scancel", "-s", "USR1", job_id, env=cluster.env)
        _wait("the requeue", lambda: cluster.job(job_id).get("Restarts") == "1", 180, detail)
        mark(f"requeued ({cluster.job(job_id).get('JobState')})")
        _wait("the second run", lambda: cluster.job(job_id).get("JobState") == "RUNNING", 120, detail)
        mark("running again")
        done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        remaining = DEADLINE_S - (time.monotonic() - t0)
        _wait("the job's end", lambda: cluster.job(job_id).get("JobState") in done, max(remaining, 1), detail)
        mark(f"ended {cluster.job(job_id).get('JobState')}")
    finally:
        if cluster.job(job_id).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            _run("scancel", job_id, env=cluster.env, check=False)
            _wait("the cancelled job to end", lambda: cluster.job(job_id).get("JobState") != "RUNNING", 60, detail)
        print("\n".join(timeline))
    job, log_text = cluster.job(job_id), text()
    assert (job.get("JobState"), job.get("ExitCode"), job.get("Restarts")) == ("COMPLETED", "0:0", "1"), detail()
    preempted = re.search(r"preempted with its checkpoint written \((.*)\); requeueing it", log_text)
    assert preempted, detail()
    step = int(re.search(r'"step": (\d+)', preempted.group(1)).group(1))
    assert SIGNAL_AFTER_STEP <= step < MAX_STEPS, preempted.group(1)
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    assert 'runner.resume = "auto": resuming run' in log_text and f"from its checkpoint {ckpt}" in log_text
    assert f"resumed from {ckpt} at step {step}" in log_text, detail()
    assert "Traceback" not in log_text.split("requeueing it")[1], detail()
    assert _steps(run_dir) == list(range(1, MAX_STEPS + 1)), _steps(run_dir)
    assert time.monotonic() - t0 < DEADLINE_S
