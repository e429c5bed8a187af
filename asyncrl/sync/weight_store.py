"""The versioned weight store: every synced weight version on disk, from which an engine catches up by pulling.

Contract
- Who writes: actor rank 0, from the HF buckets it already holds during a weight sync (``WeightStore.capture`` passes
  them on to the syncer unchanged and keeps a host copy; no extra gather), then ``put_async(version, state)`` once the
  sync succeeded (``asyncrl.sync.recovery.sync_weights``): the write runs on the store's one writer thread while the
  actor trains on; ``latest()`` (hence a pull) and the next ``put_async`` wait for it, and raise its failure.
  Who reads: ``materialize(version)`` for the catch-up pull (``asyncrl.sync.catchup``), on actor rank 0; the engine
  reads the directory it returns.
- Layout under ``root`` (``sync.store_dir``, default ``<run_dir>/weight_store``)::

      v00000012/weights.safetensors   a base: every tensor; a delta: only what changed since the previous version
      v00000012/manifest.json         version, kind, base, parent, per-tensor dtype/shape/checksum/how it is stored
      materialized/v00000012/model.safetensors   the full weights of the latest pulled version (SGLang's
                                      DefaultModelLoader reads ``*.safetensors`` of ``model_path``; nothing else)
      .tmp-*                          a write in progress (or torn by a crash): never read, removed on open

- Atomic: a version (and a materialized directory) is written under a ``.tmp-`` name, each file fsynced, then renamed
  into place and the parent fsynced; only ``v<digits>`` directories with a manifest are versions. A crash mid-write
  leaves only a ``.tmp-`` directory: no version that looks complete.
- Bases and deltas (pure core, ``VersionPlan``): the first version written by this process, and every
  ``sync.store_base_interval``-th after it, is a base; the others are deltas against the previous version
  (``encode_version``: a tensor whose checksum did not change is not stored, a changed one as its changed elements,
  ``asyncrl.sync.delta.encode``, or whole where that is not smaller). Reading version v applies its chain
  (its base, then every delta up to v) and checks every tensor against v's manifest checksum: a mismatch, a missing
  tensor or an unreadable file raises ``StoreCorruption`` naming the version, the file and the tensor.
- Retention (``sync.store_keep_bases``): the newest N chains (a base and its deltas) are kept, older ones deleted
  after each ``put``. Writing version v removes every version >= v first (left by an attempt that resumed from an
  earlier checkpoint: not this run's weights any more).
- Memory: two versions on the host, the last one (the next delta's base) and the sync in progress (``captured``); a
  third while a write is still in flight when the next sync captures.
- Pure core, thin shell: ``VersionPlan``, ``encode_version`` and ``decode_chain`` do no I/O (the delta codec and the
  checksums are ``asyncrl.sync.delta``'s);
  ``WeightStore`` only moves bytes between them and the files.

    store = WeightStore(run_dir / "weight_store", base_interval=8, keep_bases=2)
    for bucket in store.capture(actor.iter_hf_buckets(bucket_bytes)): ...   # the sync sends it
    store.put_async(version, store.captured)                                # after the sync succeeded
    path = store.materialize(store.latest())  # POST /update_weights_from_disk {"model_path": str(path), ...}
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from asyncrl.cluster.durable import fsync_dir, fsync_file
from asyncrl.sync import delta

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
MATERIALIZED = "materialized"
# The file name the materialized directory holds: SGLang's loader globs ``*.safetensors`` under model_path.
MATERIALIZED_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_TMP_PREFIX = ".tmp-"

FULL, DELTA, SAME = "full", "delta", "same"
"""How a tensor is stored in a version: its whole bytes, its changed elements (``asyncrl.sync.delta``), or not at all
(unchanged since the parent version)."""


class StoreCorruption(RuntimeError):
    """A stored version that cannot be read back as written (a checksum mismatch, a missing tensor or file)."""


# ------------------------------------------------------------------------------------------------------ pure core
# A tensor with more of its elements changed than this is stored whole (the codec also declines a delta that is not
# smaller than the tensor): at RL learning rates a step changes a few percent of the bf16 elements.
MAX_DELTA_DENSITY = 0.5


def _entry(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "checksum": delta.checksum(t)}


@dataclass
class Manifest:
    """What one stored version holds (``manifest.json``)."""

    version: int
    kind: str
    """``base`` (every tensor stored) or ``delta`` (against ``parent``)."""
    base: int
    """The base version of this version's chain (itself for a base)."""
    parent: Optional[int]
    """The previous version in the chain (None for a base)."""
    tensors: dict[str, dict] = field(default_factory=dict)
    """name -> {dtype, shape, checksum (``delta.checksum``), stored: full|delta|same}, in the actor's bucket order."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "kind": self.kind,
                "base": self.base,
                "parent": self.parent,
                "tensors": self.tensors,
            }
        )

    @classmethod
    def from_json(cls, text: str, *, where: str) -> Manifest:
        try:
            d = json.loads(text)
            return cls(int(d["version"]), str(d["kind"]), int(d["base"]), d["parent"], dict(d["tensors"]))
        except (ValueError, KeyError, TypeError) as e:
            raise StoreCorruption(f"{where}: unreadable manifest ({type(e).__name__}: {e})") from None


class VersionPlan:
    """Which kind the next version takes, and which versions retention drops (no I/O)."""

    def __init__(self, *, base_interval: int, keep_bases: int):
        assert base_interval >= 1 and keep_bases >= 1
        self.base_interval, self.keep_bases = base_interval, keep_bases
        self.since_base: Optional[int] = None
        """Versions written since the last base by this process (None: none written yet)."""

    def next_kind(self) -> str:
        return "base" if self.since_base is None or self.since_base + 1 >= self.base_interval else "delta"

    def wrote(self, kind: str) -> None:
        self.since_base = 0 if kind == "base" else self.since_base + 1

    def dropped(self, manifests: list[Manifest]) -> list[int]:
        """Versions outside the newest ``keep_bases`` chains."""
        bases = sorted({m.base for m in manifests})
        keep = set(bases[-self.keep_bases :])
        return sorted(m.version for m in manifests if m.base not in keep)


def encode_version(
    version: int,
    state: dict[str, torch.Tensor],
    *,
    prev: Optional[tuple[Manifest, dict[str, torch.Tensor]]],
    kind: str,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest and the tensors to write for ``state`` at ``version``. A delta needs ``prev`` (the parent's
    manifest and weights): an unchanged tensor is not stored, a changed one as ``delta.encode``'s three tensors
    (``delta.to_tensors``) or whole when the codec declines."""
    assert kind == "base" or prev is not None, "a delta needs the previous version"
    parent = None if kind == "base" else prev[0].version
    base = version if kind == "base" else prev[0].base
    m, payload = Manifest(version, kind, base, parent), {}
    for name, t in state.items():
        entry = _entry(t)
        old = None if kind == "base" else prev[1].get(name)
        if old is not None and prev[0].tensors.get(name, {}).get("checksum") == entry["checksum"]:
            entry["stored"] = SAME
        else:
            d = None if old is None else delta.encode(old, t, max_density=MAX_DELTA_DENSITY)
            entry["stored"] = FULL if d is None else DELTA
            payload.update({name: t} if d is None else delta.to_tensors(d, name))
        m.tensors[name] = entry
    return m, payload


def decode_chain(chain: list[tuple[Manifest, dict[str, torch.Tensor]]], *, where: str) -> dict[str, torch.Tensor]:
    """The full weights of the last version of ``chain`` (a base, then its deltas in order, each with the tensors
    its file holds), every tensor checked against each version's manifest on the way; ``StoreCorruption`` names the
    file, the version and the tensor."""
    assert chain and chain[0][0].kind == "base", "a chain starts with a base"
    state: dict[str, torch.Tensor] = {}
    for m, payload in chain:
        f = f"{where}/{_dir_name(m.version)}/{WEIGHTS_FILE}"
        for name, entry in m.tensors.items():
            how = entry["stored"]
            if how != FULL and name not in state:
                raise StoreCorruption(f"{f}: version {m.version} builds on {name!r}, which no earlier version holds")
            try:
                if how == FULL:
                    state[name] = payload[name]
                elif how == DELTA:
                    state[name] = delta.apply(state[name], delta.from_tensors(payload, name), name=name)
            except KeyError:
                raise StoreCorruption(f"{f}: version {m.version} lacks tensor {name!r}") from None
            except delta.ChecksumError as e:
                raise StoreCorruption(f"{f}: version {m.version}: {e}") from None
            got = _entry(state[name])
            if got != {k: entry[k] for k in got}:
                raise StoreCorruption(
                    f"{f}: tensor {name!r} of version {m.version} fails its checksum: "
                    f"{got['checksum']} ({got['dtype']} {got['shape']}) != manifest {entry['checksum']} "
                    f"({entry['dtype']} {entry['shape']})"
                )
    return {name: state[name] for name in chain[-1][0].tensors}


def _dir_name(version: int) -> str:
    return f"v{version:08d}"


# ----------------------------------------------------------------------------------------------------- file shell
def _publish(tmp: Path, final: Path) -> None:
    """Make the fully written ``tmp`` directory visible as ``final`` in one rename (fsynced before and after)."""
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


class WeightStore:
    """The store's files under ``root`` (see module contract)."""

    def __init__(self, root: Path, *, base_interval: int, keep_bases: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.plan = VersionPlan(base_interval=base_interval, keep_bases=keep_bases)
        self.captured: dict[str, torch.Tensor] = {}
        """The weights of the sync in progress (``capture``), name -> host tensor."""
        self.captured_whole = False
        """``captured`` holds every tensor of its version (the capture ran to the end)."""
        self._prev: Optional[tuple[Manifest, dict[str, torch.Tensor]]] = None
        self.put_s = 0.0
        """Seconds in ``put`` (encoding and writing) since ``take_put_figures``."""
        self.put_bytes = 0
        """Bytes of the weights files ``put`` wrote since ``take_put_figures``."""
        self._figures_lock = threading.Lock()
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._torn = self._remove_torn(self.root) + self._remove_torn(self.root / MATERIALIZED)
        if self._torn:
            log.warning("weight store %s: removed %d torn write(s): %s", self.root, len(self._torn), self._torn)

    @staticmethod
    def _remove_torn(d: Path) -> list[str]:
        torn = [p for p in d.glob(_TMP_PREFIX + "*")] if d.is_dir() else []
        for p in torn:
            shutil.rmtree(p, ignore_errors=True)
        return [p.name for p in torn]

    # -- writing
    def capture(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Pass ``buckets`` on unchanged, keeping a host copy of every tensor in ``captured`` (reset first);
        ``captured_whole`` turns true once ``buckets`` ran out (not when it raised: a partial version)."""
        self.captured, self.captured_whole = {}, False
        for bucket in buckets:
            for name, t in bucket:
                self.captured[name] = t.detach().to("cpu", copy=True)
            yield bucket
        self.captured_whole = True

    def take_put_figures(self) -> tuple[float, int]:
        """``put_s`` and ``put_bytes``, then both reset."""
        with self._figures_lock:  # the writer thread adds to them
            out = (self.put_s, self.put_bytes)
            self.put_s, self.put_bytes = 0.0, 0
        return out

    def put_async(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """``put`` on the store's writer thread (the step goes on meanwhile); the previous write is waited for first
        (one at a time, in order), and its failure raised here."""
        self.wait()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="weight-store")
        self._pending = self._writer.submit(self.put, version, state)

    def wait(self) -> None:
        """Until the write in flight (``put_async``) is on disk; its failure is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def put(self, version: int, state: dict[str, torch.Tensor]) -> Manifest:
        """Write ``version`` atomically (a base or a delta, ``VersionPlan``), then apply the retention."""
        t0 = time.perf_counter()
        for v in [v for v in self.versions() if v >= version]:  # a resumed attempt's future: not this run's weights
            shutil.rmtree(self.root / _dir_name(v))
            shutil.rmtree(self.root / MATERIALIZED / _dir_name(v), ignore_errors=True)
            self._prev = None if self._prev is not None and self._prev[0].version >= version else self._prev
        kind = self.plan.next_kind() if self._prev is not None else "base"
        manifest, payload = encode_version(version, state, prev=self._prev, kind=kind)
        tmp = self.root / f"{_TMP_PREFIX}{_dir_name(version)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in payload.items()}, str(tmp / WEIGHTS_FILE))
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        num_bytes = (tmp / WEIGHTS_FILE).stat().st_size
        _publish(tmp, self.root / _dir_name(version))
        self.plan.wrote(kind)
        self._prev = (manifest, state)
        for v in self.plan.dropped(self.manifests()):
            shutil.rmtree(self.root / _dir_name(v), ignore_errors=True)
        with self._figures_lock:
            self.put_s += time.perf_counter() - t0
            self.put_bytes += num_bytes
        log.info(
            "weight store: version %d (%s, %d of %d tensors changed) in %s",
            version,
            kind,
            sum(e["stored"] != SAME for e in manifest.tensors.values()),
            len(state),
            self.root,
        )
        return manifest

    # -- reading
    def versions(self) -> list[int]:
        """Every complete version on disk (a ``v<digits>`` directory with its manifest), oldest first."""
        out = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and (p / MANIFEST_FILE).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> Optional[int]:
        """The newest complete version (a write in flight is waited for first: ``wait``)."""
        self.wait()
        vs = self.versions()
        return vs[-1] if vs else None

    def manifest(self, version: int) -> Manifest:
        d = self.root / _dir_name(version)
        try:
            text = (d / MANIFEST_FILE).read_text()
        except OSError as e:
            raise StoreCorruption(f"weight store {self.root}: version {version} has no readable manifest ({e})") from e
        return Manifest.from_json(text, where=f"weight store {d}")

    def manifests(self) -> list[Manifest]:
        return [self.manifest(v) for v in self.versions()]

    def read(self, version: int) -> dict[str, torch.Tensor]:
        """The full weights of ``version``, every tensor verified (``StoreCorruption`` otherwise)."""
        chain, m = [], self.manifest(version)
        while True:
            chain.append(m)
            if m.kind == "base":
                break
            if m.parent is None or m.parent not in self.versions():
                raise StoreCorruption(f"weight store {self.root}: version {m.version}'s parent {m.parent} is gone")
            m = self.manifest(m.parent)
        loaded = []
        for m in reversed(chain):
            f = self.root / _dir_name(m.version) / WEIGHTS_FILE
            try:
                loaded.append((m, load_file(str(f))))
            except (SafetensorError, OSError) as e:
                raise StoreCorruption(f"weight store {f}: not a readable safetensors file ({e})") from None
        return decode_chain(loaded, where=f"weight store {self.root}")

    def materialize(self, version: int) -> Path:
        """A directory ``/update_weights_from_disk`` loads ``version`` from (``materialized/v.../model.safetensors``),
        written atomically from verified weights (the chain read back and checked, or the last version this store
        wrote, still in memory; a base's file is hard-linked); the latest one is cached (older ones removed)."""
        mat = self.root / MATERIALIZED
        final = mat / _dir_name(version)
        if (final / MATERIALIZED_FILE).is_file():
            return final
        self.wait()
        if self._prev is not None and self._prev[0].version == version:  # the last version written: in memory
            state = self._prev[1]
        else:
            state = self.read(version)  # verified, also for a base
        mat.mkdir(exist_ok=True)
        tmp = mat / f"{_TMP_PREFIX}{_dir_name(version)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if self.manifest(version).kind == "base":  # its file holds every tensor already: no copy
            os.link(self.root / _dir_name(version) / WEIGHTS_FILE, tmp / MATERIALIZED_FILE)
        else:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / MATERIALIZED_FILE))
        _publish(tmp, final)
        for old in mat.iterdir():
            if old.name != final.name and _VERSION_DIR.match(old.name):
                shutil.rmtree(old, ignore_errors=True)
        return final
