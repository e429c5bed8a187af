"""Placement: ``cluster.component_placement`` -> which global rank does what; loopback hosts. Pure, no I/O.

Global rank r drives device r (on CPU a device is just a rank). A key may name several
components that share the devices (``"rollout,reward" = "8-15"``); values are ranges and lists
(``"0-7"``, ``"3"``, ``"0-3,8-11"``).

    p = parse_placement({"actor": "0-7", "rollout,reward": "8-15"}, world_size=16, engine_tp=2)
    p.role_of(9)            # -> "rollout"
    p.engines               # -> [[8, 9], [10, 11], [12, 13], [14, 15]]
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from asyncrl.config.schema import ConfigError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """A literal loopback address or name (no DNS lookup): 127.0.0.0/8, ::1, localhost."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


KNOWN_COMPONENTS = ("actor", "rollout", "reward", "eval")
"""``eval``: the devices of the dedicated eval fleet (``eval.eval_num_gpus``), optional."""


def parse_devices(spec: str, key: str) -> list[int]:
    devices: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            raise ConfigError(f'{key}: empty device in {spec!r}; write e.g. "0-7" or "0,2"')
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if hi < lo:
                    raise ConfigError(f'{key}: range {part!r} is backwards; write "{hi}-{lo}"')
                devices.extend(range(lo, hi + 1))
            else:
                devices.append(int(part))
        except ValueError:
            raise ConfigError(f'{key}: cannot parse devices {spec!r}; write e.g. "0-7" or "0,2"') from None
    if any(d < 0 for d in devices):
        raise ConfigError(f"{key}: negative device in {spec!r}")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{key}: device listed twice in {spec!r}")
    return devices


@dataclass(frozen=True)
class Placement:
    world_size: int
    components: dict[str, tuple[int, ...]]
    """component name -> its devices (global ranks), sorted."""
    engines: tuple[tuple[int, ...], ...]
    """rollout engines, each the ranks of one engine (first rank launches it)."""

    @property
    def actor_ranks(self) -> tuple[int, ...]:
        return self.components.get("actor", ())

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        return self.components.get("rollout", ())

    @property
    def eval_ranks(self) -> tuple[int, ...]:
        """The dedicated eval fleet's devices (the ``eval`` key; empty without a fleet)."""
        return self.components.get("eval", ())

    def eval_engines(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """The fleet's engines (``eval.eval_num_gpus_per_engine`` = ``tp`` devices each; first rank launches)."""
        r = self.eval_ranks
        if len(r) % tp:
            raise ConfigError(
                f"eval.eval_num_gpus_per_engine: {tp} does not divide the {len(r)} devices of "
                f"cluster.component_placement.eval"
            )
        return tuple(tuple(r[i : i + tp]) for i in range(0, len(r), tp))

    def role_of(self, rank: int) -> str:
        if rank in self.actor_ranks:
            return "actor"
        if rank in self.rollout_ranks:
            return "rollout"
        if rank in self.eval_ranks:
            return "eval"
        return "idle"

    def engine_of(self, rank: int) -> int | None:
        for i, ranks in enumerate(self.engines):
            if rank in ranks:
                return i
        return None


def parse_placement(raw: dict[str, str], *, world_size: int, engine_tp: int) -> Placement:
    """Parse and check the placement against the world; errors name ``cluster.component_placement``."""
    base = "cluster.component_placement"
    components: dict[str, list[int]] = {}
    owner: dict[int, str] = {}
    for key, spec in raw.items():
        names = [n.strip() for n in key.split(",") if n.strip()]
        ekey = f'{base}."{key}"' if "," in key else f"{base}.{key}"
        for n in names:
            if n not in KNOWN_COMPONENTS:
                raise ConfigError(f"{ekey}: unknown component {n!r}; known: {', '.join(KNOWN_COMPONENTS)}")
            if n in components:
                raise ConfigError(f"{ekey}: component {n!r} is placed twice")
        devices = parse_devices(spec, ekey)
        for d in devices:
            if d in owner:
                raise ConfigError(
                    f"{ekey}: device {d} is also placed for '{owner[d]}'; placements must not overlap "
                    f'(list components that share devices in one key, e.g. "rollout,reward")'
                )
            if d >= world_size:
                raise ConfigError(
                    f"{ekey}: device {d} is out of range: the job has {world_size} devices (0-{world_size - 1})"
                )
            owner[d] = key
        for n in names:
            components[n] = sorted(devices)
    for required in ("actor", "rollout", "reward"):
        if required not in components:
            extra = (
                (
                    " (Search-R1 computes rewards in the agent loop, but component_placement always "
                    'expects one: write "rollout,reward" = ...)'
                )
                if required == "reward"
                else ""
            )
            raise ConfigError(f"{base}: missing a '{required}' entry{extra}")
    for other in ("rollout", "eval"):
        shared = sorted(set(components["actor"]) & set(components.get(other, ())))
        if shared:
            raise ConfigError(
                f"{base}: colocated placement is not supported: 'actor' and '{other}' share devices {shared[:8]}"
                f"{'...' if len(shared) > 8 else ''}. Each device runs one torchrun rank with one role, so a shared "
                f"device would become an actor rank and no engine would start there; put them on separate "
                f'devices, e.g. actor = "0-7", "rollout,reward" = "8-15"'
            )
    uncovered = sorted(set(range(world_size)) - set(owner))
    if uncovered:
        raise ConfigError(
            f"{base}: devices {uncovered} of the {world_size}-device job are not placed; "
            f"cover every torchrun rank (e.g. add them to 'actor' or 'rollout')"
        )
    rollout = components["rollout"]
    if len(rollout) % engine_tp:
        raise ConfigError(
            f"rollout.tensor_parallel_size: {engine_tp} does not divide the {len(rollout)} rollout devices"
        )
    engines = tuple(tuple(rollout[i : i + engine_tp]) for i in range(0, len(rollout), engine_tp))
    return Placement(world_size=world_size, components={k: tuple(v) for k, v in components.items()}, engines=engines)
