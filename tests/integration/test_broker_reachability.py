"""The broker across nodes: bound on all interfaces and reached through this host's routable address; a
rollout rank's start-up handshake is a real round trip that fails within its timeout naming the address."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from proc_helpers import free_port

from asyncrl.broker.client import broker_handshake
from asyncrl.cluster.addresses import interface_addresses
from asyncrl.runner.broker_process import start_broker


def _inputs(tmp: Path) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}", "golden_answers": [f"a{i}"]}) + "\n" for i in range(8)))
    cfg = tmp / "broker.toml"
    cfg.write_text("[runner]\nasync_mode = true\n[data]\nrollout_batch_size = 2\n[algorithm]\ngroup_size = 2\n")
    return str(cfg), str(prompts)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_handshake_round_trip_to_a_broker_bound_on_all_interfaces(tmp_path):
    """Bound as on several nodes (``0.0.0.0``), advertised as this host's interface address: a connection over
    that address (what node 1 uses) gets the broker's status back."""
    ifaces = interface_addresses()
    if not ifaces:
        pytest.skip("this host has no non-loopback IPv4 interface")
    cfg, prompts = _inputs(tmp_path)
    broker = start_broker(cfg, [], prompts_path=prompts, bind="tcp://0.0.0.0:0", log_path=str(tmp_path / "b.log"))
    try:
        port = broker.address.rsplit(":", 1)[1]
        status = broker_handshake(f"tcp://{ifaces[0]}:{port}", timeout_s=20, who="rollout rank 1")
        assert status["version"] == 0 and not status["workers"]
    finally:
        assert broker.stop() == 0


@pytest.mark.timeout(60)
def test_handshake_to_an_unreachable_broker_fails_in_time_naming_the_address():
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        broker_handshake(address, timeout_s=1.5, who="rollout rank 8 on node1")
    took = time.monotonic() - t0
    assert 1.4 <= took < 10
    msg = str(e.value)
    assert address in msg and "rollout rank 8 on node1" in msg and "cluster.broker_host" in msg
