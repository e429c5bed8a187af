"""The embedded default (CPU, tests, CI): synthetic data per environment and the supervised warm start
(``warm_start``) that ``prepare.*`` runs before a run (``asyncrl.runner.prepare``); the tiny checkpoint itself is
``asyncrl.models.tiny``.

``DATA_MODULES``: which module makes an environment's data (``agentloop.task_name``): ``synth`` (search-QA over a
made-up knowledge base) for ``searchr1``, and for any environment without data of its own (a user's ``module:attr``
trains on it); ``arith`` (word problems) for ``arith``. A data module has ``write_dataset(out_dir, *, seed, ...)``
(``train.jsonl``, ``test.jsonl``, ``tokenizer_text.txt``) and ``warm_start_demos(cfg, *, data_dir, num_demos)``
(demonstrations ``{"prompt", "segments": [{"text", "generated"}]}``).

    module = data_module(cfg.agentloop.task_name)   # asyncrl.embedded.arith for "arith"
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

DEFAULT_ENV = "searchr1"
DATA_MODULES = {"searchr1": "asyncrl.embedded.synth", "arith": "asyncrl.embedded.arith"}


def data_env(task_name: Optional[str]) -> str:
    """The environment whose data the embedded default makes for ``agentloop.task_name``."""
    return task_name if task_name in DATA_MODULES else DEFAULT_ENV


def data_module(task_name: Optional[str]) -> ModuleType:
    return importlib.import_module(DATA_MODULES[data_env(task_name)])
