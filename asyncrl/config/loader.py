"""TOML -> typed frozen dataclasses, with ``key.sub=value`` overrides.

One precedence rule: dataclass defaults -> TOML file -> command-line overrides. Types are checked
against the dataclass annotations; unknown keys fail with a "did you mean" suggestion.

    cfg = load_config("configs/tiny.toml", ["data.rollout_batch_size=4"])
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from asyncrl.config.derive import resolve as derive_defaults
from asyncrl.config.schema import Config, ConfigError
from asyncrl.config.seeds import seed_hint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_NOT_KEYS = {"derived"}  # Config fields that are bookkeeping, never set from TOML


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    if dataclasses.is_dataclass(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tables = [a for a in args if dataclasses.is_dataclass(a)]
        if tables and isinstance(value, dict):  # an optional table: its own errors name the key inside it
            return build_section(tables[0], value, key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of {_type_name(tp)}, got {value!r}")
        kt, vt = typing.get_args(tp)
        return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (et,) = typing.get_args(tp)
        return [_coerce(v, et, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r} ({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):  # TOML and overrides accept inf and nan; no setting means them
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r} ({type(value).__name__})")
        return value
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, key)
    raise AssertionError(f"unsupported annotation {tp!r} at {key}")


def build_section(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a TOML table, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in _NOT_KEYS}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in fields:
            seed = seed_hint(k)
            if seed is not None:  # a seed's spelling: answered with the project's key, not a string-distance guess
                raise ConfigError(f"{key}: unknown key; {seed} (docs/seed_mapping.md)")
            guess = difflib.get_close_matches(k, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{(prefix + '.') if prefix else ''}{guess[0]}'?" if guess else ""
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{key}: unknown key{hint} (known keys here: {known})")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def key_types(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted key (``runner.max_steps``) -> its annotation, sections expanded, in schema order."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in _NOT_KEYS:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        out.update(key_types(tp, key) if dataclasses.is_dataclass(tp) else {key: tp})
    return out


def parse_override_value(raw: str) -> Any:
    """Values are TOML literals (``4``, ``true``, ``"x"``, ``[1, 2]``); bare words are strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides onto the raw TOML dict (before typing)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = [p for p in key.split(".") if p]
        if not parts:
            raise ConfigError(f"override {item!r}: empty key")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: '{p}' is not a table")
        node[parts[-1]] = parse_override_value(raw.strip())
    return data


def load_raw(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None, *, resolve: bool = True) -> Config:
    """Load, type-check, derive defaults (``resolve``). Validation is ``validate.validate``."""
    data = load_raw(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    cfg = build_section(Config, data, "")
    if resolve:
        cfg = derive_defaults(cfg)
    return cfg


def config_from_dict(data: dict, *, resolve: bool = True) -> Config:
    cfg = build_section(Config, data, "")
    if resolve:
        cfg = derive_defaults(cfg)
    return cfg


def to_dict(cfg: Any) -> dict:
    """Dataclass -> plain dict (TOML-able: ``None`` values are omitted)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name in _NOT_KEYS:
            continue
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif v is not None:
            out[f.name] = v
    return out
