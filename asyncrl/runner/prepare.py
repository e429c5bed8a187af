"""Preparation of the embedded default (data, tokenizer, tiny checkpoint, warm start), cached.

Runs on global rank 0 before any role starts, only when ``prepare.enabled``; every artefact is
made only if missing, so a second run starts at once.
"""

from __future__ import annotations

import logging

log = logging.getLogger("asyncrl.prepare")


def prepare_if_needed(cfg) -> None:
    if not cfg.prepare.enabled:
        return
    raise NotImplementedError("prepare.enabled: the embedded default's preparation is not built yet")
