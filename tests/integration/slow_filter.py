"""A ``rollout_buffer.sample_filter_path`` plug-in for tests: the first batch's filter takes ``SLOW_S``.

The filter runs on actor rank 0 alone, inside its batch phase, so it stands for any long leader-only work
(a slow user hook, a long eval, a long wait for data) while the other actor ranks wait.
"""

from __future__ import annotations

import os
import time

SLOW_S = float(os.environ.get("ASYNCRL_TEST_SLOW_FILTER_S", "10"))
_calls = 0


def slow_first_batch(groups: list) -> list:
    global _calls
    _calls += 1
    if _calls == 1:
        time.sleep(SLOW_S)  # the slow work itself, not a synchronization
    return groups
