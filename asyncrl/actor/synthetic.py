"""Deterministic synthetic batches and configs for the actor's tests and benchmark (no I/O)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.config.schema import ActorConfig, AlgorithmConfig, Config, RunnerConfig


def synthetic_groups(
    *,
    seed: int,
    num_groups: int,
    group_size: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = (4, 12),
    response_len: tuple[int, int] = (3, 20),
    tool_span: bool = True,
    equal_reward_group: bool = True,
    behav_logp: float = -6.9,
    behav_noise: float = 0.3,
) -> list[Group]:
    """Random token groups: rewards in {0, 1} (the first group all equal if ``equal_reward_group``),
    a masked "tool" span inside some responses, rollout log-probs around ``behav_logp``."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_len))]
        trajs = []
        for _ in range(group_size):
            n = rng.randint(*response_len)
            resp = [rng.randrange(3, vocab_size) for _ in range(n)]
            mask = [1] * n
            if tool_span and n >= 6 and rng.random() < 0.5:
                a = rng.randrange(1, n - 3)
                for j in range(a, a + 3):
                    mask[j] = 0
            lps = [behav_logp + behav_noise * rng.gauss(0, 1) if m else 0.0 for m in mask]
            reward = 1.0 if (equal_reward_group and g == 0) else float(rng.random() < 0.5)
            trajs.append(
                Trajectory(
                    prompt_ids=prompt,
                    response_ids=resp,
                    loss_mask=mask,
                    rollout_logprobs=lps,
                    reward=reward,
                    weight_versions=[0 if m else -1 for m in mask],
                )
            )
        groups.append(Group(group_id=g, item=PromptItem(index=g, prompt=f"p{g}"), epoch=0, trajectories=trajs))
    return groups


def tiny_actor_config(
    model_path: str,
    *,
    actor: dict[str, Any] | None = None,
    algorithm: dict[str, Any] | None = None,
    runner: dict[str, Any] | None = None,
) -> Config:
    """A Config for the tiny model on CPU (fp32), with field overrides per section."""
    a = ActorConfig(model_path=str(model_path), params_dtype="fp32", lr=1e-3, grad_clip=1.0, weight_decay=0.0)
    return replace(
        Config(),
        actor=replace(a, **(actor or {})),
        algorithm=replace(AlgorithmConfig(group_size=4), **(algorithm or {})),
        runner=replace(RunnerConfig(max_steps=20, seed=1234), **(runner or {})),
    )
