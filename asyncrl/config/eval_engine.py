"""The dedicated eval fleet's size and engine settings, derived from the config. Pure.

- ``fleet_size``: ``eval.eval_num_gpus / eval.eval_num_gpus_per_engine`` engines (must divide; 0 without a fleet).
- Engine settings: inherited from the rollout engines (``rollout.*`` and ``rollout.sglang.*``, ``extra_args``
  parsed as ``--flag value`` / ``--flag``), TP = ``eval.eval_num_gpus_per_engine``; when it differs from
  ``rollout.tensor_parallel_size``, ``dp_size``, ``pp_size``, ``ep_size`` and ``attn_cp_size`` are 1 instead
  of inherited (SGLang ties them to TP). ``eval.eval_sglang = { field = "value" }`` overrides single fields
  (``"false"`` turns an inherited boolean flag off; ``no_<flag> = "true"`` too); ``tp_size`` cannot be
  overridden there.
- ``eval_engine_config``: the ``Config`` a fleet engine is launched from (``rollout`` replaced). Validation
  calls it so a bad override fails before any process starts; ``asyncrl.eval.fleet`` runs the fleet.

    n = fleet_size(cfg.eval)
    ecfg = eval_engine_config(cfg)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from asyncrl.config.schema import Config, ConfigError

TP_TIED = ("dp_size", "pp_size", "ep_size", "attn_cp_size")
"""SGLang settings tied to TP: 1 (not inherited) when the fleet's TP differs from the rollout's."""
Value = Union[str, bool]


def fleet_size(e: Any) -> int:
    """Engines of the fleet (``EvalConfig``); 0 without one."""
    if not e.eval_num_gpus:
        return 0
    if e.eval_num_gpus % e.eval_num_gpus_per_engine:
        raise ConfigError(
            f"eval.eval_num_gpus_per_engine: {e.eval_num_gpus_per_engine} does not divide eval.eval_num_gpus = "
            f"{e.eval_num_gpus}; each fleet engine takes eval_num_gpus_per_engine devices"
        )
    return e.eval_num_gpus // e.eval_num_gpus_per_engine


def _key(k: str) -> str:
    return k.strip().lstrip("-").replace("-", "_").removeprefix("sglang_")


def parse_flags(args: list[str]) -> dict[str, Value]:
    """``["--foo-bar", "3", "--baz"]`` -> ``{"foo_bar": "3", "baz": True}`` (``--no-x`` -> ``x: False``)."""
    out: dict[str, Value] = {}
    i = 0
    while i < len(args):
        a = str(args[i])
        if not a.startswith("--"):
            raise ConfigError(f"rollout.sglang.extra_args: expected a --flag at {a!r} (in {args!r})")
        if "=" in a:
            k, v = a.split("=", 1)
            out[_key(k)] = v
            i += 1
            continue
        if i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
            out[_key(a)] = str(args[i + 1])
            i += 2
            continue
        k = _key(a)
        if k.startswith("no_"):
            out[k[3:]] = False
        else:
            out[k] = True
        i += 1
    return out


def render_flags(settings: dict[str, Value]) -> list[str]:
    """The inverse of ``parse_flags`` (False flags are left out)."""
    out: list[str] = []
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return out


def _override_value(v: Any) -> Value:
    if isinstance(v, bool):
        return v
    s = str(v)
    return {"true": True, "false": False}.get(s.lower(), s)


def resolve_eval_sglang(
    inherited: dict[str, Value], *, rollout_tp: int, eval_tp: int, overrides: dict[str, Any]
) -> dict[str, Value]:
    """The fleet's engine settings: ``inherited`` (the rollout engines', without ``tp_size``), the TP-tied
    fields reset to 1 when ``eval_tp != rollout_tp``, then ``overrides`` (``eval.eval_sglang``) field by
    field; ``tp_size`` = ``eval_tp``."""
    out = {_key(k): v for k, v in inherited.items()}
    out.pop("tp_size", None)
    if eval_tp != rollout_tp:
        for k in TP_TIED:
            if k in out:
                out[k] = "1"
    for k, v in overrides.items():
        kk = _key(k)
        if kk in ("tp_size", "tensor_parallel_size"):
            raise ConfigError(
                f"eval.eval_sglang.{k}: the fleet's TP is eval.eval_num_gpus_per_engine "
                f"(it also places the engines); set that instead"
            )
        val = _override_value(v)
        if kk.startswith("no_") and val is True:
            kk, val = kk[3:], False
        out[kk] = val
    out["tp_size"] = str(eval_tp)
    return out


def rollout_engine_settings(cfg: Config) -> dict[str, Value]:
    """The rollout engines' settings as SGLang fields (what the fleet inherits)."""
    r = cfg.rollout
    return {
        "mem_fraction_static": str(r.sglang.mem_fraction_static),
        "max_running_requests": str(r.max_running_requests),
        **parse_flags(list(r.sglang.extra_args)),
    }


def eval_engine_settings(cfg: Config) -> dict[str, Value]:
    return resolve_eval_sglang(
        rollout_engine_settings(cfg),
        rollout_tp=cfg.rollout.tensor_parallel_size,
        eval_tp=cfg.eval.eval_num_gpus_per_engine,
        overrides=dict(cfg.eval.eval_sglang),
    )


def eval_engine_config(cfg: Config) -> Config:
    """``cfg`` with ``rollout`` replaced by the fleet engines' settings (what the command builders read)."""
    s = dict(eval_engine_settings(cfg))
    tp = int(s.pop("tp_size"))
    try:
        mem = float(s.pop("mem_fraction_static"))
        mrr = int(s.pop("max_running_requests"))
    except ValueError as e:
        raise ConfigError(f"eval.eval_sglang: {e}") from None
    r = cfg.rollout
    sg = dataclasses.replace(r.sglang, mem_fraction_static=mem, extra_args=render_flags(s))
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(r, tensor_parallel_size=tp, max_running_requests=mrr, sglang=sg)
    )
