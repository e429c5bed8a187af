"""Durable writes on a local or shared filesystem: a file's bytes and a directory's entries reach the disk before
the caller goes on (the checkpoint and the weight store publish by rename after these).

    write_durable(path, data)   # write, flush, fsync
    fsync_file(path)            # an already written file
    fsync_dir(path)             # the directory's entries (a rename into it, a new file)
"""

from __future__ import annotations

import os
from pathlib import Path


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
