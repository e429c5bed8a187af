"""Fixtures of the whole suite.

torchrun writes its per-rank error files under ``--log-dir``; without one it makes ``/tmp/torchelastic_<random>`` for
every launch and never removes it (torch's ``DefaultLogsSpecs``), so a suite run left ~40 of them behind and a
machine that ran it all day 1,835. ``PET_LOG_DIR`` is torchrun's environment form of ``--log-dir``: every torchrun
the tests start (they pass this process's environment on) writes into one directory of this session's pytest
temporary root instead, which pytest removes with the session's other directories.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _torchrun_log_dir(tmp_path_factory):
    if "PET_LOG_DIR" in os.environ:  # the caller chose one
        yield
        return
    os.environ["PET_LOG_DIR"] = str(tmp_path_factory.mktemp("torchelastic"))
    try:
        yield
    finally:
        os.environ.pop("PET_LOG_DIR", None)
