"""The engines' Prometheus figures for the step records and the in-flight autotuner, read off the step loop's path.

``EngineScraper(urls)`` scrapes every engine's ``/metrics`` on its own thread (each call with a deadline); actor
rank 0's step loop reads ``latest()`` into every step record and hands ``autotune_figures()`` to the broker.

    scraper = EngineScraper(engine_urls, interval_s=5.0); m.update(scraper.latest()); scraper.close()
"""

from __future__ import annotations

import logging
import threading
import time

from asyncrl.engine.blocking import EngineStepError, get_text
from asyncrl.engine.client import parse_prometheus

log = logging.getLogger("asyncrl.trainer")


class EngineScraper:
    """Reads each engine's Prometheus ``/metrics`` (running requests, cache hit rate) on a background
    thread every ``interval_s``, so a slow engine (busy re-prefilling after a retract) never stalls
    the step loop; ``latest()`` returns the newest figures without blocking.

    For the in-flight autotuner it also sums, over engines, running requests, queued requests that
    are not retracted ones (a weight sync in ``retract`` mode puts every running request back in the
    queue: a backlog of the pause, not saturation) and ``gen_throughput``, and ``autotune_figures()``
    returns their mean over the scrapes since its last call (the step's, not one snapshot taken right
    after a sync, when the queue holds the re-prefill backlog). Its tokens/s is wall-clock: the change of
    each engine's ``generation_tokens_total`` counter between two scrapes over the time between them
    (``gen_throughput`` is the rate while the engine decodes: an engine idle half the time, starved by a
    small in-flight limit, reports the same figure; on the CPU default it even rose as the limit fell),
    ``gen_throughput`` only for an engine's first scrape or after its counter went back (a restart)."""

    AUTOTUNE_KEYS = ("running_reqs", "queue_reqs", "gen_tokens_per_s")

    def __init__(self, urls: list[str], *, interval_s: float = 5.0, timeout_s: float = 5.0, clock=time.monotonic):
        self.urls, self.interval_s, self.timeout_s, self.clock = urls, interval_s, timeout_s, clock
        self._tokens: dict[str, tuple[float, float]] = {}  # url -> (time, generation_tokens_total) at its last scrape
        self._latest: dict[str, float] = {}
        self._sums = dict.fromkeys(self.AUTOTUNE_KEYS, 0.0)
        self._n = 0
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # engines whose last scrape failed (logged once, until one answers again)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._record(self.scrape())
            self._stop.wait(self.interval_s)

    def _record(self, figures: dict[str, float]) -> None:
        with self._lock:
            self._latest = figures
            if "_autotune/running_reqs" in figures:  # at least one engine answered
                for k in self.AUTOTUNE_KEYS:
                    self._sums[k] += figures["_autotune/" + k]
                self._n += 1

    def latest(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in self._latest.items() if not k.startswith("_autotune/")}

    def autotune_figures(self) -> dict[str, float] | None:
        """Mean over the scrapes since the last call of the engines' summed running requests, queued (not
        retracted) requests and generated tokens/s; None when no scrape succeeded meanwhile."""
        with self._lock:
            if not self._n:
                return None
            out = {k: v / self._n for k, v in self._sums.items()}
            self._sums = dict.fromkeys(self.AUTOTUNE_KEYS, 0.0)
            self._n = 0
            return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)

    def _failed(self, url: str, e: Exception) -> None:
        """A failed scrape: a warning the first time in a row (a dead engine's failure is the supervisor's; a line a
        second about it, or about an engine stopped at the end of the run, only buries the log), then debug."""
        if url in self._failing:
            log.debug("engine %s: /metrics scrape failed again: %s", url, e)
            return
        self._failing.add(url)
        log.warning("engine %s: /metrics scrape failed: %s (said again only after it has answered)", url, e)

    def scrape(self) -> dict[str, float]:
        out: dict[str, float] = {}
        running, hit = [], []
        tune = dict.fromkeys(self.AUTOTUNE_KEYS, 0.0)
        for i, u in enumerate(self.urls):
            try:
                vals = parse_prometheus(get_text(u, "/metrics", timeout_s=self.timeout_s, step="metrics"))
            except (EngineStepError, OSError, ValueError) as e:  # a failed scrape is logged, never fatal
                self._failed(u, e)
                continue
            if u in self._failing:
                self._failing.discard(u)
                log.info("engine %s: /metrics answers again", u)
            # parse_prometheus keys series by name without the ``sglang:`` prefix
            r = vals.get("num_running_reqs", 0.0)
            h = vals.get("cache_hit_rate", 0.0)
            q = vals.get("num_queue_reqs", 0.0)
            out[f"engine/{i}/num_running_reqs"] = r
            out[f"engine/{i}/cache_hit_rate"] = h
            out[f"engine/{i}/num_queue_reqs"] = q
            out[f"engine/{i}/gen_throughput"] = vals.get("gen_throughput", 0.0)
            running.append(r)
            hit.append(h)
            tune["running_reqs"] += r
            tune["queue_reqs"] += max(0.0, q - vals.get("num_retracted_reqs", 0.0))
            tune["gen_tokens_per_s"] += self._tokens_per_s(u, vals)
        if running:
            out["sglang_num_running_reqs"] = sum(running) / len(running)
            out["sglang_cache_hit_rate"] = sum(hit) / len(hit)
            out["prefix_cache_hit_rate"] = out["sglang_cache_hit_rate"]  # Miles' per-step name
            out.update({"_autotune/" + k: v for k, v in tune.items()})
        return out

    def _tokens_per_s(self, url: str, vals: dict[str, float]) -> float:
        now, n = self.clock(), vals.get("generation_tokens_total")
        last = self._tokens.get(url)
        if n is None:
            return vals.get("gen_throughput", 0.0)
        self._tokens[url] = (now, n)
        if last is None or n < last[1] or now <= last[0]:
            return vals.get("gen_throughput", 0.0)
        return (n - last[1]) / (now - last[0])
