"""Frames between the engine and its grammar-compiling process: an 8-byte length, then a
pickle (both ends are our own code, in one installation)."""
from __future__ import annotations

import pickle
import struct
from typing import BinaryIO


def write_frame(out: BinaryIO, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(struct.pack("<Q", len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO):
    head = inp.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(inp.read(n))
