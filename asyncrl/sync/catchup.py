"""Catch-up by pulling: a restarted (or late) engine loads the store's latest version from disk before it takes work.

Contract
- Wires: the versioned weight store (``asyncrl.sync.weight_store``, written by actor rank 0 during each sync) and one
  engine's HTTP API. Who calls: actor rank 0's ``EngineRecovery.catch_up`` (``asyncrl.sync.recovery``), from the
  leader's batch wait, as soon as a rollout rank announced a restart; the rollout rank's worker takes work only once
  the recovery published the engine as synced, so the pull always lands before the engine's first request.
- What is pulled: the store's latest version, i.e. the version every other engine serves (a sync's version is written
  only after the sync succeeded), through SGLang's own ``POST /update_weights_from_disk {model_path, load_format:
  "safetensors", weight_version: str(v), abort_all_requests: false, flush_cache: true}`` (its
  ``UpdateWeightFromDiskReqInput`` fields), bounded by ``sync.step_timeout_s``. Before any sync the store is empty
  and the engines serve version 0, the checkpoint they start from (``rollout.model_path``): that is what is pulled.
- The engine must confirm the version: its answer says " Weight version updated to V." (``confirms_weight_version``)
  or ``/model_info.weight_version`` equals V; otherwise ``EngineStepError`` names the engine.
- ``model_path`` is a path on the engine's host: on a cluster the store (by default in the run directory) must be on
  a filesystem every engine node mounts at the same path (``asyncrl.config.validate`` warns, in the dry run and at
  startup, when the engines are on other nodes than actor rank 0).
- The group is not re-formed here: the next broadcast does that (``EngineRecovery.before_sync``); the broadcast stays
  the fast path of every sync.
- After a failed broadcast (``EngineRecovery.pull_instead``) every engine pulls the version the failed sync carried
  (written to the store first); ``gone(url)`` tells an engine whose process is gone (its port refuses connections:
  it pulls once restarted) from one that is alive but failed. ``num_fallbacks`` counts those syncs.
- ``on_pull(url)`` is called after each pull (the delta sender forgets that engine's base: a disk load leaves the
  delta loader without one, so its next sync is whole).

    puller = Puller(store, initial_path=cfg.rollout.model_path, timeout_s=cfg.sync.step_timeout_s)
    version, seconds = puller.pull("http://10.0.0.2:31000")
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from asyncrl.engine.blocking import EngineStepError, get_json, post_json
from asyncrl.engine.client import confirms_weight_version
from asyncrl.sync.weight_store import WeightStore

log = logging.getLogger(__name__)

STEP = "update_weights_from_disk"
_GONE_PROBE_S = 2.0  # a connect that neither succeeds nor is refused in this long: not known to be gone


class Puller:
    """Bring one engine to the store's latest version by ``/update_weights_from_disk`` (see module contract)."""

    def __init__(self, store: WeightStore, *, initial_path: str, timeout_s: float):
        self.store, self.initial_path, self.timeout_s = store, initial_path, timeout_s
        self.num_pulls = 0
        self.pull_s = 0.0
        """Seconds spent pulling since the last ``take_metrics``."""
        self.last_materialize_s = 0.0
        """Of the last pull, the seconds making its directory (0 when the latest version was materialized already)."""
        self.num_fallbacks = 0
        """Syncs finished by pulling after their broadcast failed (``EngineRecovery.pull_instead``)."""
        self.on_pull: Optional[Callable[[str], None]] = None
        """Called with the engine's URL after each pull (see module contract)."""

    def source(self) -> tuple[int, Path]:
        """The version to pull and the directory that holds it (materialized from the store, verified)."""
        v = self.store.latest()
        if v is None:
            return 0, Path(self.initial_path)
        return v, self.store.materialize(v)

    def pull(self, url: str) -> tuple[int, float]:
        """Load the latest version into the engine at ``url``; its version and the seconds it took."""
        t0 = time.perf_counter()
        version, path = self.source()
        self.last_materialize_s = time.perf_counter() - t0
        v = str(version)
        body = {
            "model_path": str(path),
            "load_format": "safetensors",
            "weight_version": v,
            "abort_all_requests": False,
            "flush_cache": True,
        }
        out = post_json(url, "/update_weights_from_disk", body, timeout_s=self.timeout_s, step=STEP)
        if not confirms_weight_version(out, v):
            got = get_json(url, "/model_info", timeout_s=self.timeout_s, step="model_info").get("weight_version")
            if str(got) != v:
                raise EngineStepError([url], STEP, f"/model_info.weight_version is {got!r}, not {v!r}, after the pull")
        took = time.perf_counter() - t0
        if self.on_pull is not None:
            self.on_pull(url)
        self.num_pulls += 1
        self.pull_s += took
        log.info(
            "engine %s caught up by pulling version %s from %s in %.3f s (%.3f s materializing it)",
            url,
            v,
            path,
            took,
            self.last_materialize_s,
        )
        return version, took

    def take_metrics(self) -> dict[str, float]:
        """Since the last call: ``time/sync_catchup`` (seconds pulling), ``time/sync_store`` and ``sync/store_bytes``
        (the store's writes); ``sync/catchup_pulls`` and ``sync/fallback_pulls`` count from the start."""
        put_s, put_bytes = self.store.take_put_figures()
        m = {
            "sync/catchup_pulls": float(self.num_pulls),
            "sync/fallback_pulls": float(self.num_fallbacks),
            "time/sync_catchup": self.pull_s,
            "time/sync_store": put_s,
            "sync/store_bytes": float(put_bytes),
        }
        self.pull_s = 0.0
        return m


def gone(url: str, *, timeout_s: float = _GONE_PROBE_S) -> bool:
    """True when the engine's port refuses connections (nothing listens: its process is gone); False when it accepts
    one, or when the connect neither succeeds nor is refused within ``timeout_s`` (a hung host is not known gone)."""
    u = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((u.hostname, u.port or 80), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
