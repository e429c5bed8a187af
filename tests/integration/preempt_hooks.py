"""A ``rollout_buffer.sample_filter_path`` plug-in for tests: while the third batch is assembled on actor rank 0 it
sends SIGTERM to this process and to its parent, torchrun, which forwards it to every rank -- as Slurm's time
limit arriving in the middle of a step. The batch is still trained. It fires once per marker file (the path in
``ASYNCRL_TEST_SIGTERM_MARK``), so the resumed run, which must keep the same config, trains on.
``hold_fourth_batch_until_sigusr1``: the Slurm test's, below."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_calls = 0


def sigterm_on_third_batch(groups: list) -> list:
    global _calls
    _calls += 1
    mark = Path(os.environ["ASYNCRL_TEST_SIGTERM_MARK"])
    if _calls == 3 and not mark.exists():
        mark.write_text("fired\n")
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getppid(), signal.SIGTERM)
    return groups


_held = 0


def hold_fourth_batch_until_sigusr1(groups: list) -> list:
    """Holds the fourth batch (on actor rank 0) until SIGUSR1 reached this process, so a preemption notice sent
    after step 3 is logged lands before step 4 is trained however fast the machine: the run checkpoints step 3
    or 4, never its last step. The step loop's own handler still runs (this one wraps it). Once per marker file
    (``ASYNCRL_TEST_HOLD_MARK``): the resumed run is not held. Gives up after 300 s (the test then fails on the
    step it finds)."""
    global _held
    _held += 1
    mark = Path(os.environ["ASYNCRL_TEST_HOLD_MARK"])
    if _held != 4 or mark.exists():
        return groups
    mark.write_text("held\n")
    arrived = []
    inner = signal.getsignal(signal.SIGUSR1)

    def on_usr1(signum, frame):
        arrived.append(signum)
        if callable(inner):
            inner(signum, frame)

    signal.signal(signal.SIGUSR1, on_usr1)
    try:
        deadline = time.monotonic() + 300
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.05)  # the handler runs between these waits, on this (the main) thread
    finally:
        signal.signal(signal.SIGUSR1, inner)
    return groups
