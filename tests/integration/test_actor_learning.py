"""GRPO learns a toy reward: the tiny model's mean reward rises clearly within a few dozen steps.

Under torchrun (1 process, gloo). Each step: the current actor weights are pushed into a HF
transformers copy through ``Actor.iter_hf_buckets`` (the weight-sync path), which samples
``group_size`` responses per prompt with their rollout log-probs; the reward of a response is the
fraction of its tokens in a fixed target set (64 of ~1000 ids, so about 6% at the start); the
actor trains on the groups (off_policy_correction = none: the rollout log-prob is the old one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 24
NUM_PROMPTS = 8
GROUP_SIZE = 4
RESPONSE_LEN = 4
TARGET = set(range(100, 164))


def run_torchrun(script: Path, args: list[str], *, nproc: int = 1, timeout_s: float = 240):
    return proc_helpers.run_torchrun(script, args, nproc=nproc, timeout_s=timeout_s)


@torch.no_grad()
def sample_groups(hf_model, prompts, gen: torch.Generator):
    from asyncrl.broker.types import Group, PromptItem, Trajectory

    ids = torch.tensor([p for p in prompts for _ in range(GROUP_SIZE)])
    lps = []
    for _ in range(RESPONSE_LEN):
        logits = hf_model(ids).logits[:, -1].float()
        logz = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logz.exp(), 1, generator=gen)
        lps.append(logz.gather(-1, nxt))
        ids = torch.cat([ids, nxt], dim=1)
    lps = torch.cat(lps, dim=1)
    groups, rewards = [], []
    p_len = len(prompts[0])
    for g, p in enumerate(prompts):
        trajs = []
        for k in range(GROUP_SIZE):
            row = g * GROUP_SIZE + k
            resp = ids[row, p_len:].tolist()
            r = sum(t in TARGET for t in resp) / len(resp)
            rewards.append(r)
            trajs.append(
                Trajectory(
                    prompt_ids=list(p),
                    response_ids=resp,
                    loss_mask=[1] * len(resp),
                    rollout_logprobs=lps[row].tolist(),
                    reward=r,
                )
            )
        groups.append(Group(group_id=g, item=PromptItem(index=g, prompt=""), epoch=0, trajectories=trajs))
    return groups, sum(rewards) / len(rewards)


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    hf, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = tiny_actor_config(
        hf, actor={"lr": 5e-3}, algorithm={"group_size": GROUP_SIZE}, runner={"max_steps": NUM_STEPS}
    )
    actor = Actor(cfg)
    hf_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(200, 900, (6,), generator=gen).tolist() for _ in range(NUM_PROMPTS)]
    rewards, mismatch = [], []
    for _step in range(NUM_STEPS):
        hf_model.load_state_dict({k: v for b in actor.iter_hf_buckets(1 << 20) for k, v in b}, strict=True)
        groups, mean_r = sample_groups(hf_model, prompts, gen)
        rewards.append(mean_r)
        m = actor.train_step(groups)
        mismatch.append(m["train/logprob_mismatch"])
    Path(out).write_text(json.dumps({"rewards": rewards, "mismatch": mismatch}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_grpo_raises_toy_reward(tmp_path):
    pytest.importorskip("transformers")
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", num_hidden_layers=2)
    out = tmp_path / "out.json"
    proc = run_torchrun(Path(__file__), [str(hf), str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    rewards = r["rewards"]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert start < 0.2
    assert end > start + 0.4, rewards
    # the engine-side (HF) and actor log-probs agree: the sampled batch is on-policy
    assert max(r["mismatch"]) < 1e-4


if __name__ == "__main__":
    main()
