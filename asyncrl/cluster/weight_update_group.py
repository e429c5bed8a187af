"""The weight-update process group, created exactly the way SGLang's engines create theirs.

Contract
- ``init_weight_update_group`` is the ONE place in asyncrl that touches torch's private
  ``torch.distributed.distributed_c10d._new_process_group_helper``. Both ends use it: the trainer
  (rank 0, hosts the rendezvous store) and the CPU engine (ranks ``rank_offset + tp_rank``). SGLang's
  own engines build the same thing on their side, so trainer code is identical for both engines.
- Rendezvous: ``tcp://master_address:master_port`` (rank 0's TCPStore; ``init`` blocks until all
  ``world_size`` ranks connected or ``timeout_s`` passed), the store wrapped in
  ``PrefixStore(group_name, store)``, then the private helper with ``global_ranks_in_group=[]``
  and an identity rank map registered for the group. A plain ``dist.new_group`` would NOT match:
  it needs every process in one default world, which engines never share with the trainer.
- Works in a process with no default group (the engine) and in one that already has a default
  group (the trainer's actor world); the new group never becomes the default.
- Collectives on it take group ranks: ``dist.broadcast(t, group_src=0, group=pg)`` (the identity
  map also makes ``src=0`` right). The weight sync's own broadcasts, both ends, go through
  ``broadcast_from_rank0`` (the group's own method, without the wrapper's per-call cost).

    pg = init_weight_update_group("127.0.0.1", 29555, rank=0, world_size=2, group_name="weight_update_group")
    dist.broadcast(tensor, group_src=0, group=pg)
    destroy_weight_update_group(pg)

Owner of the private-API shim: this module (issue 4). Also ``_set_pg_timeout(timeout, group)`` (the
collective timeout after the join, issue 13). Checked against torch 2.13
(signature ``(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
backend_options=None, timeout=None, pg_tag=None, device_id=None, group_desc=None)``);
tests/integration/test_engine_process_group.py pins it.
"""

from __future__ import annotations

import datetime as _dt

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name


def init_weight_update_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group; blocks until all ``world_size`` ranks joined.

    ``timeout_s`` bounds the join; ``collective_timeout_s`` (default: ``timeout_s``) then bounds each
    collective on the group (one bucket's broadcast), so a long join allowance never becomes the
    deadline of every later broadcast.

    Raises ``RuntimeError`` naming the rendezvous address when the others do not arrive in
    ``timeout_s`` (torch's DistStoreError / timeout is chained), and ``ValueError`` when a group of
    that name already exists in this process (destroy it first).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"weight-update group {group_name!r}: rank {rank} not in [0, {world_size})")
    if group_name in _c10d._world.pg_names.values():
        raise ValueError(
            f"weight-update group {group_name!r} already exists in this process; "
            "destroy it (destroy_weight_update_group) before joining again"
        )
    timeout = _dt.timedelta(seconds=timeout_s)
    pg = _rendezvous(
        master_address,
        int(master_port),
        rank=rank,
        world_size=world_size,
        group_name=group_name,
        backend=backend,
        timeout=timeout,
    )
    # Identity map group rank -> "global" rank, as SGLang registers it: lets src=<group rank> work.
    _c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    if collective_timeout_s is not None and collective_timeout_s != timeout_s:
        _c10d._set_pg_timeout(_dt.timedelta(seconds=collective_timeout_s), pg)
    return pg


def _rendezvous(
    master_address: str, master_port: int, *, rank: int, world_size: int, group_name: str, backend: str, timeout
) -> dist.ProcessGroup:
    """The group's TCP store and process group; a failure is a ``RuntimeError`` naming the address."""
    url = f"tcp://{master_address}:{master_port}"
    try:
        # A TCPStore built directly, not ``dist.rendezvous(url)``: under torchrun
        # (TORCHELASTIC_USE_AGENT_STORE=True) the rendezvous handler would make every rank, rank 0
        # included, a client of a store nobody hosts. On the wire this is the same TCP rendezvous.
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            use_libuv=True,
        )
        store = dist.PrefixStore(group_name, store)
        pg, _ = _c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            backend,
            store,
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    except (RuntimeError, dist.DistError) as e:  # DistStoreError/DistNetworkError on timeouts
        raise RuntimeError(
            f"weight-update group {group_name!r} at {url} (rank {rank}/{world_size}, {backend}): rendezvous failed: {e}"
        ) from e
    return pg


def broadcast_from_rank0(tensor: torch.Tensor, pg: dist.ProcessGroup) -> dist.Work:
    """Queue a broadcast of ``tensor`` from group rank 0 on ``pg`` and return its work (``wait()`` it): what
    ``dist.broadcast(tensor, group_src=0, group=pg, async_op=True)`` calls in the end, the process group's own
    ``broadcast``. The wrapper's checks and logging decorators cost 24 us a call against 8 us for this on 2 cores
    (measured 2026-12-05, 51 tensors, gloo), paid for every tensor of every bucket on both ends of a sync. Works for
    gloo and NCCL alike (the tensor's device picks the backend); rank 0 is the group rank (the identity rank map). As
    the wrapper does, an 8-bit float goes as its bytes (NCCL before sm90 has no fp8; both ends view it the same way);
    complex tensors, which the wrapper views as real pairs, are not weights and are not expected here."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor = tensor.view(torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.asyncOp = True
    return pg.broadcast([tensor], opts)


def destroy_weight_update_group(pg: dist.ProcessGroup) -> None:
    """Shut the group down and forget it (its name can be joined again afterwards)."""
    dist.destroy_process_group(pg)
