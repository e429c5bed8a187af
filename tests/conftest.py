"""Hooks of the whole suite.

torchrun writes its per-rank error files under ``--log-dir``; without one it makes ``/tmp/torchelastic_<random>`` for
every launch and never removes it (torch's ``DefaultLogsSpecs``), so a suite run left ~40 of them behind and a
machine that ran it all day 1,835. ``PET_LOG_DIR`` is torchrun's environment form of ``--log-dir``: every torchrun
the tests start writes into one directory of this session's pytest temporary root instead (pytest keeps the last
three sessions' roots). It is set when the session starts, before the test modules are imported: some of them copy
``os.environ`` at import time.
"""

from __future__ import annotations

import os

_SET_HERE = False


def pytest_sessionstart(session):
    global _SET_HERE
    if "PET_LOG_DIR" in os.environ:  # the caller chose one
        return
    # the tmpdir plugin attaches its factory to the config at configure time (for hooks like this one)
    os.environ["PET_LOG_DIR"] = str(session.config._tmp_path_factory.mktemp("torchelastic"))
    _SET_HERE = True


def pytest_sessionfinish(session, exitstatus):
    if _SET_HERE:
        os.environ.pop("PET_LOG_DIR", None)
