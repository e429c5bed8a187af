"""The resolved config rendered as TOML (the run directory's ``config.toml``, ``--dry-run``). Pure.

Derived values carry a ``# derived`` comment; dict-typed settings (placement, eval datasets, eval engine
overrides) are written as inline tables so the output loads back with ``load_config`` unchanged.

    text = render_config(load_config("configs/tiny.toml"))
"""

from __future__ import annotations

from asyncrl.config.derive import inflight_start
from asyncrl.config.loader import to_dict
from asyncrl.config.schema import Config


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items())
        return "{ " + items + " }" if items else "{}"
    return repr(v)


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else f'"{k}"'


def render_config(cfg: Config) -> str:
    """The resolved config as TOML; derived values carry a ``# derived`` comment."""
    lines: list[str] = []

    def emit(table: dict, path: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) or k in _INLINE_TABLES}
        subs = {k: v for k, v in table.items() if isinstance(v, dict) and k not in _INLINE_TABLES}
        if path:
            lines.append(f"\n[{path}]")
        for k, v in scalars.items():
            key = f"{path}.{k}" if path else k
            mark = "  # derived" if key in cfg.derived else ""
            if key == "rollout_buffer.max_inflight_groups" and v == "auto":
                mark = (
                    f"  # tuned by the broker: starts at {inflight_start(cfg)}, within [1, "
                    f"{max(1, cfg.rollout_buffer.max_buffered_groups - cfg.data.rollout_batch_size)}]"
                )
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}{mark}")
        for k, v in subs.items():
            emit(v, f"{path}.{k}" if path else k)

    emit(to_dict(cfg), "")
    return "\n".join(lines).lstrip("\n") + "\n"


# dict-typed settings rendered inline rather than as sub-tables
_INLINE_TABLES = {"component_placement", "eval_prompt_data", "eval_sglang"}
