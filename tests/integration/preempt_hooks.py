"""A ``rollout_buffer.sample_filter_path`` plug-in for tests: while the third batch is assembled on actor rank 0 it
sends SIGTERM to this process and to its parent, torchrun, which forwards it to every rank -- as Slurm's time
limit arriving in the middle of a step. The batch is still trained. It fires once per marker file (the path in
``ASYNCRL_TEST_SIGTERM_MARK``), so the resumed run, which must keep the same config, trains on."""

from __future__ import annotations

import os
import signal
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
