"""TensorBoard's custom-scalars layout: the charts that say whether a run is healthy come first.

TensorBoard's SCALARS / TIME SERIES tabs sort the groups by the part of a name before its first ``/``
(``actor``, ``broker``, ``engine``, ... ``train``), and names are a contract, so the plots both seed
documents say to look at first (reward, staleness, the two admission waits, the step's time split,
the engines' running and queued requests) sit screens down there. The CUSTOM SCALARS tab
(``http://<host>:6006/#custom_scalars``) shows this layout instead, in this order: ``health`` first.

The layout is data: categories of charts, each chart a list of metric names as ``docs/metrics.py`` lists
them (``{}`` = an engine's index, a tool's name, an environment metric's name); ``custom_scalars_layout`` turns it into what
``SummaryWriter.add_custom_scalars`` writes (a ``custom_scalars__config__`` summary). A chart's names
become anchored regular expressions (TensorBoard matches a chart's tags with ``re.match``), so
``time/step`` does not also draw ``time/step_...`` and ``engine/{}/...`` draws one line per engine.

    writer.add_custom_scalars(custom_scalars_layout())   # once per event file
"""

from __future__ import annotations

import re

LAYOUT: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    (
        "health",
        (
            ("reward", ("reward/mean",)),
            ("staleness (versions)", ("rollout/data_staleness/mean", "rollout/data_staleness/max")),
            (
                "admission waits: which limit binds (fraction of the step, exclusive)",
                ("rollout/buffer/admission_wait_inflight_limit", "rollout/buffer/admission_wait_buffer_full"),
            ),
            (
                "where the step goes (s)",
                ("time/step", "time/wait_data", "time/rollout", "time/training", "time/sync_weights"),
            ),
            ("engine requests: running, queued", ("engine/{}/num_running_reqs", "engine/{}/num_queue_reqs")),
        ),
    ),
    (
        "buffer",
        (
            (
                "in flight against the limit (groups)",
                (
                    "rollout/buffer/inflight_limit",
                    "rollout/buffer/mean_inflight_groups",
                    "rollout/buffer/num_buffered_groups",
                ),
            ),
            ("staleness split (versions)", ("rollout/version_span/mean", "rollout/queue_steps/mean")),
            (
                "groups filtered (per step)",
                ("rollout/fully_async/stale_groups_filtered", "rollout/fully_async/aborted_groups_filtered"),
            ),
        ),
    ),
    (
        "engines",
        (
            ("generated tokens/s", ("engine/{}/gen_throughput",)),
            ("prefix-cache hit rate", ("engine/{}/cache_hit_rate",)),
            ("weight sync split (s)", ("time/sync_control", "time/sync_gather", "time/sync_transfer")),
        ),
    ),
    (
        "agent",
        (
            ("turns and tool calls per trajectory", ("rollout/turns/mean", "rollout/tool_calls/mean")),
            ("tool calls per step, by tool", ("tool/{}/calls",)),
            ("failed tool calls per step (all tools, by tool)", ("tool/errors", "tool/{}/errors")),
            ("the environment's own metrics (Score.metrics)", ("env/{}",)),
        ),
    ),
    (
        "training",
        (
            ("loss", ("train/loss", "train/pg_loss")),
            ("gradient norm", ("train/grad_norm",)),
            ("off-policy", ("train/logprob_mismatch", "train/clip_fraction", "train/is_truncated_fraction")),
            ("off-policy masks", ("train/is_dropped_fraction", "train/stale_masked_fraction")),
            ("per-token staleness (versions)", ("train/token_staleness/mean", "train/token_staleness/max")),
            ("response tokens per trajectory", ("rollout/response_length/mean", "rollout/generated_tokens/mean")),
        ),
    ),
)
"""(category, ((chart title, metric names), ...)), in the order TensorBoard shows them."""


def _tag_regex(name: str) -> str:
    """A metric name as docs/metrics.py writes it -> the anchored regex of its TensorBoard tags: ``{}`` is an index
    under ``engine/`` (digits), a name elsewhere (a tool's, an environment metric's: anything)."""
    part = r"\d+" if name.startswith("engine/") else ".+"
    return re.escape(name).replace(re.escape("{}"), part) + "$"


def custom_scalars_layout() -> dict[str, dict[str, list]]:
    """``LAYOUT`` in the form ``SummaryWriter.add_custom_scalars`` takes: {category: {chart: ["Multiline", [regex]]}}."""
    return {
        category: {title: ["Multiline", [_tag_regex(n) for n in names]] for title, names in charts}
        for category, charts in LAYOUT
    }
