"""Bind and advertise addresses (``asyncrl.cluster.addresses``): the pure choice, then this host for real."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from asyncrl.cluster.addresses import (
    AddressError,
    choose_endpoint,
    host_endpoint,
    interface_addresses,
    is_loopback,
)


def test_loopback_names_and_addresses():
    for h in ("127.0.0.1", "127.0.1.1", "localhost", "::1"):
        assert is_loopback(h), h
    for h in ("10.0.0.5", "node0", "192.0.2.2"):
        assert not is_loopback(h), h


def test_one_node_binds_loopback():
    ep = choose_endpoint(num_nodes=1, master_addr="127.0.0.1", route_addr=None, iface_addrs=["10.0.0.5"])
    assert (ep.bind_host, ep.advertise_host) == ("127.0.0.1", "127.0.0.1")


def test_several_nodes_never_advertise_loopback():
    # node 0's host name resolves to 127.0.1.1 on node 0 (Debian's /etc/hosts): the route to MASTER_ADDR is
    # loopback there, which node 1 cannot reach; the interface address is advertised, all interfaces bound
    ep = choose_endpoint(num_nodes=2, master_addr="node0", route_addr="127.0.1.1", iface_addrs=["10.0.0.5"])
    assert (ep.bind_host, ep.advertise_host) == ("0.0.0.0", "10.0.0.5")
    ep = choose_endpoint(num_nodes=2, master_addr="node0", route_addr="10.1.0.7", iface_addrs=["10.0.0.5"])
    assert ep.advertise_host == "10.1.0.7"  # the address on the route to the master comes first


def test_several_nodes_without_a_routable_address_fail_naming_the_setting():
    with pytest.raises(AddressError, match="cluster.broker_host"):
        choose_endpoint(num_nodes=2, master_addr="node0", route_addr="127.0.1.1", iface_addrs=[])


def test_loopback_master_means_one_host():
    # every node reached MASTER_ADDR over loopback: they all share this host (the two-node CI test)
    ep = choose_endpoint(num_nodes=2, master_addr="localhost", route_addr=None, iface_addrs=["10.0.0.5"])
    assert ep.advertise_host == "127.0.0.1"


def test_configured_broker_host_wins_and_loopback_is_refused_on_several_nodes():
    ep = choose_endpoint(
        num_nodes=2, master_addr="node0", route_addr="127.0.1.1", iface_addrs=[], configured_host="10.0.0.9"
    )
    assert (ep.bind_host, ep.advertise_host) == ("10.0.0.9", "10.0.0.9")
    with pytest.raises(AddressError, match="cluster.broker_host.*loopback"):
        choose_endpoint(num_nodes=2, master_addr="node0", route_addr=None, iface_addrs=[], configured_host="127.0.0.1")


def test_this_host_with_master_addr_its_own_name(monkeypatch):
    """MASTER_ADDR = this host's name, as torchrun's c10d rendezvous sets it on node 0; here the name resolves
    to loopback (/etc/hosts). Before this module, ``roles.local_address()`` advertised that loopback address
    to the other nodes; now a two-node job gets an interface address, or a clear error when there is none."""
    name = socket.gethostname()
    monkeypatch.setenv("MASTER_ADDR", name)
    monkeypatch.setenv("MASTER_PORT", "29500")
    ifaces = interface_addresses()
    if ifaces:
        ep = host_endpoint(num_nodes=2)
        assert not is_loopback(ep.advertise_host) and ep.bind_host == "0.0.0.0"
    else:
        with pytest.raises(AddressError):
            host_endpoint(num_nodes=2)
    one = host_endpoint(num_nodes=1)
    assert one.advertise_host  # one node: whatever the route gives is fine


def test_config_rejects_a_wildcard_broker_host(tmp_path):
    from asyncrl.config import load_config
    from asyncrl.config.schema import ConfigError

    with pytest.raises(ConfigError, match="cluster.broker_host"):
        load_config(Path(__file__).resolve().parents[2] / "configs/tiny.toml", ['cluster.broker_host="0.0.0.0"'])


def test_searchr1_configs_bound_eval_and_collectives():
    from asyncrl.config import load_config

    root = Path(__file__).resolve().parents[2]
    for name in ("searchr1.toml", "searchr1_sync.toml"):
        cfg = load_config(root / "configs" / name, [])
        assert cfg.eval.max_samples == 512 and cfg.cluster.actor_collective_timeout_s >= 1800
        assert cfg.cluster.broker_host is None  # bind all interfaces, advertise a routable address


def test_loopback_broker_host_on_two_nodes_is_a_config_error(monkeypatch):
    from asyncrl.config import load_config, validate
    from asyncrl.config.schema import ConfigError

    for k in ("MASTER_ADDR", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs/searchr1.toml", ['cluster.broker_host="127.0.0.1"']
    )
    with pytest.raises(ConfigError, match="cluster.broker_host.*2 nodes"):
        validate(cfg)
