"""Every config key is used or removed (issue #14 item 6).

A field of the schema must be read by the code that runs: an attribute read ``<x>.<field>`` in some
module of ``asyncrl/`` outside ``asyncrl/config/`` (which loads, derives, validates and renders the config,
so a read there proves nothing about use). ``ast`` finds the attribute reads; a name read anywhere counts
(section names and field names are not qualified), so this catches keys that nothing reads at all.
The few keys that only the config package consumes on purpose are listed with their reason, and the
list may not go stale: each entry must be a schema field that indeed has no read outside.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from asyncrl.config import schema

PKG = Path(__file__).resolve().parents[2] / "asyncrl"

ONLY_CONFIG_READS = {
    "RolloutBufferConfig.async_data_buffer_capacity_factor": (
        "sets the derived default of rollout_buffer.max_buffered_groups (derive.resolve), which the broker reads"
    ),
    "SGLangConfig.backend_type": "selects a check: only 'server' is implemented, validate() rejects 'engine'",
    "EvalConfig.eval_sglang": (
        "overrides of the eval fleet's engine settings, applied by config/eval_engine.py, whose result the "
        "runner launches the eval engines with"
    ),
}


def attribute_reads(root: Path, *, skip: str = "config") -> set[str]:
    """Names read as attributes (``x.name`` in a load context) in the modules under ``root``, ``root/skip`` excluded."""
    out = set()
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                out.add(node.attr)
    return out


def unread_fields(namespace: dict, reads: set[str]) -> list[str]:
    """``Class.field`` of every config dataclass in ``namespace`` (not ``Config``, the sections) read nowhere."""
    out = []
    for cls in namespace.values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__name__ != "Config":
            out += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if f.name not in reads]
    return sorted(set(out))


def test_every_schema_field_is_read_outside_the_config_package():
    unread = unread_fields(vars(schema), attribute_reads(PKG))
    unexplained = [k for k in unread if k not in ONLY_CONFIG_READS]
    assert not unexplained, (
        f"config keys no code outside asyncrl/config reads: {unexplained}; use them, remove them, or list them "
        f"in ONLY_CONFIG_READS with the reason"
    )
    stale = sorted(set(ONLY_CONFIG_READS) - set(unread))
    assert not stale, f"ONLY_CONFIG_READS lists keys that are read outside asyncrl/config now (or gone): {stale}"


def test_the_scan_sees_an_unread_field_and_a_read_one(tmp_path):
    @dataclasses.dataclass(frozen=True)
    class ProbeConfig:
        read_key: int = 0
        never_read_key: int = 0

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "validate.py").write_text("def f(cfg):\n    return cfg.probe.never_read_key\n")
    (tmp_path / "user.py").write_text("def g(cfg):\n    return cfg.probe.read_key\n")
    reads = attribute_reads(tmp_path)
    assert "read_key" in reads and "never_read_key" not in reads  # a read inside config/ does not count
    assert unread_fields({"ProbeConfig": ProbeConfig}, reads) == ["ProbeConfig.never_read_key"]
