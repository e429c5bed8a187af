"""How busy the machine's CPUs are now, from ``/proc/stat`` (the 1-minute load average lags: after a heavy job ends
it still counts it for a minute or more).

    busy_cores(1.0)   # e.g. 1.93: other work kept ~2 cores busy over the last second (None: no /proc/stat)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

BUSY_WINDOW_S = 1.0


def busy_cores(window_s: float = BUSY_WINDOW_S) -> Optional[float]:
    """Cores' worth of CPU time the machine spent busy over the next ``window_s`` (the caller sleeps meanwhile, so
    it is other work), from ``/proc/stat``; None where it cannot be read."""

    def read() -> tuple[int, int]:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        return sum(v), v[3] + v[4]  # user nice system idle iowait irq softirq steal; idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(window_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)
