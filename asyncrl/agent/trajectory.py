"""The pieces of a trajectory the agent loop keeps: the turn gate (``pause_mode = "drain"``), the builder that keeps
ids, loss mask, log-probs, versions and routed experts aligned, and the summaries of finished trajectories (an eval's
``summarize_eval``, a trajectory's own metrics) (pure: no I/O).

    b = TrajectoryBuilder(prompt_ids, max_total_tokens=384)
    b.add_generated(ids, logprobs, versions); b.add_tool(obs_ids); traj = b.build(reward=1.0)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from asyncrl.broker.types import Trajectory

# ---------------------------------------------------------------- gate (drain)


class TurnGate:
    """Holds new turns while closed (``pause_mode = "drain"``: no new generate calls start)."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._num_waiting = 0

    @property
    def num_waiting(self) -> int:
        """Turns held at the gate right now (observable, e.g. by a test waiting for a turn to reach it)."""
        return self._num_waiting

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        if not self._open.is_set():
            self._num_waiting += 1
            try:
                await self._open.wait()
            finally:
                self._num_waiting -= 1


# ---------------------------------------------------------------- the trajectory accumulator (pure)


@dataclass
class TrajectoryBuilder:
    """Keeps ids, masks, log-probs and versions aligned; knows the room left."""

    prompt_ids: list[int]
    max_total_tokens: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: Optional[list[np.ndarray]] = None
    """Routing replay: the routed experts of positions ``0 .. routed_len - 1``, one array per reply (None: off)."""
    routed_len: int = 0

    @property
    def room(self) -> int:
        return self.max_total_tokens - len(self.prompt_ids) - len(self.response_ids)

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        assert len(ids) == len(logprobs) == len(versions)
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def add_tool(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def add_routed(self, rows: np.ndarray) -> None:
        """The routed experts of the next ``len(rows)`` positions."""
        self.routed.append(rows)
        self.routed_len += len(rows)

    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def routed_experts(self) -> Optional[np.ndarray]:
        """One row per position (-1 where unknown: the last position), or None (off, or no row known)."""
        rows = [r for r in self.routed or () if r.size]
        if not rows:
            return None
        out = np.full((len(self.prompt_ids) + len(self.response_ids), rows[0].shape[1]), -1, np.int32)
        out[: self.routed_len] = np.concatenate(rows)
        return out

    def build(self, **fields: Any) -> Trajectory:
        gen_versions = [v for v in self.versions if v >= 0]
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.logprobs,
            weight_versions=self.versions,
            min_version=min(gen_versions, default=0),
            max_version=max(gen_versions, default=0),
            routed_experts=self.routed_experts(),
            **fields,
        )


def summarize_eval(trajs: Sequence[Trajectory], reward_name: str = "accuracy") -> dict:
    """The mean reward of the trajectories that finished, under ``reward_name`` (also as ``reward_name``, so readers
    need not know the environment), their counts, and the means of the environment's ``env/<name>`` metrics."""
    done = [t for t in trajs if not t.aborted]
    n = len(done)
    out = {
        reward_name: sum(t.reward for t in done) / n if n else 0.0,
        "reward_name": reward_name,
        "num_prompts": len(trajs),
        "num_aborted": len(trajs) - n,
        "mean_turns": sum(t.num_turns for t in done) / n if n else 0.0,
        "mean_tool_calls": sum(t.num_tool_calls for t in done) / n if n else 0.0,
        "answer_rate": sum(t.finish_reason == "answer" for t in done) / n if n else 0.0,
        "errors": sorted({t.error for t in trajs if t.aborted})[:5],
    }
    sums: dict[str, list[float]] = {}
    for t in done:
        for k, v in trajectory_metrics(t).items():
            if k.startswith("env/"):
                sums.setdefault(k, []).append(v)
    out.update((k, sum(v) / len(v)) for k, v in sorted(sums.items()))
    return out


def trajectory_metrics(t: Trajectory) -> dict[str, float]:
    """A trajectory's ``extra["metrics"]`` (tool counts, ``env/<name>``) as a dict; empty when it has none."""
    raw = t.extra.get("metrics") if t.extra else None
    if not raw:
        return {}
    try:
        got = json.loads(raw)
    except ValueError:
        return {}
    return {k: float(v) for k, v in got.items() if isinstance(v, (int, float))} if isinstance(got, dict) else {}
