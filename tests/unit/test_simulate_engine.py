"""The simulator's engine model: fitted to a measured curve, or the measured points as a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.simulate import EngineModel, curve_fit_report, fit_saturation, load_curve, main, saturation_tok_s

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


def test_fit_recovers_a_saturating_curve_and_reports_relative_error():
    points = [(c, saturation_tok_s(c, 1900.0, 16.0)) for c in (1, 2, 4, 8, 16, 32, 64)]
    peak, c_half = fit_saturation(points)
    assert peak == pytest.approx(1900.0, rel=0.01) and c_half == pytest.approx(16.0, rel=0.01)
    noisy = [(c, t * (1.1 if c == 8 else 1.0)) for c, t in points]
    report = curve_fit_report(noisy, *fit_saturation(noisy))
    worst = max(report, key=lambda r: abs(r["rel_err"]))
    assert worst["concurrency"] == 8 and worst["rel_err"] < 0  # the fit lies below the inflated point


def test_fit_rejects_too_few_or_nonpositive_points():
    for bad in ([(1, 100.0)], [(0, 10.0), (2, 20.0)], [(1, 10.0), (2, -1.0)]):
        with pytest.raises(ValueError, match="fit_saturation"):
            fit_saturation(bad)


def test_engine_model_table_interpolates_and_is_flat_past_the_last_point():
    m = EngineModel(max_running=64, curve=((1.0, 100.0), (4.0, 300.0), (16.0, 600.0)))
    assert m.tok_s(0) == 0.0 and m.tok_s(1) == 100.0
    assert m.tok_s(2) == pytest.approx(100.0 + 200.0 / 3)
    assert m.tok_s(16) == m.tok_s(40) == 600.0
    fitted = EngineModel(peak_tok_s=1000.0, c_half=10.0)
    assert fitted.tok_s(10) == 500.0 and fitted.tok_s(30) == 750.0  # no knee: still rising past c_half
    with pytest.raises(ValueError, match="EngineModel.curve"):
        EngineModel(curve=((4.0, 100.0), (2.0, 50.0)))


def test_cli_takes_a_measured_curve_and_prints_the_fit(tmp_path, capsys):
    curve = tmp_path / "curve.json"
    curve.write_text(
        json.dumps({"curve": [{"concurrency": c, "tok_s": saturation_tok_s(c, 1800.0, 12.0)} for c in (1, 4, 16, 64)]})
    )
    assert main([TINY, "--engine-curve", str(curve), "--train-s", "1.0", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "rel.err" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["engine"]["c_half"] == pytest.approx(12.0, rel=0.01)
    assert all(abs(e) < 0.01 for e in last["engine"]["rel_err"].values())
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        main([TINY, "--engine-curve", str(tmp_path / "bad.json"), "--train-s", "1.0"])
    assert "--engine-curve" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not an engine_curve.py result"):
        load_curve(str(tmp_path / "missing.json"))
