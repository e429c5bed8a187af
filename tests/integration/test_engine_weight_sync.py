"""A test "trainer" joins the engine's weight-update group (the same helper both sides use),
pushes another checkpoint's weights by broadcast (per tensor and as a flattened bucket), and the
engine's greedy outputs and weight_version change to match."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed as dist

from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.rollout.cpu_model import KVPool, iter_safetensors, load_model
from asyncrl.rollout.testing import free_port, running_cpu_engine
from asyncrl.sync.process_group import destroy_weight_update_group, init_weight_update_group

pytestmark = pytest.mark.slow

PROMPT = [11, 12, 13, 14, 15]
ARGS = dict(arch="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.5)


def _greedy(model_dir, n=8) -> list[int]:
    m = load_model(model_dir)
    ids = list(PROMPT)
    for _ in range(n):
        kv = KVPool(m.spec, 1)
        h = m.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([len(ids)]), kv, 0)
        ids.append(int(m.logits(h[0, -1]).argmax()))
    return ids[len(PROMPT):]


def test_trainer_pushes_weights_and_version(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=0, **ARGS)
    b = make_tiny_checkpoint(tmp_path / "b", seed=1, **ARGS)
    ref_a, ref_b = _greedy(a), _greedy(b)
    assert ref_a != ref_b
    new = dict(iter_safetensors(b))
    names = sorted(new)
    half = len(names) // 2
    buckets = [(names[:half], None), (names[half:], "flattened_bucket")]
    greedy = {"max_new_tokens": 8, "temperature": 0}

    async def go(url):
        async with SGLangClient(url, request_timeout_s=60, control_timeout_s=60) as c:
            assert (await c.generate(PROMPT, greedy)).output_ids == ref_a
            with pytest.raises(EngineError, match="does not exist"):
                await c.begin_weight_update()
                await c.update_weights_from_distributed(names=names[:1], dtypes=["float32"], shapes=[[1]],
                                                        group_name="wsync")
            await c.end_weight_update()
            port = free_port()
            join = asyncio.create_task(c.init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="wsync",
                backend="gloo", timeout_s=60))
            pg = await asyncio.to_thread(init_weight_update_group, "127.0.0.1", port, 0, 2, "wsync", timeout_s=60)
            assert (await join)["success"] is True
            await c.begin_weight_update()
            for bucket, fmt in buckets:
                tensors = [new[n] for n in bucket]
                call = asyncio.create_task(c.update_weights_from_distributed(
                    names=bucket, dtypes=[str(t.dtype) for t in tensors], shapes=[list(t.shape) for t in tensors],
                    group_name="wsync", flush_cache=True, load_format=fmt))

                def send(fmt=fmt, tensors=tensors):
                    if fmt == "flattened_bucket":
                        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
                        dist.broadcast(flat, group_src=0, group=pg)
                    else:
                        for t in tensors:
                            dist.broadcast(t.contiguous(), group_src=0, group=pg)

                await asyncio.to_thread(send)
                assert (await call)["success"] is True
            await c.end_weight_update()
            await c.update_weight_version("1", abort_all_requests=False)
            r = await c.generate(PROMPT, greedy)
            assert r.output_ids == ref_b and r.weight_version == "1"
            assert (await c.model_info())["weight_version"] == "1"
            await c.destroy_weights_update_group("wsync")
            destroy_weight_update_group(pg)

    with running_cpu_engine(a, log_dir=tmp_path / "logs", max_running_requests=4) as sup:
        asyncio.run(go(sup.url))
