"""The simulator (benchmarks/simulate.py) drives the real core and reproduces RLinf's three behaviours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SIM = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate.py"


def _load():
    spec = importlib.util.spec_from_file_location("asyncrl_simulate", SIM)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_simulator_reproduces_the_three_behaviours(tmp_path):
    figures = _load().run_all(True, tmp_path)
    assert all(figures["checks"].values()), figures["checks"]
    assert (tmp_path / "simulate.png").stat().st_size > 0


def test_simulator_says_which_limit_binds():
    sim = _load()
    starved = sim.simulate(sim.SimSetup(inflight=4, buffered=64, train_s=1.0, steps=8))
    assert starved.verdict().startswith("in-flight limit binds")
    train_bound = sim.simulate(sim.SimSetup(buffered=32, train_s=6.0, steps=8))
    assert train_bound.verdict().startswith("buffer limit binds")
