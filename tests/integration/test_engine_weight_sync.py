"""A test "trainer" joins the engine's weight-update group (the same helper both sides use),
pushes another checkpoint's weights by broadcast (per tensor and as a flattened bucket), and the
engine's greedy outputs and weight_version change to match."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed as dist
from engine_raw import RawEngine  # tests/integration/engine_raw.py

from asyncrl.cluster.weight_update_group import destroy_weight_update_group, init_weight_update_group
from asyncrl.cpu_engine.model import KVPool, iter_safetensors, load_model
from asyncrl.cpu_engine.testing import free_port, running_cpu_engine
from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

PROMPT = [11, 12, 13, 14, 15]
ARGS = dict(arch="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.5)


def _greedy(model_dir, n=8) -> list[int]:
    m = load_model(model_dir)
    ids = list(PROMPT)
    for _ in range(n):
        kv = KVPool(m.spec, 1)
        h = m.forward(torch.tensor(ids), torch.tensor([0]), torch.tensor([len(ids)]), kv, row0=0)
        ids.append(int(m.logits(h[-1]).argmax()))
    return ids[len(PROMPT) :]


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
            with pytest.raises(EngineError, match=r"Failed to receive weights: Group wsync not in \[\]"):
                await RawEngine(c.url).post("/begin_weight_update")
                await RawEngine(c.url).post(
                    "/update_weights_from_distributed",
                    {"names": names[:1], "dtypes": ["float32"], "shapes": [[1]], "group_name": "wsync"},
                )
            await RawEngine(c.url).post("/end_weight_update")
            port = free_port()
            join = asyncio.create_task(
                RawEngine(c.url).post(
                    "/init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": port,
                        "rank_offset": 1,
                        "world_size": 2,
                        "group_name": "wsync",
                        "backend": "gloo",
                    },
                    timeout_s=60,
                )
            )
            pg = await asyncio.to_thread(
                init_weight_update_group, "127.0.0.1", port, rank=0, world_size=2, group_name="wsync", timeout_s=60
            )
            assert (await join)["success"] is True
            await RawEngine(c.url).post("/begin_weight_update")
            for bucket, fmt in buckets:
                tensors = [new[n] for n in bucket]
                call = asyncio.create_task(
                    RawEngine(c.url).post(
                        "/update_weights_from_distributed",
                        {
                            "names": bucket,
                            "dtypes": [str(t.dtype) for t in tensors],
                            "shapes": [list(t.shape) for t in tensors],
                            "group_name": "wsync",
                            "flush_cache": True,
                            "load_format": fmt,
                        },
                    )
                )

                def send(fmt=fmt, tensors=tensors):
                    if fmt == "flattened_bucket":
                        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
                        dist.broadcast(flat, group_src=0, group=pg)
                    else:
                        for t in tensors:
                            dist.broadcast(t.contiguous(), group_src=0, group=pg)

                await asyncio.to_thread(send)
                assert (await call)["success"] is True
            await RawEngine(c.url).post("/end_weight_update")
            await RawEngine(c.url).post("/update_weight_version", {"new_version": "1", "abort_all_requests": False})
            r = await c.generate(PROMPT, greedy)
            assert r.output_ids == ref_b and r.weight_version == "1"
            assert (await c.model_info())["weight_version"] == "1"
            await RawEngine(c.url).post("/destroy_weights_update_group", {"group_name": "wsync"})
            destroy_weight_update_group(pg)

    with running_cpu_engine(a, log_dir=tmp_path / "logs", max_running_requests=4) as sup:
        asyncio.run(go(sup.url))


def test_standby_bank_swaps_whole_buffers_copies_parts_and_a_failed_receive_changes_nothing(tmp_path):
    """Updates land in the engine's standby bank: a fused buffer that arrives whole (q, k and v together) is
    swapped in, one that arrives in parts (one tensor per call) is copied in, so the bank's stale halves never
    leak; a broadcast that fails half-way (the trainer leaves the group after the first tensor) changes no
    weight, and later updates are still exact."""
    a = make_tiny_checkpoint(tmp_path / "a", seed=0, **ARGS)
    b = make_tiny_checkpoint(tmp_path / "b", seed=1, **ARGS)
    ref_a, ref_b = _greedy(a), _greedy(b)
    wa, wb = dict(iter_safetensors(a)), dict(iter_safetensors(b))
    names = sorted(wb)
    greedy = {"max_new_tokens": 8, "temperature": 0}

    async def join(c, group):
        port = free_port()
        task = asyncio.create_task(
            RawEngine(c.url).post(
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": group,
                    "backend": "gloo",
                },
                timeout_s=60,
            )
        )
        pg = await asyncio.to_thread(
            init_weight_update_group, "127.0.0.1", port, rank=0, world_size=2, group_name=group, timeout_s=60
        )
        assert (await task)["success"] is True
        return pg

    async def push(c, pg, group, weights, calls):
        for bucket in calls:
            ts = [weights[n].contiguous() for n in bucket]
            call = asyncio.create_task(
                RawEngine(c.url).post(
                    "/update_weights_from_distributed",
                    {
                        "names": bucket,
                        "dtypes": ["float32"] * len(ts),
                        "shapes": [list(t.shape) for t in ts],
                        "group_name": group,
                    },
                )
            )
            await asyncio.to_thread(lambda ts=ts: [dist.broadcast(t, group_src=0, group=pg) for t in ts])
            assert (await call)["success"] is True

    async def go(url):
        async with SGLangClient(url, request_timeout_s=60, control_timeout_s=60) as c:
            await RawEngine(c.url).post("/begin_weight_update")
            pg = await join(c, "g1")
            await push(c, pg, "g1", wb, [names])  # whole: every buffer swapped (the bank now holds a)
            assert (await c.generate(PROMPT, greedy)).output_ids == ref_b
            # in parts: a fused buffer is copied (swapping it would bring back the bank's stale a halves)
            await push(c, pg, "g1", wb, [[n] for n in names])
            assert (await c.generate(PROMPT, greedy)).output_ids == ref_b
            await push(c, pg, "g1", wa, [[n] for n in names])
            assert (await c.generate(PROMPT, greedy)).output_ids == ref_a
            # a receive that fails after the first tensor: the trainer leaves the group
            call = asyncio.create_task(
                RawEngine(c.url).post(
                    "/update_weights_from_distributed",
                    {
                        "names": names,
                        "dtypes": ["float32"] * len(names),
                        "shapes": [list(wb[n].shape) for n in names],
                        "group_name": "g1",
                    },
                )
            )
            await asyncio.to_thread(dist.broadcast, wb[names[0]].contiguous(), group_src=0, group=pg)
            destroy_weight_update_group(pg)
            with pytest.raises(EngineError, match="Failed to receive weights: "):  # SGLang's text (no weight changed)
                await call
            assert (await c.generate(PROMPT, greedy)).output_ids == ref_a
            await RawEngine(c.url).post("/destroy_weights_update_group", {"group_name": "g1"})
            pg = await join(c, "g2")
            await push(c, pg, "g2", wb, [names[: len(names) // 2], names[len(names) // 2 :]])
            assert (await c.generate(PROMPT, greedy)).output_ids == ref_b
            await RawEngine(c.url).post("/end_weight_update")
            await RawEngine(c.url).post("/destroy_weights_update_group", {"group_name": "g2"})
            destroy_weight_update_group(pg)

    with running_cpu_engine(
        a, log_dir=tmp_path / "logs", max_running_requests=4, extra=["--weight-sync-timeout-s", "10"]
    ) as sup:
        asyncio.run(go(sup.url))
