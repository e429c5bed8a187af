"""The README's picture of a healthy run: it is committed, shown, a real image, and docs/plot_run.py draws it.

The PNG is read with matplotlib (the dev extra has it); its header is checked by hand, so a file that only
looks like a PNG by name fails.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PICTURE = ROOT / "docs" / "healthy_run.png"
_spec = importlib.util.spec_from_file_location("plot_run", ROOT / "docs" / "plot_run.py")
plot_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_run)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; AssertionError when the file is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def assert_nontrivial(path: Path) -> None:
    """Many colours, and no colour covering nearly all of it: a plot, not a blank or single-colour image."""
    import matplotlib.image
    import numpy as np

    px = matplotlib.image.imread(path)[..., :3].reshape(-1, 3)
    colours, counts = np.unique((px * 255).round().astype(np.uint8), axis=0, return_counts=True)
    assert len(colours) >= 50, f"{path}: only {len(colours)} colours"
    assert counts.max() / counts.sum() < 0.95, f"{path}: one colour covers {counts.max() / counts.sum():.0%}"


def test_the_readme_shows_the_committed_picture_near_its_top():
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"!\[[^\]]+\]\((docs/healthy_run\.png)\)", readme)
    assert shown, "README.md does not show docs/healthy_run.png"
    assert readme.count("\n", 0, shown.start()) < 40, "the picture is not on the README's first screen"
    assert "docs/plot_run.py" in readme, "README.md does not say how the picture is made"
    w, h = png_size(PICTURE)
    assert 600 <= w <= 2000 and 300 <= h <= 1400, (w, h)
    assert 10_000 < PICTURE.stat().st_size < 200_000, PICTURE.stat().st_size
    assert_nontrivial(PICTURE)


def synthetic_run(n: int = 12) -> list[dict]:
    """Records shaped as a run writes them: an eval-only record at step 0 and at the end, one per step between."""
    recs = [{"step": 0, "eval/test/accuracy": 0.0}]
    for s in range(1, n + 1):
        recs.append(
            {
                "step": s,
                "reward/mean": s / n,
                "rollout/data_staleness/mean": min(s - 1, 2) * 0.9,
                "rollout/data_staleness/max": float(min(s - 1, 2)),
                "rollout/buffer/admission_wait_inflight_limit": 0.3,
                "rollout/buffer/admission_wait_buffer_full": 0.1 * (s % 4),
                "time/wait_data": 0.05,
                "time/training": 0.5 + 0.01 * s,
                "time/sync_weights": 0.03,
                "time/step": 0.6 + 0.01 * s,
            }
        )
    return [*recs, {"step": n, "eval/test/accuracy": 0.75}]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")  # a blank last line, as after a crash
    return path


def test_the_script_draws_the_four_panels_from_a_metrics_file(tmp_path):
    out = tmp_path / "run.png"
    assert plot_run.main([str(write_jsonl(tmp_path / "metrics.jsonl", synthetic_run())), "-o", str(out)]) == 0
    assert png_size(out) == (800, 480)  # 10 x 6 inches at the default 80 dpi
    assert_nontrivial(out)

    fig = plot_run.draw(synthetic_run(), title="t")
    reward, staleness, waits, split = fig.axes
    assert [ax.get_title() for ax in fig.axes] == list(plot_run.TITLES)
    lines = {ln.get_label(): ln for ax in (reward, staleness, waits) for ln in ax.get_lines()}
    assert list(lines["reward/mean"].get_ydata()) == [s / 12 for s in range(1, 13)]
    assert list(lines["held-out accuracy"].get_xdata()) == [0, 12]  # the eval-only records, by their steps
    assert list(lines["5-step mean"].get_ydata())[4] == pytest.approx(sum(range(1, 6)) / 5 / 12)
    assert {"mean", "max", "inflight_limit", "buffer_full"} <= set(lines)
    stacked = [p.get_y() + p.get_height() for p in split.patches[-12:]]  # sync_weights sits on the two below it
    assert stacked == pytest.approx([0.05 + 0.5 + 0.01 * s + 0.03 for s in range(1, 13)])


def test_a_file_without_a_panel_metric_is_refused_naming_it(tmp_path, capsys):
    recs = [{k: v for k, v in r.items() if k != "time/sync_weights"} for r in synthetic_run()]
    out = tmp_path / "run.png"
    assert plot_run.main([str(write_jsonl(tmp_path / "m.jsonl", recs)), "-o", str(out)]) == 1
    assert "time/sync_weights" in capsys.readouterr().err
    assert not out.exists()
