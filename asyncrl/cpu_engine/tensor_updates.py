"""The CPU engine's ``/update_weights_from_tensor``, as SGLang 0.5.23 answers it.

Contract (SGLang: ``managers/scheduler_components/weight_updater.py`` and ``model_runner_components/
weight_updater.py``)
- Only inside a weight-update session (``/begin_weight_update``; the caller checks). The body is SGLang's
  ``UpdateWeightsFromTensorReqInput``: ``serialized_named_tensors`` (one base64 entry per TP rank; the CPU engine is
  rank 0 and reads entry 0), ``load_format``, ``flush_cache`` (default true), ``weight_version``,
  ``abort_all_requests`` (the HTTP side aborts first), ``selector``, ``torch_empty_cache``.
- ``load_format``: null or ``"direct"`` -> the model's own loader (a name it does not know is skipped with a
  warning, as SGLang's loaders do); a value registered with ``--custom-weight-loader`` -> that function, imported
  by its dotted path, called as ``loader(model, named_tensors)`` on the engine thread (never mid-forward).
  Its return value is ignored and the answer is ``"Success"``, as SGLang's.
- Answers: ``(True, "Success" + the weight-version note)``; a failed flush fails the call after the load (SGLang's
  text). Where SGLang's scheduler would die (an unknown ``load_format`` raises ``NotImplementedError``, an
  unreadable payload or a loader that raises propagates out of its event loop) the CPU engine answers 400 naming
  the cause instead (docs/sglang_differences.md).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from asyncrl.cluster.tensor_payload import PayloadError, deserialize_named_tensors
from asyncrl.cpu_engine.http_shapes import weight_version_field
from asyncrl.cpu_engine.model import CausalLM
from asyncrl.cpu_engine.sampling_params import RequestError, check_bool
from asyncrl.engine.client import weight_version_note

log = logging.getLogger("asyncrl.cpu_engine")


def import_loader(path: str) -> Callable[[Any, list], Any]:
    """SGLang's ``dynamic_import``: ``"module.func"`` -> the function."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError("func_path should contain both module name and func name (such as 'module.func')")
    return getattr(importlib.import_module(module), name)


def _own_loader(model: CausalLM, named: list) -> None:
    known = [(n, t) for n, t in named if n in model.params or model.skips(n)]
    for n, _ in named:
        if n not in model.params and not model.skips(n):
            log.warning("Parameter %s not found in params_dict: skipped", n)
    model.load_weights(known)


def update_from_tensor(
    model: CausalLM,
    body: dict,
    *,
    call: Callable[[Callable[[Any], Any]], Any],
    loaders: tuple[str, ...],
    flush_refused: str,
) -> tuple[bool, str, dict]:
    """One ``/update_weights_from_tensor`` (see module contract); ``call(fn)`` runs ``fn(scheduler)`` on the engine
    thread. Returns SGLang's ``(success, message, extra)``."""
    try:
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise RequestError("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
        flush = check_bool(body.get("flush_cache", True), "flush_cache")
        version = weight_version_field(body.get("weight_version"), "weight_version")
        fmt = body.get("load_format")
        if fmt in (None, "direct"):
            loader: Callable[[Any, list], Any] = _own_loader
        elif fmt in loaders:
            loader = import_loader(fmt)
        else:
            raise RequestError(f"Unknown load_format={fmt!r:.120} (not in --custom-weight-loader {list(loaders)})")
        named = deserialize_named_tensors(entries[0])
    except (RequestError, PayloadError, ImportError, AttributeError, ValueError) as e:
        return False, f"update_weights_from_tensor: {e}", {}

    def apply(s) -> tuple[bool, str]:
        try:
            loader(model, named)
        except (KeyError, ValueError, RuntimeError) as e:  # SGLang's scheduler would die here
            log.error("update_weights_from_tensor: load_format=%s failed: %s", fmt, e)
            return False, f"update_weights_from_tensor: load_format={fmt!r} failed: {e}"
        if flush and not s.flush_cache():
            return False, flush_refused
        msg = "Success"
        if version is not None:
            s.weight_version = version
            msg += weight_version_note(version)
        return True, msg

    ok, msg = call(apply)
    return ok, msg, {}
