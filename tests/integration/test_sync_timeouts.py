"""The weight-sync group's join allowance is not the deadline of every later broadcast.

A real peer process joins the group late (longer than the broadcast timeout, well within the join
timeout) and then never broadcasts: the join succeeds, and the receive fails after
``collective_timeout_s`` (``sync.broadcast_timeout_s``), not after the join timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from asyncrl.cluster.ports import free_port
from asyncrl.cluster.weight_update_group import destroy_weight_update_group, init_weight_update_group
from asyncrl.config.schema import SyncConfig

pytestmark = pytest.mark.slow

JOIN_S = 60.0
BROADCAST_S = 3.0
PEER_DELAY_S = 2 * BROADCAST_S  # joins later than a broadcast may take


def test_broadcast_timeout_is_separate_from_the_join_timeout():
    port = free_port()
    peer_code = (
        "import time, sys; from asyncrl.cluster.weight_update_group import init_weight_update_group;"
        f"time.sleep({PEER_DELAY_S}); pg = init_weight_update_group('127.0.0.1', {port}, rank=0, world_size=2,"
        " group_name='wug_t',"
        f" timeout_s={JOIN_S}); print('joined', flush=True); time.sleep({JOIN_S})"
    )
    peer = subprocess.Popen(
        [sys.executable, "-c", peer_code],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        t0 = time.monotonic()
        pg = init_weight_update_group(
            "127.0.0.1",
            port,
            rank=1,
            world_size=2,
            group_name="wug_t",
            timeout_s=JOIN_S,
            collective_timeout_s=BROADCAST_S,
        )
        joined_s = time.monotonic() - t0
        assert joined_s >= PEER_DELAY_S - 0.5  # the join outlived the broadcast timeout and succeeded
        t1 = time.monotonic()
        with pytest.raises((RuntimeError, dist.DistError)):
            dist.broadcast(torch.empty(4), group_src=0, group=pg)  # rank 0 never sends
        waited_s = time.monotonic() - t1
        assert BROADCAST_S - 0.5 <= waited_s < JOIN_S / 2, waited_s
        destroy_weight_update_group(pg)
    finally:
        peer.kill()
        peer.wait(timeout=10)


def test_sync_config_has_a_broadcast_timeout_of_its_own():
    c = SyncConfig()
    assert c.broadcast_timeout_s == 600.0 and c.join_timeout_s == 120.0
    with pytest.raises(ValueError, match="sync.broadcast_timeout_s"):
        SyncConfig(broadcast_timeout_s=0)
