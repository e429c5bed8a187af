"""Free TCP ports to hand to a process that binds them later (an engine's ``--port``, a rendezvous store).

Contract
- ``free_port(host)`` returns a port that nothing on ``host`` listens on now, chosen *below the kernel's
  ephemeral range* (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default on Linux).
- Why not bind to port 0 and hand that port on: the kernel takes 0-binds and the source ports of outgoing
  connections from the ephemeral range, so in the seconds between the choice and the child's own bind, any
  process on the host (gloo's pair listeners, an HTTP client, a store) can be handed the same port and the
  child dies with ``address already in use`` (seen in CI: an engine started ~8 s after its port was chosen).
  A port below that range is only ever taken by a process that asks for it by number.
- ``span`` / ``stride``: the ports ``p, p + stride, ..., p + (span - 1) * stride`` are all free and all below
  the range (engine k on a node listens on ``rollout.port + k * 10``).
- Candidates are drawn from ``[PORT_FLOOR, ephemeral low)`` by a generator seeded from the OS, so concurrent
  processes do not walk the same sequence. A host whose ephemeral range starts at or below the floor has no
  such ports: then the kernel's choice (bind to 0) is returned, the old behaviour.
- ``candidates`` is the pure part (no I/O): the same code tests drive.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Optional

PORT_FLOOR = 10000
"""Lowest port handed out: below it are registered services (and SGLang's default 30000 is above it, so a
clash with a real engine is possible only when a user set that port; the bind check then skips it)."""
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL = (32768, 60999)
ATTEMPTS = 200


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux); the Linux default where the file is absent or unreadable."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def candidates(
    rng: random.Random, *, ephemeral_low: int, span: int = 1, stride: int = 1, floor: int = PORT_FLOOR
) -> Iterator[int]:
    """Endless first ports ``p`` with ``floor <= p`` and ``p + (span - 1) * stride < ephemeral_low``; nothing when
    no such ``p`` exists."""
    if span < 1 or stride < 1:
        raise ValueError(f"span and stride must be >= 1, got span={span} stride={stride}")
    top = ephemeral_low - 1 - (span - 1) * stride  # the highest first port whose last port is still below the range
    if top < floor:
        return
    while True:
        yield rng.randint(floor, top)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))  # no SO_REUSEADDR: a port with a listener or a TIME_WAIT socket counts as taken
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1", *, span: int = 1, stride: int = 1, rng: Optional[random.Random] = None) -> int:
    """A port (the first of ``span``, ``stride`` apart) nothing listens on, below the ephemeral range (contract)."""
    rng = rng or random.Random()  # seeded from os.urandom
    low, _ = ephemeral_range()
    for i, p in enumerate(candidates(rng, ephemeral_low=low, span=span, stride=stride)):
        if all(_bindable(host, p + k * stride) for k in range(span)):
            return p
        if i + 1 >= ATTEMPTS:
            raise OSError(
                f"no free TCP port on {host} below {low} after {ATTEMPTS} tries (span {span}, stride {stride})"
            )
    if span > 1:
        raise OSError(f"the ephemeral port range of this host starts at {low}: no {span} ports below it")
    return _kernel_port(host)
