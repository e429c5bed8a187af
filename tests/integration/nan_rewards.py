"""A ``rollout_buffer.sample_filter_path`` plug-in for tests: from the second batch on every reward is NaN
(stands for a broken reward function); the filter runs on actor rank 0 before the batch is trained."""

from __future__ import annotations

_calls = 0


def nan_from_second_batch(groups: list) -> list:
    global _calls
    _calls += 1
    if _calls >= 2:
        for g in groups:
            for t in g.trajectories:
                t.reward = float("nan")
    return groups
