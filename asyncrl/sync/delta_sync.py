"""The sender of the delta sync (``sync.delta = true``): only the elements that changed since the version every
engine holds, checked per tensor on the engine, resent whole where a check failed.

Contract
- Wires: ``WeightSyncer`` (step 4 of its sync, in place of the broadcast), the engines' SGLang
  ``/update_weights_from_tensor`` with ``load_format = delta_loader.LOADER`` (the engine was started with
  ``--custom-weight-loader`` of it) and the loader's report files under ``sync.delta_report_dir``.
- State: ``last`` - every tensor of the last version sent, at the wire dtype, in host memory (one copy of the
  model at ``sync.wire_dtype``: 2 bytes a parameter at bf16) - and ``version``, the version that every engine got
  whole (None before the first sync and after a failed one: the next sync sends everything whole).
- One push: (1) ``GET /model_info`` of every engine: one whose ``weight_version`` is ``version`` holds ``last``
  (the loader's base) and gets deltas; any other (restarted, late, first sync) gets every tensor whole, and so does
  one named to ``forget(url)`` since its last push (it loaded a version from disk: ``asyncrl.sync.catchup``, its
  loader has no base although its version matches).
  (2) per bucket: each tensor converted to the wire dtype; ``delta.encode(last[name], new, max_density=
  sync.delta_max_density)``, whole where that returns None; one ``/update_weights_from_tensor`` per engine (all
  at once, each bounded by ``sync.step_timeout_s``), then each engine's report read: the tensors whose delta
  failed (checksum, no base) are noted per engine. (3) the noted tensors go again whole to their engines (the same
  call, whole entries); a failure then fails the sync naming the engine and tensors.
- The payload is built per engine (it names the engine's report file), packed into two tensors and pickled by value
  (``tensor_payload``): HTTP and base64 carry it, 4/3 of the tensor bytes plus ~60 bytes of header a tensor.
- ``tamper(url, named)`` (tests only): given each engine's entries before they are serialized, returns what goes
  instead, the way a corrupted transfer would change them.
- Figures (``DeltaStats.metrics``): ``sync/bytes_sent`` (tensor bytes of every payload, every engine, resends
  included), ``sync/bytes_full`` (what sending every tensor whole to every engine would be),
  ``sync/delta_density`` (changed elements / elements, over the tensors that had a base; absent when none had),
  ``sync/checksum_failures`` ((engine, tensor) pairs whose delta failed its check).

    sender = DeltaSender(sync_cfg)
    stats = sender.push(urls, buckets, flush_cache=True, tp_sizes=[1, 1])  # paused, weight-update session open
    sender.version = "7"                                    # once the sync finished
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from asyncrl.cluster.tensor_payload import pack_named_tensors, serialize_named_tensors
from asyncrl.config.schema import SyncConfig
from asyncrl.engine.blocking import Call, EngineStepError, Exchange
from asyncrl.sync import delta as codec
from asyncrl.sync.bucketing import Bucket, dtype_from_name
from asyncrl.sync.delta_loader import LOADER, REPORT, path_tensor, report_file

STEP = "update_weights_from_tensor"
_REPORT_WAIT_S = 10.0  # a report on a shared filesystem may show up a little after the answer
_REPORT_POLL_S = 0.05


@dataclass
class DeltaStats:
    bytes_sent: int = 0
    bytes_full: int = 0
    changed: int = 0
    compared: int = 0
    checksum_failures: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    gather_s: float = 0.0
    """seconds waiting on the bucket iterator (the actor's gather and conversion)"""
    transfer_s: float = 0.0
    """seconds encoding and sending (the update calls, the reports, the resends)"""
    resent: dict[str, list[str]] = field(default_factory=dict)
    """engine -> the tensors resent whole after their delta failed"""

    def metrics(self) -> dict[str, float]:
        out = {
            "sync/bytes_sent": float(self.bytes_sent),
            "sync/bytes_full": float(self.bytes_full),
            "sync/checksum_failures": float(self.checksum_failures),
        }
        if self.compared:
            out["sync/delta_density"] = self.changed / self.compared
        return out


def wire_dtype(cfg: SyncConfig) -> Optional[torch.dtype]:
    """``sync.wire_dtype`` as a torch dtype (None: ``auto``, the actor's own)."""
    return None if cfg.wire_dtype == "auto" else dtype_from_name(cfg.wire_dtype)


def to_wire(buckets: Iterable[Bucket], dtype: Optional[torch.dtype]) -> Iterable[Bucket]:
    """Each bucket's tensors at ``dtype`` (the bucket's class kept: a ``LastBucket`` stays one)."""
    for b in buckets:
        yield b if dtype is None else type(b)((n, t.to(dtype)) for n, t in b)


def update_body(named: list[tuple[str, torch.Tensor]], *, report: str, tp_size: int, flush_cache: bool) -> dict:
    """The ``/update_weights_from_tensor`` body of one engine's entries (SGLang's ``UpdateWeightsFromTensorReqInput``:
    the same payload for each of its TP ranks; its loader reports to ``report``)."""
    entry = serialize_named_tensors([*pack_named_tensors(named), (REPORT, path_tensor(report))])
    return {
        "serialized_named_tensors": [entry] * tp_size,
        "load_format": LOADER,
        "flush_cache": flush_cache,
        "weight_version": None,
    }


class DeltaSender:
    """See module contract."""

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg
        self.tp_sizes: list[int] = []
        """each engine's TP size, this push (SGLang wants one payload entry per TP rank)"""
        self.dtype = wire_dtype(cfg)
        self.last: dict[str, torch.Tensor] = {}
        self.version: Optional[str] = None
        self.report_dir = Path(cfg.delta_report_dir or tempfile.mkdtemp(prefix="asyncrl-delta-"))
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self.stats: Optional[DeltaStats] = None
        """the last push's figures"""
        self.no_base: set[str] = set()
        """engines that got weights past the loader since the last push (``forget``): whole next time"""
        self.tamper: Optional[Callable[[str, list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]] = None
        self._calls = 0

    def forget(self, url: str) -> None:
        """The engine at ``url`` loaded weights another way (a pull from disk): its next push is whole."""
        self.no_base.add(url)

    def _engine_versions(self, urls: list[str]) -> list[str]:
        chains = [(u, [Call("/model_info", None, "model_info", method="GET")]) for u in urls]
        return [str(a[0].get("weight_version")) for a in Exchange(chains, timeout_s=self.cfg.step_timeout_s).run()]

    def _send(self, urls: list[str], payloads: list[list], *, flush_cache: bool) -> list[dict[str, str]]:
        """One ``/update_weights_from_tensor`` per engine (``payloads[i]`` to ``urls[i]``, skipped when empty), all
        at once; each engine's failed tensors (from its loader's reports)."""
        self._calls += 1
        chains, prefixes = [], []
        for i, (u, named) in enumerate(zip(urls, payloads)):
            prefix = str(self.report_dir / f"call{self._calls}.engine{i}")
            prefixes.append(prefix)
            if not named:
                continue
            if self.tamper is not None:
                named = self.tamper(u, named)
            body = update_body(named, report=prefix, tp_size=self.tp_sizes[i], flush_cache=flush_cache)
            chains.append((u, [Call("/update_weights_from_tensor", body, STEP)]))
        Exchange(chains, timeout_s=self.cfg.step_timeout_s).run()
        return [
            self._read_report(u, p, self.tp_sizes[i]) if payloads[i] else {}
            for i, (u, p) in enumerate(zip(urls, prefixes))
        ]

    def _read_report(self, url: str, prefix: str, tp_size: int) -> dict[str, str]:
        failed: dict[str, str] = {}
        for rank in range(tp_size):
            path = report_file(prefix, rank)
            deadline = time.monotonic() + _REPORT_WAIT_S
            while not path.exists():
                if time.monotonic() > deadline:
                    raise EngineStepError(
                        url,
                        STEP,
                        f"the delta loader wrote no report at {path} (is the engine started with "
                        f"--custom-weight-loader {LOADER}, and does it share this filesystem: sync.delta_report_dir?)",
                    )
                time.sleep(_REPORT_POLL_S)
            failed.update(json.loads(path.read_text())["failed"])
            path.unlink()
        return failed

    def _entries(self, name: str, new: torch.Tensor, stats: DeltaStats) -> list[tuple[str, torch.Tensor]]:
        """The delta entries of one tensor against ``last``, or the whole tensor."""
        old = self.last.get(name)
        if old is None:
            return [(name, new)]
        d = codec.encode(old, new, max_density=self.cfg.delta_max_density)
        stats.compared += new.numel()
        if d is None:
            same = old.shape == new.shape and old.dtype == new.dtype
            stats.changed += int(codec.changed_indices(old, new).numel()) if same else new.numel()
            return [(name, new)]
        stats.changed += d.count
        return list(codec.to_tensors(d, name).items())

    def push(
        self, urls: list[str], buckets: Iterable[Bucket], *, flush_cache: bool, tp_sizes: Sequence[int]
    ) -> DeltaStats:
        """Steps (1)-(3) of the module contract; ``version`` is None until the caller sets it after the sync."""
        self.tp_sizes = list(tp_sizes)
        versions = self._engine_versions(urls)
        at_base = [
            self.version is not None and v == self.version and u not in self.no_base for u, v in zip(urls, versions)
        ]
        self.version = None  # until this sync finished: a failed one leaves the engines' bases unknown
        stats = self.stats = DeltaStats()
        failed: dict[str, list[str]] = {u: [] for u in urls}
        t0 = time.perf_counter()
        for bucket in to_wire(buckets, self.dtype):
            t1 = time.perf_counter()
            stats.gather_s += t1 - t0
            whole: list[tuple[str, torch.Tensor]] = []
            delta: list[tuple[str, torch.Tensor]] = []
            for name, t in bucket:
                new = t.detach().to("cpu", copy=True).contiguous()
                whole.append((name, new))
                delta += self._entries(name, new, stats) if any(at_base) else []
                self.last[name] = new
            payloads = [delta if b else whole for b in at_base]
            for b in at_base:
                stats.bytes_sent += sum(int(t.numel() * t.element_size()) for _, t in (delta if b else whole))
                stats.bytes_full += sum(int(t.numel() * t.element_size()) for _, t in whole)
            for u, bad in zip(urls, self._send(urls, payloads, flush_cache=flush_cache)):
                failed[u] += sorted(bad)
            stats.num_tensors += len(whole)
            stats.num_buckets += 1
            t0 = time.perf_counter()
            stats.transfer_s += t0 - t1
        stats.checksum_failures = sum(len(v) for v in failed.values())
        if stats.checksum_failures:
            stats.resent = {u: v for u, v in failed.items() if v}
            payloads = [[(n, self.last[n]) for n in failed[u]] for u in urls]
            stats.bytes_sent += sum(int(t.numel() * t.element_size()) for p in payloads for _, t in p)
            still = self._send(urls, payloads, flush_cache=flush_cache)
            bad = [u for u, s in zip(urls, still) if s]
            if bad:
                raise EngineStepError(bad, STEP, f"tensors failed again when resent whole: {still}")
            stats.transfer_s += time.perf_counter() - t0
        self.no_base -= {u for u, b in zip(urls, at_base) if not b}  # they got every tensor whole: the new base
        return stats
