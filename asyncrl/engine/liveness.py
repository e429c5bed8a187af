"""Liveness of an engine (SGLang or the CPU engine): one check, and the pure verdict over a stream of them.

Contract
- ``liveness(url, timeout_s)``: None when the engine is live, else what failed; every call bounded by ``timeout_s``.
  A paused engine is live, never hung. SGLang 0.5.23's ``/health`` runs a 1-token generation that waits out a pause
  and, when no scheduler output arrives for 20 s, answers 503 and marks the server unhealthy: a sync that pauses
  the engines longer than that (a slow first NCCL set-up, a slow bucket, a failed sync that leaves them paused by
  design) would read as a hang and get every paused engine killed. So the check reads the server's own flags
  first: ``/ready`` (200 = not paused and healthy; an open path) then a 1-token ``/generate`` (it waits while
  paused without marking anything, and SGLang aborts it when its client goes); not ready but ``/ping`` 200
  (healthy, paused or not) = paused and live; a generation that failed while ``/ready`` turned 503 meanwhile =
  the pause began during the check: live. The launcher starts engines with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``, so that nobody's ``/health`` (an operator's probe) can mark a
  paused engine unhealthy either. What it cannot see: a scheduler that hangs while paused; the sync's own step
  timeouts catch that one, and the recovery's wait names the engine.
- ``HealthTracker`` (pure): dead at once, hung once every check for ``rollout.unhealthy_after_s`` failed.

    why = liveness("http://10.0.0.2:30000", timeout_s=3.0)   # None, or "/ready did not answer within 3 s"
"""

from __future__ import annotations

import uuid
from typing import Optional

from asyncrl.engine.blocking import EngineStepError, get_text, post_json

HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
"""SGLang's switch (default on) that makes ``/health`` generate a token; the launcher turns it off."""


LIVENESS_PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "log_metrics": False}
"""The generation that proves a running (not paused) engine serves: one token, as SGLang's own health check."""


def _answers_200(url: str, path: str, timeout_s: float) -> Optional[bool]:
    """True on 200, False on another status, None when nothing answered within ``timeout_s``."""
    try:
        get_text(url, path, timeout_s=timeout_s, step="health")
    except EngineStepError as e:
        return False if e.status is not None else None
    return True


def paused_and_up(url: str, timeout_s: float) -> bool:
    """The engine is paused (``/ready`` 503) and its server healthy (``/ping`` 200): SGLang's two flags."""
    return _answers_200(url, "/ready", timeout_s) is False and _answers_200(url, "/ping", timeout_s) is True


def liveness(url: str, timeout_s: float) -> Optional[str]:
    """None when the engine is live: it generated a token, or it is paused with its server up; otherwise what
    failed (see module contract). Each call is bounded by ``timeout_s``."""
    ready = _answers_200(url, "/ready", timeout_s)
    if ready is None:
        return f"/ready did not answer within {timeout_s:g} s"
    if not ready:
        if _answers_200(url, "/ping", timeout_s):
            return None  # paused by a weight sync (or a failed one): live
        return "/ready and /ping answered 503 (the server marked itself unhealthy)"
    body = {**LIVENESS_PROBE, "rid": f"asyncrl-liveness-{uuid.uuid4().hex}"}
    try:
        post_json(url, "/generate", body, timeout_s=timeout_s, step="health", check_success=False)
    except EngineStepError as e:
        if paused_and_up(url, timeout_s):  # the pause began after /ready answered
            return None
        return f"a 1-token /generate failed: {e.detail}"
    return None


class HealthTracker:
    """Pure verdict over a stream of probes: ``observe(alive, ok, t)`` (``t``: when the probe ended) returns
    None while the engine is fine, ``"dead ..."`` once its process exited, ``"hung ..."`` once every probe
    since ``t0`` (the first failed one) failed and ``t - t0 >= unhealthy_after_s``.

        h = HealthTracker(unhealthy_after_s=10.0)
        h.observe(alive=True, ok=False, t=100.0)   # None (first failure at 100)
        h.observe(alive=True, ok=False, t=110.5)   # "hung: its liveness check failed for 10.5 s ..."
    """

    def __init__(self, *, unhealthy_after_s: float):
        self.unhealthy_after_s = unhealthy_after_s
        self.failing_since: Optional[float] = None

    def reset(self) -> None:
        self.failing_since = None

    def observe(
        self, *, alive: bool, ok: bool, t: float, exit_code: Optional[int] = None, why: Optional[str] = None
    ) -> Optional[str]:
        if not alive:
            return f"dead: the process exited with code {exit_code}"
        if ok:
            self.failing_since = None
            return None
        if self.failing_since is None:
            self.failing_since = t
        failed_s = t - self.failing_since
        if failed_s >= self.unhealthy_after_s:
            return (
                f"hung: its liveness check failed for {failed_s:.1f} s "
                f"(rollout.unhealthy_after_s={self.unhealthy_after_s:g})" + (f": {why}" if why else "")
            )
        return None
