"""A wandb run read back from its local files: the offline run directory's ``run-<id>.wandb``.

wandb 0.31 has no Python reader of that file (its ``DataStore`` went with the Go core), so this is one, of the
format its writer uses (LevelDB's log format): a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each ``crc32 (4 bytes, of the type byte then the data), length (2), type (1: full, 2: first,
3: middle, 4: last)`` and the data; a block's tail shorter than a chunk header is padding. The chunks of one record
joined are a ``wandb.proto.wandb_internal_pb2.Record``. Every checksum is checked.

    recs = read_records(run_file(run_dir))
    history(recs)  # [{"step": 1, "reward/mean": 0.25, ...}, ...]   one dict a logged record, wandb's "_" keys left out
    config(recs)   # the run's config: {"runner": {...}, ...}
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(run_dir: Path) -> list[Path]:
    """The ``.wandb`` files of every offline wandb run under ``<run_dir>/wandb``, oldest first."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"))


def _chunks(data: bytes):
    pos = HEADER.size
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # padding at a block's end
            pos += left
            continue
        crc, n, kind = CHUNK.unpack_from(data, pos)
        if (crc, n, kind) == (0, 0, 0):  # a zero-filled block tail
            pos += left
            continue
        payload = data[pos + CHUNK.size : pos + CHUNK.size + n]
        assert len(payload) == n, f"chunk at {pos} cut short"
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"bad checksum of the chunk at {pos}"
        yield kind, payload
        pos += CHUNK.size + n


def read_records(path: Path) -> list:
    """Every record of a ``.wandb`` file, in the order written."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, parts = [], []
    for kind, payload in _chunks(data):
        parts.append(payload)
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
        else:
            assert kind in (FIRST, MIDDLE), f"unknown chunk type {kind}"
    assert not parts, "the file ends inside a record"
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(records: list) -> list[dict]:
    """The logged records (``run.log`` calls), each as {name: value}; wandb's own keys (``_step``, ...) left out."""
    return [
        {_key(i): json.loads(i.value_json) for i in r.history.item if not _key(i).startswith("_")}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def config(records: list) -> dict:
    """The run's config (the run record's, then every later config update), wandb's ``_wandb`` left out."""
    out: dict = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        out.update({_key(i): json.loads(i.value_json) for i in items})
    out.pop("_wandb", None)
    return out


def metric_axes(records: list) -> dict[str, str]:
    """``define_metric`` calls: metric name or glob -> the step metric it is plotted against ("" for none)."""
    return {
        r.metric.name or r.metric.glob_name: r.metric.step_metric
        for r in records
        if r.WhichOneof("record_type") == "metric"
    }
