"""Step guards of the actor loop: bad numbers stop the run; a preemption signal stops it after a checkpoint.

Contract
- ``NonFiniteGuard(limit)``: ``update(metrics)`` after each step counts the step as non-finite when its
  loss or grad norm was non-finite (the actor skipped it: ``train/step_skipped``) or any trained reward was
  non-finite (``rollout/nonfinite_rewards`` > 0). It adds ``train/nonfinite_steps`` (total) and
  ``train/nonfinite_consecutive`` to the metrics, and returns the error message once ``limit`` steps in a row
  were non-finite (``runner.max_nonfinite_steps``), else None. A finite step resets the run of bad steps.
  Pure: no I/O; the loop decides on actor rank 0 and broadcasts the verdict.
- ``NonFiniteError``: raised on every actor rank with that message; the job exits non-zero.
- Preemption: ``PREEMPT_SIGNALS`` are SIGUSR1 (Slurm's ``--signal`` notice) and SIGTERM (Slurm's time limit,
  ``scancel``, torchrun stopping its workers). SIGUSR1 (``PREEMPT_SIGNAL``) is ignored by every process of the
  job (``ignore_preempt_signal``: the launcher, and every child between fork and exec) except the actor ranks in
  their step loop; SIGTERM stops every other process as before, except the broker, which defers it while actor
  rank 0 lives (``asyncrl.broker.server``). In the step loop ``Preemption`` turns either signal into a flag.
  The flags of all actor ranks are checked between steps and right after training (the step's sync and eval are
  then skipped, and a sync that failed because the engines stopped is abandoned), actor rank 0's also while it
  waits for a batch; then every actor rank writes the checkpoint of the last trained step (with the broker's
  state: buffered groups, in-flight prompts) and raises ``Preempted``: the rank exits with ``PREEMPT_EXIT_CODE``
  (75), leaving ``PREEMPTED_MARKER`` in the run directory, and ``runner.resume`` continues. The engines are not needed for that checkpoint.

    guard = NonFiniteGuard(3); msg = guard.update(m); if msg: raise NonFiniteError(msg)
"""

from __future__ import annotations

import signal
import threading

PREEMPT_SIGNAL = signal.SIGUSR1
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
PREEMPT_EXIT_CODE = 75
"""Exit status of a rank that wrote its checkpoint on a preemption signal (EX_TEMPFAIL: run it again)."""
PREEMPTED_MARKER = "preempted.json"
"""Written in the run directory by a rank that exits with ``PREEMPT_EXIT_CODE`` (``asyncrl.runner.launcher``): what
a job script reads, since torchrun reports a rank's 75 as its own exit 1."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss, grad norm or reward."""


class NonFiniteGuard:
    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.consecutive = 0

    def update(self, m: dict) -> str | None:
        skipped = m.get("train/step_skipped", 0.0) == 1.0
        bad_rewards = m.get("rollout/nonfinite_rewards", 0.0)
        loss = m.get("train/loss")
        bad = skipped or bad_rewards > 0
        if bad:
            self.total += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        m["train/nonfinite_steps"] = float(self.total)
        m["train/nonfinite_consecutive"] = float(self.consecutive)
        if self.consecutive < self.limit:
            return None
        what = []
        if skipped:
            what.append(f"loss {loss!r}, grad norm {m.get('train/grad_norm')!r} (step skipped)")
        if bad_rewards > 0:
            what.append(f"{bad_rewards:.0f} non-finite rewards")
        return (
            f"{self.consecutive} consecutive steps with non-finite numbers (last: {'; '.join(what)}); "
            f"runner.max_nonfinite_steps = {self.limit}: stopping. Check actor.lr, the reward function and "
            f"the data; resume from the last checkpoint once fixed"
        )


class Preempted(RuntimeError):
    """A preemption signal arrived; the checkpoint of ``step`` (the last finished one) is written."""

    def __init__(self, step: int, path: str | None, signame: str = PREEMPT_SIGNAL.name):
        super().__init__(f"preempted (signal {signame}) after step {step}; checkpoint {path}")
        self.step, self.path, self.signame = step, path, signame


def ignore_preempt_signal() -> None:
    """SIG_IGN for the preemption signal (survives exec: children spawned after this ignore it too)."""
    signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)


class Preemption:
    """The preemption flag of one actor rank's step loop: ``install()`` … ``requested`` … ``restore()``.
    ``signame``: the first preemption signal that arrived."""

    def __init__(self):
        self._flag = threading.Event()
        self._old: dict = {}
        self.signame: str | None = None

    @property
    def requested(self) -> bool:
        return self._flag.is_set()

    def _on_signal(self, signum, frame) -> None:
        if self.signame is None:
            self.signame = signal.Signals(signum).name
        self._flag.set()

    def install(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPT_SIGNALS:
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            if old is not None:  # None: a handler not installed from Python; nothing to put back
                signal.signal(sig, old)
        self._old = {}
