"""Length-prefixed frames on a stream socket: how the CPU engine's two processes (``scheduler_link``, ``scheduler_process``)
cut their byte stream into messages. Pure: no I/O here, the two ends read and write their socket themselves.

    sock.sendall(frame(payload))          # 8-byte little-endian length, then the payload
    reader = FrameReader()
    for payload in reader.feed(sock.recv(1 << 20)):   # every whole frame received so far, in order
        ...

Why not ZeroMQ: the two processes are a parent and its forked child on one host, joined by a ``socketpair``; ZeroMQ
ipc hands every message to an I/O thread at each end (four thread wake-ups a hop, measured 82 us a round trip idle
against 12 us for a socketpair), and a weight sync makes six such hops per engine on its critical path.

A frame longer than ``MAX_FRAME`` raises ``FrameError``: the stream can no longer be cut (only a bug of the writer
gets there, both ends being this code); a payload that does not unpickle is the reader's to skip.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<Q")
MAX_FRAME = 1 << 32
"""Largest payload accepted (4 GiB): far above any message (a step's answers, a weight update's metadata)."""


class FrameError(RuntimeError):
    """The stream cannot be cut into frames any more (a header announces more than ``MAX_FRAME``)."""


def frame(payload: bytes) -> bytes:
    """``payload`` with its header: one write of this is one message at the other end."""
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Cuts the bytes received so far into whole payloads; keeps a partial frame until the rest arrives."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need = 0
        """Bytes the buffer must hold before the frame at its head is whole (0: no header read yet)."""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            if not self._need:
                if len(self._buf) < HEADER.size:
                    return out
                (n,) = HEADER.unpack_from(self._buf)
                if n > MAX_FRAME:
                    raise FrameError(f"a frame header announces {n} bytes (at most {MAX_FRAME}): the stream is corrupt")
                self._need = HEADER.size + n
            if len(self._buf) < self._need:
                return out
            out.append(bytes(self._buf[HEADER.size : self._need]))
            del self._buf[: self._need]
            self._need = 0

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet whole."""
        return len(self._buf)
