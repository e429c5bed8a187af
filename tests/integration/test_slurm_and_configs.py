"""The Slurm script and the Search-R1 GPU configs, checked on a machine without Slurm or GPUs.

The sbatch script runs for real under bash, with stand-ins for the two Slurm commands it calls
(``scontrol`` answers the node list, ``srun`` records the command line it was given), so the test
sees the exact torchrun command each node would run. The configs go through the real launcher's
``--dry-run``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch/slurm/searchr1.sbatch"
TRAIN = str(ROOT / "launch/train.py")

FAKE_SCONTROL = """#!/bin/bash
# stand-in for Slurm's scontrol: 'show hostnames LIST', and 'requeue JOB' (fails with FAKE_REQUEUE_FAILS set)
echo "$@" >> "$FAKE_LOG_DIR/scontrol.args"
if [ "$1" = "requeue" ]; then
    if [ -n "${FAKE_REQUEUE_FAILS:-}" ]; then echo "scontrol: error: Requested operation is disabled" >&2; exit 1; fi
    exit 0
fi
if [ "$1 $2" != "show hostnames" ]; then echo "fake scontrol: unexpected $*" >&2; exit 1; fi
printf "${FAKE_NODES:-gpu-node07\\ngpu-node08}\\n"
"""

FAKE_SRUN = """#!/bin/bash
# stand-in for Slurm's srun: record the argument vector, one argument per line
printf '%s\\n' "$@" > "$FAKE_LOG_DIR/srun.args"
if [ -n "${FAKE_PROBE_URL:-}" ]; then  # what a rank would do: ask the retriever
    "$PYTHON" -c 'import sys, urllib.request; r = urllib.request.Request(sys.argv[1], b"{\\"queries\\": [\\"capital\\"]}",
        {"Content-Type": "application/json"}); print(urllib.request.urlopen(r, timeout=10).read().decode())' \\
        "$FAKE_PROBE_URL" > "$FAKE_LOG_DIR/probe.out"
fi
echo "fake srun ran"
if [ -n "${FAKE_PREEMPT:-}" ]; then  # what a preempted job's rank leaves (the launcher), and torchrun's exit 1
    echo '{"step": 3, "checkpoint": "ckpt", "signal": "SIGUSR1"}' > "$RUN_DIR_SEEN/preempted.json"
    exit 1
fi
exit "${FAKE_SRUN_RC:-0}"
"""


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if (
            k.startswith("SLURM_")
            or k
            in (
                "MASTER_ADDR",
                "MASTER_PORT",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "RUN_DIR",
                "RUN_NAME",
                "RDZV_PORT",
                "NPROC_PER_NODE",
                "TORCHRUN",
            )
            or k.startswith("RETRIEVER_")
        ):
            del env[k]
    return env


@pytest.fixture
def fake_slurm(tmp_path):
    """A submit directory (links to the repo's launch/ and configs/) and a PATH with fake srun/scontrol."""
    bin_dir, submit, logs = tmp_path / "bin", tmp_path / "submit", tmp_path / "logs"
    for d in (bin_dir, submit, logs):
        d.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (submit / "launch").symlink_to(ROOT / "launch")
    (submit / "configs").symlink_to(ROOT / "configs")

    def run(*args: str, job_id: str = "4242", **env_extra: str) -> subprocess.CompletedProcess:
        env = _clean_env()
        env.update(
            PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
            FAKE_LOG_DIR=str(logs),
            PYTHON=sys.executable,
            SLURM_JOB_ID=job_id,
            SLURM_JOB_NODELIST="gpu-node[07-08]",
            SLURM_JOB_NUM_NODES="2",
            SLURM_SUBMIT_DIR=str(submit),
            SLURM_CPUS_PER_TASK="64",  # sbatch sets these from its options
            SLURM_GPUS_ON_NODE="8",
        )
        env.update(env_extra)
        return subprocess.run(
            ["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    return run, submit, logs


def _srun_argv(logs: Path) -> list[str]:
    return (logs / "srun.args").read_text().splitlines()


def _value_after(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_sbatch_passes_bash_syntax_check():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_sbatch_header_fixes_no_shape_is_requeueable_and_logs_per_job():
    """The shape (nodes, GPUs) comes from the config's plan (submit.sh asks for it, the script checks it): the
    header asks for none, so a CPU cluster takes the script; it is requeueable (preemption requeues it)."""
    heads = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--ntasks-per-node=1" in heads and "--requeue" in heads and "--signal=USR1@180" in heads
    assert not [h for h in heads if h.startswith(("--nodes", "--gpus", "--gres", "--cpus-per-task", "--exclusive"))]
    output = [h for h in heads if h.startswith("--output=")]
    assert len(output) == 1 and "%j" in output[0]


@pytest.mark.parametrize(
    "config, shape",
    [
        ("configs/searchr1.toml", "--nodes=2 --gpus-per-node=8 --exclusive --cpus-per-task=64"),
        ("configs/tiny.toml", "--nodes=1 --cpus-per-task=2"),
    ],
)
def test_submit_asks_sbatch_for_the_plans_shape(tmp_path, config, shape):
    """submit.sh runs the dry run and calls sbatch with the plan's nodes, and GPUs only for a GPU config; the
    user's sbatch options after ``--`` come after (they win), the overrides go to the script."""
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path}/sbatch.args\n")
    fake.chmod(0o755)
    env = dict(_clean_env(), SBATCH=str(fake), PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        ["bash", "launch/slurm/submit.sh", config, "runner.max_steps=3", "--", "--requeue"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "sbatch.args").read_text().splitlines()
    assert argv == [
        *shape.split(),
        "--requeue",
        str(Path("launch/slurm/searchr1.sbatch")),
        config,
        "runner.max_steps=3",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/searchr1.toml", "configs/searchr1_sync.toml"])
def test_sbatch_builds_one_torchrun_per_node_with_a_job_rendezvous(fake_slurm, config):
    run, submit, logs = fake_slurm
    r = run(config, "runner.max_steps=5", job_id="4242")
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "fake srun ran" in r.stdout
    assert (logs / "scontrol.args").read_text().split() == ["show", "hostnames", "gpu-node[07-08]"]
    argv = _srun_argv(logs)
    # srun: one task per node on both nodes, with the job's CPUs (not inherited since Slurm 22.05), then torchrun
    t = argv.index("torchrun")
    assert _value_after(argv[:t], "--nodes") == "2"
    assert _value_after(argv[:t], "--ntasks-per-node") == "1"
    assert _value_after(argv[:t], "--cpus-per-task") == "64"
    # torchrun starts with SIGUSR1 ignored (Slurm's preemption notice is for the actor ranks): run the same
    # wrapper for real in front of a probe instead of torchrun
    wrapper = argv[argv.index("bash") : t]
    probe = subprocess.run(
        [*wrapper, sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.stdout.strip() == "True", probe
    torchrun = argv[t:]
    assert _value_after(torchrun, "--nnodes") == "2"
    assert _value_after(torchrun, "--nproc_per_node") == "8"
    assert _value_after(torchrun, "--rdzv-backend") == "c10d"
    assert _value_after(torchrun, "--rdzv-endpoint") == "gpu-node07:29500"  # the first node of the allocation
    assert _value_after(torchrun, "--rdzv-id") == "4242"
    # the program, its config, the per-job run directory, then the extra overrides in order
    p = torchrun.index("launch/train.py")
    run_dir = submit / "runs" / Path(config).stem  # named by the run: a requeue or a resubmit continues it
    assert torchrun[p + 1 :] == [config, f'logging.run_dir="{run_dir}"', 'runner.resume="auto"', "runner.max_steps=5"]
    assert run_dir.is_dir()
    # the config was validated before srun: the plan of the dry run is in the run directory
    plan = (run_dir / "plan.txt").read_text()
    assert "# plan: 16 ranks" in plan and f'run_dir = "{run_dir}"' in plan


@pytest.mark.slow
def test_jobs_get_their_own_rendezvous_and_the_runs_directory(fake_slurm):
    """Two jobs of one run (a resubmit: same RUN_NAME) share its run directory, each with its own rendezvous;
    another RUN_NAME is another directory."""
    run, submit, logs = fake_slurm
    seen = []
    for job, name in (("101", ""), ("102", ""), ("103", "second")):
        r = run(job_id=job, RDZV_PORT="29611", **({"RUN_NAME": name} if name else {}))
        assert r.returncode == 0, r.stderr
        argv = _srun_argv(logs)
        seen.append((_value_after(argv, "--rdzv-id"), argv[argv.index("launch/train.py") + 2]))
        assert _value_after(argv, "--rdzv-endpoint") == "gpu-node07:29611"
        assert argv[argv.index("launch/train.py") + 1] == "configs/searchr1.toml"  # the default config
    assert seen == [
        ("101", f'logging.run_dir="{submit}/runs/searchr1"'),
        ("102", f'logging.run_dir="{submit}/runs/searchr1"'),
        ("103", f'logging.run_dir="{submit}/runs/second"'),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, error",
    [
        ({"SLURM_JOB_NUM_NODES": "1"}, "the job has 1 node(s), the config's plan cluster.num_nodes = 2"),
        ({"NPROC_PER_NODE": "4"}, "NPROC_PER_NODE=4, the config's plan cluster.num_devices_per_node = 8"),
        ({"SLURM_GPUS_ON_NODE": ""}, "the job has no GPU(s) per node, the config"),
    ],
    ids=["nodes", "nproc", "gpus"],
)
def test_sbatch_checks_the_allocation_against_the_plan(fake_slurm, env, error):
    run, _, logs = fake_slurm
    r = run(**env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert error in r.stderr and "submit it as `sbatch --nodes=2 --gpus-per-node=8 ...`" in r.stderr, r.stderr
    assert not (logs / "srun.args").exists()


@pytest.mark.slow
def test_sbatch_runs_a_cpu_config_on_one_node_with_its_rank_count(fake_slurm):
    run, _, logs = fake_slurm
    r = run("configs/tiny.toml", SLURM_JOB_NUM_NODES="1", SLURM_GPUS_ON_NODE="", SLURM_CPUS_PER_TASK="2")
    assert r.returncode == 0, r.stdout + r.stderr
    argv = _srun_argv(logs)
    assert _value_after(argv, "--nnodes") == "1" and _value_after(argv, "--nproc_per_node") == "2"


@pytest.mark.slow
@pytest.mark.parametrize("requeue_fails", [False, True], ids=["requeued", "not-requeueable"])
def test_sbatch_requeues_a_preempted_job(fake_slurm, requeue_fails):
    """The ranks' preempted.json (torchrun's exit is 1) makes the script requeue its own job; where Slurm refuses,
    the job exits 75 naming the RUN_NAME to resubmit. A stale file from an earlier job is removed before srun."""
    run, submit, logs = fake_slurm
    run_dir = submit / "runs" / "searchr1"
    run_dir.mkdir(parents=True)
    (run_dir / "preempted.json").write_text("{}\n")
    r = run(FAKE_SRUN_RC="1")  # a job that failed for another reason: no requeue, its own status
    assert r.returncode == 1 and "requeue" not in (logs / "scontrol.args").read_text(), r.stdout + r.stderr
    extra = {"FAKE_REQUEUE_FAILS": "1"} if requeue_fails else {}
    r = run(FAKE_PREEMPT="1", RUN_DIR_SEEN=str(run_dir), **extra)
    assert "preempted with its checkpoint written" in r.stdout, r.stdout + r.stderr
    assert "requeue 4242" in (logs / "scontrol.args").read_text()
    if requeue_fails:
        assert r.returncode == 75 and "submit it again with RUN_NAME=searchr1" in r.stderr, r.stderr
    else:
        assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_sbatch_bad_config_fails_before_srun(fake_slurm):
    run, _, logs = fake_slurm
    r = run("configs/searchr1.toml", "rollout.pause_mode=abort")
    assert r.returncode != 0
    assert "config error: rollout.pause_mode" in r.stderr
    assert not (logs / "srun.args").exists()


@pytest.mark.slow
def test_sbatch_outside_slurm_refuses(tmp_path):
    env = _clean_env()
    r = subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "SLURM_JOB_ID" in r.stderr


def test_sbatch_uses_no_bash_feature_newer_than_4_2():
    """Static check (no bash 4.2 here): under ``set -u``, bash < 4.4 fails on ``"${a[@]}"`` of an EMPTY array,
    so every expansion of the possibly-empty OVERRIDES array carries the ``${a[@]+...}`` guard; and none of
    the 4.3+ features (namerefs, ``wait -n``, negative subscripts, ``${x@Q}``, ``mapfile -d``) is used."""
    text = "\n".join(line for line in SBATCH.read_text().splitlines() if not line.lstrip().startswith("#"))
    guarded = text.count('${OVERRIDES[@]+"${OVERRIDES[@]}"}')
    assert guarded >= 1 and text.count('"${OVERRIDES[@]}"') == guarded
    for newer in ("declare -n", "local -n", "wait -n", "[-1]}", "@Q}", "@E}", "@P}", "mapfile -d", "readarray -d"):
        assert newer not in text, newer


@pytest.mark.slow
def test_sbatch_srun_without_cpus_per_task_passes_none(fake_slurm):
    run, _, logs = fake_slurm
    r = run(SLURM_CPUS_PER_TASK="")
    assert r.returncode == 0, r.stderr
    assert "--cpus-per-task" not in _srun_argv(logs)
    # the default config's retriever URL is loopback, called from both nodes: said before srun
    assert "retriever_url=http://127.0.0.1:8000/retrieve is loopback" in r.stderr


@pytest.mark.slow
def test_sbatch_starts_the_retriever_where_both_nodes_reach_it(fake_slurm, tmp_path):
    import socket

    run, submit, logs = fake_slurm
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        '{"id": "0", "contents": "Paris is the capital of France"}\n{"id": "1", "contents": "Berlin is a city"}\n'
    )
    host, port = socket.gethostname(), proc_helpers.free_port()  # the head node is this machine
    cmd = f"{sys.executable} -m asyncrl.agent.tools.retrieval_server --corpus {corpus} --host 0.0.0.0 --port {port}"
    url = f"http://{host}:{port}/retrieve"
    r = run(
        "configs/searchr1.toml",
        "runner.max_steps=3",
        RETRIEVER_CMD=cmd,
        RETRIEVER_PORT=str(port),
        FAKE_NODES=f"{host}\\nother-node",
        FAKE_PROBE_URL=url,
        PYTHONPATH=str(ROOT),
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert f"retriever ready at {url}" in r.stdout and "loopback" not in r.stderr
    torchrun = _srun_argv(logs)
    p = torchrun.index("launch/train.py")
    run_dir = submit / "runs" / "searchr1"
    assert torchrun[p + 1 :] == [
        "configs/searchr1.toml",
        f'logging.run_dir="{run_dir}"',
        'runner.resume="auto"',
        f'agentloop.tool.retriever_url="{url}"',
        "runner.max_steps=3",
    ]
    assert f'retriever_url = "{url}"' in (run_dir / "plan.txt").read_text()
    assert "Paris is the capital" in (logs / "probe.out").read_text()  # it answered while the job ran
    assert proc_helpers.pids_mentioning(str(corpus)) == []  # and was stopped with the job


@pytest.mark.slow
def test_sbatch_retriever_that_dies_fails_before_srun(fake_slurm):
    run, submit, logs = fake_slurm
    r = run(
        RETRIEVER_CMD="echo 'no index at /data/e5' >&2; exit 4",
        RETRIEVER_HOST="127.0.0.1",
        RETRIEVER_PORT=str(proc_helpers.free_port()),
    )
    assert r.returncode == 3
    assert "retriever exited" in r.stderr and "no index at /data/e5" in r.stderr
    assert not (logs / "srun.args").exists()


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = _clean_env()
    return subprocess.run(
        [sys.executable, TRAIN, *args, "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_sync_config_dry_run_prints_placement_and_derived_values():
    r = _dry_run("configs/searchr1_sync.toml")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# plan: 16 ranks, mode sync, 8 engine(s), actor TP 2 x PP 1 x DP 4" in out
    assert "async_mode = false\n" in out
    for rank in range(8):
        assert f"\n{rank:<5} 0     actor    cuda:{rank}" in out
    for rank in range(8, 16):
        assert f"\n{rank:<5} 1     rollout  cuda:{rank - 8}        engine {rank - 8} (SGLang server" in out
    assert "max_inflight_groups = 308  # derived" in out
    assert "max_buffered_groups = 1024  # derived" in out
    assert 'submission_granularity = "group"  # derived' in out  # sync mode frees slots per group


@pytest.mark.slow
def test_async_config_dry_run_mode_and_granularity():
    r = _dry_run("configs/searchr1.toml")
    assert r.returncode == 0, r.stderr
    assert "# plan: 16 ranks, mode async" in r.stdout
    assert 'submission_granularity = "group"  # derived' in r.stdout  # RLinf's counting: no Miles setting asks


def test_sync_config_is_the_async_config_with_async_mode_off():
    from asyncrl.config import load_config
    from asyncrl.config.loader import to_dict

    a = to_dict(load_config(ROOT / "configs/searchr1.toml", []))
    s = to_dict(load_config(ROOT / "configs/searchr1_sync.toml", []))
    diff = {(sec, k) for sec in a for k in a[sec] if a[sec][k] != s[sec][k]}
    assert diff == {("runner", "async_mode"), ("logging", "run_dir")}, diff
    assert a["runner"]["async_mode"] is True and s["runner"]["async_mode"] is False
    # the RLinf reference layout: actor on node 0, rollout and reward on node 1
    assert a["cluster"]["component_placement"] == {"actor": "0-7", "rollout,reward": "8-15"}
    assert a["rollout"]["rollout_backend"] == "sglang" and a["rollout"]["sglang"]["backend_type"] == "server"
    assert "Qwen2.5-3B-Instruct" in a["actor"]["model_path"]
    assert a["agentloop"]["tool"]["retriever"] == "http" and a["agentloop"]["tool"]["retriever_url"].startswith("http")
