"""Which address a rank binds its servers on and which it advertises to the others (broker, engines).

Contract
- One host (one torchrun node, or every node's MASTER_ADDR a loopback address, which proves they all
  share this host): bind loopback-reachable, advertise what the route to MASTER_ADDR gives (127.0.0.1
  when MASTER_ADDR is loopback).
- More than one node: bind on all interfaces (``0.0.0.0``) and advertise a routable address: the source
  address of the route to MASTER_ADDR, else the first non-loopback interface address; never a 127.x
  address, which node 0's host name often resolves to (``127.0.1.1`` in Debian's /etc/hosts).
  MASTER_ADDR being loopback is the one exception: then every node is on this host and loopback works.
- ``cluster.broker_host`` set: the broker binds on that address and advertises it as written.
- Decisions are the pure ``choose_endpoint``; ``host_endpoint`` reads the environment and the network.

    ep = host_endpoint(num_nodes=2)             # Endpoint(bind_host="0.0.0.0", advertise_host="10.0.0.5")
    f"tcp://{ep.bind_host}:0"                   # bind; publish f"tcp://{ep.advertise_host}:{port}"
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Optional

from asyncrl.config.placement import is_loopback


@dataclass(frozen=True)
class Endpoint:
    bind_host: str
    """Where the server binds (``0.0.0.0`` = all interfaces)."""
    advertise_host: str
    """What the other ranks connect to."""


class AddressError(RuntimeError):
    """No routable address for a multi-node job; the message says which setting fixes it."""


def choose_endpoint(
    *,
    num_nodes: int,
    master_addr: str,
    route_addr: Optional[str],
    iface_addrs: list[str],
    configured_host: Optional[str] = None,
    what: str = "the broker",
) -> Endpoint:
    """Pure: the bind and advertise hosts from what this host knows (see the module contract).

    ``route_addr``: the source address of the route to MASTER_ADDR (None if there is none);
    ``iface_addrs``: this host's IPv4 interface addresses."""
    one_host = num_nodes <= 1 or is_loopback(master_addr)
    if configured_host:
        if is_loopback(configured_host) and not one_host:
            raise AddressError(
                f"cluster.broker_host: {configured_host!r} is a loopback address, unreachable from "
                f"the other nodes of a {num_nodes}-node job; give an address of node 0 they reach"
            )
        return Endpoint(bind_host=configured_host, advertise_host=configured_host)
    if one_host:
        host = "127.0.0.1" if is_loopback(master_addr) or not route_addr else route_addr
        return Endpoint(bind_host="127.0.0.1" if is_loopback(host) else "0.0.0.0", advertise_host=host)
    candidates = [a for a in [route_addr, *iface_addrs] if a and not is_loopback(a)]
    if not candidates:
        raise AddressError(
            f"{what}: no routable address on this host for a {num_nodes}-node job (the route to MASTER_ADDR="
            f"{master_addr} gives {route_addr!r}, interfaces {iface_addrs}); set cluster.broker_host to an address "
            f"of this node that every node reaches, or start torchrun with --local-addr"
        )
    return Endpoint(bind_host="0.0.0.0", advertise_host=candidates[0])


def route_address(master_addr: str, master_port: int) -> Optional[str]:
    """Source address of the route to ``master_addr`` (a UDP connect sends nothing); None if unroutable."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces, loopback excluded (Linux ``SIOCGIFADDR``; [] elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Linux
        return []
    siocgifaddr = 0x8915  # Linux ioctl number of "get interface address"
    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not is_loopback(addr) and addr not in out:
                out.append(addr)
    return out


def num_nodes_from_env(default: int) -> int:
    """torchrun's node count: GROUP_WORLD_SIZE, else WORLD_SIZE / LOCAL_WORLD_SIZE, else ``default``."""
    if os.environ.get("GROUP_WORLD_SIZE"):
        return int(os.environ["GROUP_WORLD_SIZE"])
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world and local:
        return max(1, int(world) // max(1, int(local)))
    return default


def host_endpoint(*, num_nodes: int, configured_host: Optional[str] = None, what: str = "the broker") -> Endpoint:
    """``choose_endpoint`` for this process under torchrun (MASTER_ADDR/MASTER_PORT from the environment)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    route = None if is_loopback(master) else route_address(master, port)
    ifaces = interface_addresses() if num_nodes > 1 and not configured_host else []
    ep = choose_endpoint(
        num_nodes=num_nodes,
        master_addr=master,
        route_addr=route,
        iface_addrs=ifaces,
        configured_host=configured_host,
        what=what,
    )
    if configured_host:  # ZeroMQ binds on an address or an interface, not a host name: resolve it here
        try:
            bind = socket.gethostbyname(configured_host)
        except OSError as e:
            raise AddressError(f"cluster.broker_host: cannot resolve {configured_host!r}: {e}") from None
        ep = Endpoint(bind_host=bind, advertise_host=ep.advertise_host)
    return ep
