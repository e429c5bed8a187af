"""The custom-scalars layout: written into the run's TensorBoard event file, health charts first, every tag a
metric the project writes (docs/metrics.py's catalogue), and every chart's regexes draw exactly its metrics."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from asyncrl.trainer.tb_layout import LAYOUT
from asyncrl.trainer.writers import MetricsWriter

REPO = Path(__file__).resolve().parents[2]
HEALTH = [  # the seed documents' first plots: reward, staleness, which limit binds, the step's split, engine load
    ("reward", ["reward/mean"]),
    ("staleness (versions)", ["rollout/data_staleness/mean", "rollout/data_staleness/max"]),
    (
        "admission waits: which limit binds (fraction of the step, exclusive)",
        ["rollout/buffer/admission_wait_inflight_limit", "rollout/buffer/admission_wait_buffer_full"],
    ),
    ("where the step goes (s)", ["time/step", "time/wait_data", "time/rollout", "time/training", "time/sync_weights"]),
    ("engine requests: running, queued", ["engine/{}/num_running_reqs", "engine/{}/num_queue_reqs"]),
]


def _metrics_doc():
    spec = importlib.util.spec_from_file_location("metrics_doc", REPO / "docs" / "metrics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _layout_in_event_file(tb_dir: Path):
    """The layout the run's event files carry (TensorBoard's custom_scalars plugin reads this tag)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    acc = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert metadata.CONFIG_SUMMARY_TAG in acc.Tags()["tensors"], acc.Tags()
    events = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)
    assert len(events) == 1  # once per event file
    layout = layout_pb2.Layout()
    layout.ParseFromString(events[0].tensor_proto.string_val[0])
    return layout, acc


def _names(chart_regexes: list[str], tags: set[str]) -> set[str]:
    return {t for t in tags if any(re.match(rx, t) for rx in chart_regexes)}  # TensorBoard's match


def test_the_layout_is_in_the_event_file_health_first_and_draws_exactly_its_metrics(tmp_path):
    """Every layout name logged once (engines 0 and 1 for ``{}``) plus near-miss tags: each chart's regexes,
    read back from the event file, match exactly the tags of its own names."""
    names = [n for _, charts in LAYOUT for _, ns in charts for n in ns]
    fill = lambda n: ("0", "1") if n.startswith("engine/") else ("search", "lookup_2")  # noqa: E731  an index, a name
    concrete = {n: [n.replace("{}", x) for x in fill(n)] if "{}" in n else [n] for n in names}
    decoys = [
        "time/step_extra",
        "rollout/data_staleness/ratio_0",
        "engine/x/num_queue_reqs",
        "engine/0/num_queue_reqs2",
        "tool/search/calls_total",
        "tool/errors_total",
    ]
    w = MetricsWriter(tmp_path, console=False, jsonl=False)
    w.log({t: 1.0 for ts in concrete.values() for t in ts} | dict.fromkeys(decoys, 1.0), step=1)
    w.close()

    layout, acc = _layout_in_event_file(tmp_path / "tensorboard")
    assert [c.title for c in layout.category] == [c for c, _ in LAYOUT]
    assert layout.category[0].title == "health"
    health = [(ch.title, list(ch.multiline.tag)) for ch in layout.category[0].chart]
    assert [t for t, _ in health] == [t for t, _ in HEALTH]
    tags = set(acc.Tags()["scalars"])
    for (_, regexes), (_, want) in zip(health, HEALTH):
        assert _names(regexes, tags) == {t for n in want for t in concrete[n]}
    for category, (_, charts) in zip(layout.category, LAYOUT):
        for chart, (title, ns) in zip(category.chart, charts):
            assert chart.title == title
            assert _names(list(chart.multiline.tag), tags) == {t for n in ns for t in concrete[n]}, title


def test_every_layout_name_is_a_catalogued_metric_the_code_writes():
    """docs/metrics.py describes every metric the code writes; the layout names only those, and each is written
    somewhere besides the layout itself (a renamed metric fails here, not as an empty chart)."""
    doc = _metrics_doc()
    names = {n for _, charts in LAYOUT for _, ns in charts for n in ns}
    assert names - set(doc.DESCRIPTIONS) == set()
    layout_file = REPO / "asyncrl" / "trainer" / "tb_layout.py"
    written = doc.code_names(skip=(layout_file,))
    assert names - written == set()


def test_a_resumed_run_carries_the_layout_in_its_new_event_file(tmp_path):
    for purge in (None, 3):
        w = MetricsWriter(tmp_path, console=False, jsonl=False, purge_step=purge)
        w.log({"reward/mean": 1.0}, step=3)
        w.close()
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    for i, f in enumerate(files):  # each event file carries it (TensorBoard merges a run's layouts by title)
        one = tmp_path / f"file{i}"
        one.mkdir()
        (one / f.name).write_bytes(f.read_bytes())
        layout, _ = _layout_in_event_file(one)
        assert layout.category[0].title == "health"
