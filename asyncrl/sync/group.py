"""Trainer side of the weight-sync process group: rank 0 plus every engine's TP ranks.

Contract
- One group: the actor's global rank 0 is rank 0 and hosts the rendezvous store (at PP > 1 the other
  stages' tensors reach it first, ``asyncrl.actor.pipeline.gather_to_rank0``); engine i's TP ranks are
  ``rank_offset_i + tp_rank`` with ``rank_offset_0 = 1`` and ``world_size = 1 + sum(engine TP sizes)``.
- ``WeightSyncGroup.init()``: (1) ``GET /model_info`` on every engine (an unreachable one fails at
  once, named); (2) ``POST /init_weights_update_group`` to every engine at once, on threads — each
  call blocks until everyone joined — while (3) the trainer joins as rank 0 through
  ``asyncrl.cluster.weight_update_group.init_weight_update_group`` (TCPStore + PrefixStore + torch's
  private helper, SGLang's way), also on a thread, bounded by ``sync.join_timeout_s``. Once formed,
  each collective on the group (a bucket's broadcast) is bounded by ``sync.broadcast_timeout_s``.
  The first engine to fail (refused, HTTP error, ``success=false``) fails the join immediately; at
  the deadline every engine that has not joined is named. Never a hang.
- ``destroy()`` asks every engine to drop the group (an engine that restarted no longer knows it:
  warned, not fatal) and destroys the trainer's end; ``recreate()`` = destroy + init, e.g. after an
  engine restart (optionally with a new engine list).

    group = WeightSyncGroup([EngineEndpoint("http://10.0.0.2:30000", tp_size=2)], cfg.sync)
    group.init()                      # raises GroupJoinError naming the engine at fault
    dist.broadcast(t, group_src=0, group=group.pg)
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import socket
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from asyncrl.cluster import weight_update_group as _pgmod
from asyncrl.cluster.ports import free_port
from asyncrl.config.schema import SyncConfig
from asyncrl.engine.blocking import EngineStepError, get_json, post_json, spawn, wait_all

log = logging.getLogger(__name__)

# Extra seconds the HTTP join calls may take beyond the rendezvous timeout: the engine answers
# only after its own side of the group is built, which follows the rendezvous.
_JOIN_HTTP_GRACE_S = 10.0
# Preflight /model_info probe: an engine that cannot answer this in a few seconds is not going to
# join; keeps "unreachable" failures fast even with a long join_timeout_s.
_PREFLIGHT_TIMEOUT_S = 10.0

# Our own rendezvous threads still blocked in torch.distributed after a failed join (an engine refused at once, the
# trainer's side waits out sync.join_timeout_s): future -> its deadline. Such a thread cannot be interrupted, and a
# process that exits under it aborts ("terminate called without an active exception", exit 134) when its timeout
# fires during interpreter teardown (seen at the end of a test session). At exit they are waited out first.
_ABANDONED: dict[cf.Future, float] = {}


@atexit.register
def _wait_abandoned_rendezvous() -> None:
    left = [f for f in _ABANDONED if not f.done()]
    if not left:
        return
    wait_s = max(0.0, max(_ABANDONED[f] for f in left) - time.monotonic())
    log.warning("exit: waiting up to %.0f s for %d abandoned weight-sync rendezvous to time out", wait_s, len(left))
    cf.wait(left, timeout=wait_s)


class GroupJoinError(RuntimeError):
    """The weight-sync group could not be formed; ``urls`` are the engines at fault."""

    def __init__(self, urls: Sequence[str], detail: str):
        self.urls = list(urls)
        super().__init__(f"weight-sync group: engine {', '.join(self.urls)}: {detail}")


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine server: its base URL and its tensor-parallel size (ranks it brings)."""

    url: str
    tp_size: int = 1


def rank_offsets(engines: Sequence[EngineEndpoint]) -> list[int]:
    """Group rank of each engine's TP rank 0 (the trainer is rank 0)."""
    out, nxt = [], 1
    for e in engines:
        if e.tp_size < 1:
            raise ValueError(f"engine {e.url}: tp_size must be >= 1, got {e.tp_size}")
        out.append(nxt)
        nxt += e.tp_size
    return out


def group_world_size(engines: Sequence[EngineEndpoint]) -> int:
    return 1 + sum(e.tp_size for e in engines)


def resolve_backend(backend: str) -> str:
    """``sync.backend`` -> the torch backend: ``auto`` is nccl with CUDA, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def default_master_address(engine_urls: Sequence[str]) -> str:
    """This host's address as seen on the route to the first engine (no packet is sent)."""
    host = urllib.parse.urlparse(engine_urls[0]).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))  # UDP connect only picks the route
        return s.getsockname()[0]


def join_request(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict:
    """The JSON body of ``POST /init_weights_update_group`` for one engine (checked against SGLang's request
    class by tools/check_sglang.py)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


class WeightSyncGroup:
    """Rank 0 of one weight-update group with a fixed list of engines (see module contract)."""

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        cfg: SyncConfig,
        *,
        group_name: Optional[str] = None,
        master_address: Optional[str] = None,
        control_timeout_s: float = 60.0,
    ):
        if not engines:
            raise ValueError("weight-sync group needs at least one engine")
        self.engines = list(engines)
        self.cfg = cfg
        self.group_name = group_name or cfg.group_name
        self.backend = resolve_backend(cfg.backend)
        self._master_address = master_address
        self.control_timeout_s = control_timeout_s
        self.pg: Optional[dist.ProcessGroup] = None
        self.master_port: Optional[int] = None

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def world_size(self) -> int:
        return group_world_size(self.engines)

    @property
    def master_address(self) -> str:
        return self._master_address or default_master_address(self.urls)

    def init(self, *, root: Optional[tuple[str, int]] = None) -> None:
        """Form the group (see contract). Raises ``GroupJoinError`` naming the engine(s) at fault. With ``root``
        (``(master_address, master_port)``), another process joins as rank 0 and hosts the store there (a sharded
        sync's sender, ``asyncrl.sync.sharded``): this end only makes the engines' join calls and waits for them;
        ``pg`` stays None."""
        if self.pg is not None:
            raise RuntimeError(f"weight-sync group {self.group_name!r} already initialised; destroy() first")
        self._preflight()
        addr, port = root if root is not None else (self.master_address, None)
        port = port if port is not None else free_port(addr)
        world = self.world_size
        timeout_s = self.cfg.join_timeout_s
        t0 = time.monotonic()

        def engine_join(engine: EngineEndpoint, offset: int) -> dict:
            body = join_request(
                master_address=addr,
                master_port=port,
                rank_offset=offset,
                world_size=world,
                group_name=self.group_name,
                backend=self.backend,
            )
            return post_json(
                engine.url,
                "/init_weights_update_group",
                body,
                timeout_s=timeout_s + _JOIN_HTTP_GRACE_S,
                step="init_weights_update_group",
            )

        http = {
            spawn(engine_join, e, off, name="sync-join"): e.url
            for e, off in zip(self.engines, rank_offsets(self.engines))
        }
        trainer = None if root is not None else self._join_as_root(addr, port)
        try:
            self._wait_joined(http, trainer, timeout_s + _JOIN_HTTP_GRACE_S)
        except GroupJoinError:
            if trainer is not None and not trainer.done():
                _ABANDONED[trainer] = t0 + timeout_s + _JOIN_HTTP_GRACE_S
            raise
        self.master_port = port
        log.info(
            "weight-sync group %r formed: %d ranks at %s:%d in %.2f s (%s)",
            self.group_name,
            world,
            addr,
            port,
            time.monotonic() - t0,
            self.backend,
        )

    def _join_as_root(self, addr: str, port: int) -> cf.Future:
        """This process's join as rank 0 (hosting the store), on a thread."""
        return spawn(
            _pgmod.init_weight_update_group,
            addr,
            port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.cfg.join_timeout_s,
            collective_timeout_s=self.cfg.broadcast_timeout_s,
            name="sync-join-trainer",
        )

    def _preflight(self) -> None:
        t = min(_PREFLIGHT_TIMEOUT_S, self.cfg.join_timeout_s)
        futs = {
            spawn(get_json, e.url, "/model_info", timeout_s=t, step="model_info", name="sync-preflight"): e.url
            for e in self.engines
        }
        try:
            wait_all(futs, timeout_s=t + 1, step="model_info")
        except EngineStepError as e:
            raise GroupJoinError(e.urls, f"not reachable before joining the group: {e.detail}") from e

    def _wait_joined(self, http: dict[cf.Future, str], trainer: Optional[cf.Future], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(http) | ({trainer} if trainer is not None else set())
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                late = [u for f, u in http.items() if not f.done()]
                raise GroupJoinError(late, f"did not join within sync.join_timeout_s={self.cfg.join_timeout_s:g} s")
            done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                if f in http and f.exception() is not None:
                    exc = f.exception()
                    detail = exc.detail if isinstance(exc, EngineStepError) else repr(exc)
                    raise GroupJoinError([http[f]], f"refused to join: {detail}") from exc
            if trainer is not None and trainer in done and trainer.exception() is not None:
                # Our rendezvous timed out: whoever has not answered is who never joined.
                late = [u for f, u in http.items() if not (f.done() and f.exception() is None)]
                raise GroupJoinError(
                    late or self.urls,
                    f"did not join within sync.join_timeout_s={self.cfg.join_timeout_s:g} s ({trainer.exception()})",
                ) from trainer.exception()
        self.pg = trainer.result() if trainer is not None else None

    def destroy(self) -> None:
        """Engines drop the group (a restarted/dead engine only warns), then the trainer's end."""
        body = {"group_name": self.group_name}
        futs = {
            spawn(
                post_json,
                e.url,
                "/destroy_weights_update_group",
                body,
                timeout_s=self.control_timeout_s,
                step="destroy_weights_update_group",
                name="sync-destroy",
            ): e.url
            for e in self.engines
        }
        cf.wait(futs, timeout=self.control_timeout_s + 1)
        for f, url in futs.items():
            if not f.done():
                log.warning(
                    "engine %s: destroy_weights_update_group did not answer in %.0f s", url, self.control_timeout_s
                )
            elif f.exception() is not None:
                log.warning("engine %s: destroy_weights_update_group: %s", url, f.exception())
        if self.pg is not None:
            _pgmod.destroy_weight_update_group(self.pg)
            self.pg = None
        self.master_port = None

    def recreate(self, engines: Optional[Sequence[EngineEndpoint]] = None) -> None:
        """Destroy and form again (after an engine restart; ``engines`` replaces the list)."""
        self.destroy()
        if engines is not None:
            if not engines:
                raise ValueError("weight-sync group needs at least one engine")
            self.engines = list(engines)
        self.init()
