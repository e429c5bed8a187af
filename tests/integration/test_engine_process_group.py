"""The weight-update group shim: real gloo groups across real processes, with and without a
default process group in the joining process."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from asyncrl.cluster.ports import free_port

pytestmark = pytest.mark.slow


def _member(rank: int, world_size: int, ports: list[int], default_port: int | None, out: mp.Queue) -> None:
    import torch.distributed as dist

    from asyncrl.cluster.weight_update_group import (
        broadcast_from_rank0,
        destroy_weight_update_group,
        init_weight_update_group,
    )

    try:
        if default_port is not None:  # a process that already has its own (unrelated) default world
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1)
        results = []
        for round_, port in enumerate(ports):  # join, use, destroy, join again (same name)
            pg = init_weight_update_group(
                "127.0.0.1", port, rank=rank, world_size=world_size, group_name="wug", timeout_s=60
            )
            assert pg is not dist.GroupMember.WORLD
            t = torch.arange(4, dtype=torch.float32) * (round_ + 1) if rank == 0 else torch.zeros(4)
            dist.broadcast(t, group_src=0, group=pg)
            u = torch.zeros(2) + (5.0 if rank == 0 else 0.0)
            dist.broadcast(u, src=0, group=pg)  # identity rank map: src=0 works too
            # the sync's own call, for the weights' dtypes (an 8-bit float goes as its bytes)
            sent = {d: (torch.arange(4) * 0.5).to(d) for d in (torch.bfloat16, torch.float8_e4m3fn)}
            got = {d: (x if rank == 0 else torch.zeros(4, dtype=d)) for d, x in sent.items()}
            for w in [broadcast_from_rank0(x, pg) for x in got.values()]:
                w.wait()
            assert all(torch.equal(got[d].float(), sent[d].float()) for d in sent), got
            results.append((t.tolist(), u.tolist(), pg.rank(), pg.size()))
            destroy_weight_update_group(pg)
        if default_port is not None:
            assert dist.is_initialized() and dist.get_world_size() == 1
            dist.destroy_process_group()
        out.put((rank, results))
    except BaseException as e:  # report to the parent, which fails the test
        out.put((rank, repr(e)))


def test_group_joins_with_and_without_default_group():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port(), free_port()]
    procs = [
        ctx.Process(target=_member, args=(0, 3, ports, free_port(), out)),  # trainer: has a default group
        ctx.Process(target=_member, args=(1, 3, ports, None, out)),
        ctx.Process(target=_member, args=(2, 3, ports, None, out)),
    ]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(3):
        assert not isinstance(got[rank], str), got[rank]
        (t1, u1, r1, s1), (t2, _, _, _) = got[rank]
        assert t1 == [0.0, 1.0, 2.0, 3.0] and u1 == [5.0, 5.0]
        assert t2 == [0.0, 2.0, 4.0, 6.0]
        assert (r1, s1) == (rank, 3)


def test_group_timeout_names_the_address():
    from asyncrl.cluster.weight_update_group import init_weight_update_group

    port = free_port()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
        init_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name="lonely", timeout_s=1.0)
