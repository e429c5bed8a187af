"""The agent's side of routing replay against a real CPU engine serving a tiny Qwen3-MoE (started, as
``asyncrl.engine.launch`` starts it with ``actor.moe_routing_replay``, with ``--enable-return-routed-experts``).

Two turns with a tool observation between them, as the agent loop runs them (``EngineHandle.generate`` with
``routed_from`` = the positions known, ``TrajectoryBuilder``): each reply carries only the new positions' experts,
and the trajectory's rows are the experts transformers' ``Qwen3MoeForCausalLM`` routes every position of the
whole sequence to, -1 at the last position; they survive the wire into the actor's ``Sample``. A reply without
them (an engine started without the flag) is an ``EngineError``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.actor.batch import groups_to_samples
from asyncrl.agent.engine_handle import EngineHandle
from asyncrl.agent.loop import TrajectoryBuilder
from asyncrl.broker import protocol as P
from asyncrl.broker.types import Group, PromptItem
from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.engine.launch import cpu_engine_command
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

PROMPT = [11, 12, 13, 14, 15, 16, 17]
TOOL = [21, 22, 23]
SAMPLING = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def _reference_routing(model_dir, ids: list[int]) -> np.ndarray:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    k = m.config.num_experts_per_tok
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
    return torch.cat([lg.topk(k, dim=-1).indices for lg in logits], dim=1).to(torch.int32).numpy()


async def _two_turns(url: str) -> TrajectoryBuilder:
    async with SGLangClient(url) as client:
        engine = EngineHandle(client, max_in_flight=2)
        b = TrajectoryBuilder(list(PROMPT), 64, routed=[])
        for turn in range(2):
            out = await engine.generate(b.input_ids(), SAMPLING, rid=f"t{turn}", routed_from=b.routed_len)
            b.add_generated(out.output_ids, out.logprobs, out.versions)
            # the positions not known yet, but the new last one: turn 0's last token's comes with turn 1
            assert len(out.routed_experts) == (len(PROMPT) - 1 if turn == 0 else len(TOOL)) + len(out.output_ids)
            b.add_routed(out.routed_experts)
            if turn == 0:
                b.add_tool(TOOL)
        return b


def test_the_trajectory_carries_every_positions_experts(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", num_hidden_layers=2, seed=2)
    with running_cpu_engine(path, log_dir=tmp_path / "logs", extra=["--enable-return-routed-experts"]) as sup:
        b = asyncio.run(_two_turns(sup.url))
    t = b.build(reward=1.0)
    seq = t.prompt_ids + t.response_ids
    assert len(seq) == len(PROMPT) + 5 + len(TOOL) + 5
    assert t.routed_experts.shape == (len(seq), 2 * 2)  # layers x top-k, layer-major
    assert (t.routed_experts[-1] == -1).all()
    assert np.array_equal(t.routed_experts[:-1], _reference_routing(path, seq[:-1]))
    # through the wire into the actor's Sample
    _, ((_, got, _, _),) = P.unpack_finished_groups(
        P.decode(P.finished_groups_frames([(1, [t], False, "")]), allowed=P.WORKER_TYPES)
    )
    (s,) = groups_to_samples(
        [Group(1, PromptItem(1, "q"), 0, got)], normalize_adv_by_std=False, loss_agg_mode="token_mean"
    )
    assert s.routed_experts.dtype == torch.int32 and s.routed_experts.numpy().tolist() == t.routed_experts.tolist()


def test_a_reply_without_routed_experts_is_an_engine_error(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", num_hidden_layers=2, seed=2)

    async def go(url):
        async with SGLangClient(url) as client:
            with pytest.raises(EngineError, match="--enable-return-routed-experts"):
                await EngineHandle(client, max_in_flight=1).generate(PROMPT, SAMPLING, rid="r", routed_from=0)

    with running_cpu_engine(path, log_dir=tmp_path / "logs") as sup:
        asyncio.run(go(sup.url))


def test_the_engines_are_started_with_the_flag():
    from proc_helpers import REPO  # tests/integration/proc_helpers.py

    from asyncrl.config import load_config
    from asyncrl.engine.launch import sglang_command

    cfg = load_config(REPO / "configs/tiny_moe.toml", ["actor.moe_routing_replay=true"])
    for cmd in (cpu_engine_command(cfg, port=1), sglang_command(cfg, port=1, base_gpu_id=0)):
        assert "--enable-return-routed-experts" in cmd
    off = load_config(REPO / "configs/tiny_moe.toml")
    assert "--enable-return-routed-experts" not in cpu_engine_command(off, port=1) + sglang_command(
        off, port=1, base_gpu_id=0
    )
