"""The sync-on-paper model (benchmarks/sync_model.py): its arithmetic on a case worked by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[2] / "benchmarks" / "sync_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("asyncrl_sync_model", MODEL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


sm = _load()
# 1e9 params in bf16 = 2e9 bytes; 4 actor ranks; 3 engines of 2 NICs; 10 GB/s NICs; a 20 GB/s gather link; 10 ms control
CASE = sm.SyncSetup(
    params=1e9, engines=3, engine_nics=2, actor_ranks=4, link_gb_s=10.0, gather_gb_s=20.0, control_s=0.01
)


def test_funnel_full_by_hand():
    r = sm.sync_time(CASE)
    assert r["gather_s"] == pytest.approx(2e9 * 3 / 4 / 20e9)  # 0.075 s: three of four shards come to rank 0
    assert r["transfer_s"] == pytest.approx(0.2)  # rank 0's one NIC: 2e9 / 10e9 (the engines' 2 NICs take 0.1)
    assert r["sync_s"] == pytest.approx(0.285)
    assert r["rank0_bytes"] == pytest.approx(2e9 + 1.5e9)  # what it sends plus what it gathers


def test_sharded_full_by_hand():
    r = sm.sync_time(replace(CASE, topology="sharded"))
    assert r["gather_s"] == 0.0
    assert r["transfer_s"] == pytest.approx(0.1)  # senders 2e9 / 4e10 = 0.05; each engine's 2 NICs 2e9 / 2e10 = 0.1
    assert r["sync_s"] == pytest.approx(0.11)
    assert r["rank0_bytes"] == pytest.approx(0.5e9)  # a quarter of the bytes


@pytest.mark.parametrize(
    "density, sent",
    [
        (0.0, 0.0),
        (0.01, 1e9 * 0.01 * (2 + 4)),  # index+value: 6e7 < bitmask 1.25e8 + 2e7
        (0.2, 1e9 / 8 + 1e9 * 0.2 * 2),  # bitmask+value: 5.25e8 < index+value 1.2e9
        (0.95, 2e9),  # bitmask 2.025e9 > full: sent whole
    ],
)
def test_delta_bytes_take_the_cheaper_encoding_and_never_exceed_full(density, sent):
    assert sm.sent_bytes(replace(CASE, density=density)) == pytest.approx(sent)


def test_sharded_delta_by_hand():
    r = sm.sync_time(replace(CASE, topology="sharded", density=0.01))
    assert r["transfer_s"] == pytest.approx(6e7 / 2e10)  # the engines' side binds: 0.003 s
    assert r["sync_s"] == pytest.approx(0.013)
    # the funnel still gathers full tensors (the delta is taken at rank 0)
    assert sm.sync_time(replace(CASE, density=0.01))["gather_s"] == pytest.approx(0.075)


def _run(date, at1, at2, load, *, conditioned=False):
    res = {"engines1": {"overhead_s": at1}, "engines2": {"overhead_s": at2}}
    if conditioned:  # harness --load: figures under idle and loaded
        return {"date": date, "command": date, "idle": {"results": res, "load_start": {"1m": load}}, "loaded": {}}
    return {"date": date, "command": date, "results": res, "load_start": {"1m": load}}


def test_control_cost_comes_from_the_least_loaded_run_that_measured_it():
    old_format = {"date": "x", "command": "x", "results": {"engines1": {}, "engines2": {}}, "load_start": {"1m": 0.0}}
    doc = {"runs": [_run("a", 0.007, 0.01, 0.4), old_format, _run("b", 0.03, 0.08, 5.6, conditioned=True)]}
    ctl = sm.control_from_runs(doc)
    assert (ctl["date"], ctl["at1_s"], ctl["per_engine_s"], ctl["load_1m"]) == ("a", 0.007, pytest.approx(0.003), 0.4)
    assert sm.control_for(5, ctl) == pytest.approx(0.019)
    doc["runs"].append(_run("c", 0.02, 0.03, 0.1, conditioned=True))  # the idle condition's load is read
    assert sm.control_from_runs(doc)["date"] == "c"
    doc["runs"].append(_run("d", 0.007, 0.005, 0.1))  # as quiet, later; a noisy pair: no negative per-engine cost
    assert sm.control_from_runs(doc)["date"] == "d" and sm.control_from_runs(doc)["per_engine_s"] == 0.0
    with pytest.raises(ValueError, match="overhead_s"):
        sm.control_from_runs({"runs": [old_format]})


def test_bad_setups_name_the_field():
    with pytest.raises(ValueError, match="topology"):
        sm.SyncSetup(params=1e9, topology="ring")
    with pytest.raises(ValueError, match="density"):
        sm.SyncSetup(params=1e9, density=1.5)


def test_the_anchor_table_prints_every_anchor_with_its_source(capsys):
    assert sm.main([]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["name"] for r in doc["rows"]] == [a[0] for a in sm.ANCHORS]
    assert all(r["source"] and r["published"] for r in doc["rows"])
    row = doc["rows"][0]  # 1T bf16 through one 50 GB/s NIC: the issue's ~40 s transfer, plus the gather
    assert row["funnel_full"]["transfer_s"] == pytest.approx(40.0)
