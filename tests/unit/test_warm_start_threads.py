"""The warm start's torch threads come from the load at its start (``choose_threads``, pure): on a busy machine
every usable core oversubscribed it (7 s a step at load 7 on 2 cores with 2 threads, several times slower than
1 thread); the choice and its reason are one log line."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from asyncrl.cluster.cpu_load import busy_cores
from asyncrl.config import load_config
from asyncrl.embedded import warm_start as ws
from asyncrl.embedded.warm_start import choose_threads, warm_start
from asyncrl.runner.prepare import prepare_if_needed


@pytest.mark.parametrize(
    "usable,cpus,load,threads",
    [
        (2, 2, 7.0, 1),  # the busy case of the issue: other work fills both cores
        (2, 2, 2.0, 1),  # one core's worth of other work
        (2, 2, 1.6, 1),  # ... most of one
        (2, 2, 1.0, 2),  # this process alone (it counts for up to 1)
        (2, 2, 0.2, 2),  # an idle machine
        (4, 64, 3.0, 4),  # at most the cores this process may use
        (8, 64, 60.0, 5),  # the load counts over the whole machine: 5 cores idle
        (16, 16, 40.0, 1),  # at least 1
    ],
)
def test_threads_follow_the_idle_cores(usable, cpus, load, threads):
    n, why = choose_threads(requested=0, usable=usable, cpus=cpus, load=load)
    assert n == threads, why
    assert f"load average {load:.1f} on {cpus} CPUs" in why
    assert ("oversubscribe" in why) == (n < usable)


def test_a_set_thread_count_or_an_unknown_load():
    assert choose_threads(requested=3, usable=2, cpus=2, load=7.0) == (3, "prepare.num_threads = 3")
    n, why = choose_threads(requested=0, usable=4, cpus=4, load=None)
    assert n == 4 and "no load average" in why


def test_the_warm_start_runs_on_the_chosen_threads_and_says_why(tmp_path, monkeypatch, caplog):
    root = Path(__file__).resolve().parents[2]
    small = ["prepare.num_entities=40", "prepare.num_layers=2", "prepare.sft_steps=2", "prepare.sft_batch_size=4"]
    cfg = load_config(root / "configs/tiny.toml", [f'prepare.dir="{tmp_path}"', *small])
    stages = prepare_if_needed(cfg, upto="model")
    monkeypatch.setattr(ws, "busy_cores", lambda: 6.0)  # other work keeps 6 cores' worth busy: load 7 with this one
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before, during = torch.get_num_threads(), []
    with caplog.at_level(logging.INFO, logger="asyncrl.prepare"):
        warm_start(
            cfg,
            data_dir=stages["data"],
            base_dir=stages["model"],
            out_dir=tmp_path / "sft",
            on_step=lambda step, model: during.append(torch.get_num_threads()),
        )
    assert during == [1, 1] and torch.get_num_threads() == before
    said = [r.getMessage() for r in caplog.records if "torch thread" in r.getMessage()]
    assert said == [
        "prepare: warm start on 1 torch thread(s): 1 of 2 usable cores: cores busy over the last 1 s (/proc/stat) + "
        "this process: 7.0 on 2 CPUs (this process counts for up to 1) leaves 0.0 idle; more threads would "
        "oversubscribe (prepare.num_threads sets it)"
    ]


def test_the_busy_cores_are_read_now_and_follow_real_work():
    """``busy_cores`` sees work that runs during its window (two busy processes on this machine), not the minute's
    average: with them it reads at least one core busier than without."""
    import subprocess
    import sys

    quiet = busy_cores(0.5)
    assert quiet is not None and 0.0 <= quiet <= (os.cpu_count() or 1) + 1e-6
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])]
    spin.append(subprocess.Popen(spin[0].args))
    try:
        busy = busy_cores(0.5)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert busy is not None and busy >= min(quiet + 0.8, (os.cpu_count() or 1) * 0.9), (quiet, busy)
