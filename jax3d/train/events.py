"""TensorBoard scalar event files, written directly.

An event file is a sequence of TFRecords, each holding one serialized `Event` protocol buffer. A run logs
only scalars, so the few protobuf fields it needs are encoded here by hand. Writing them through a
TensorBoard package instead would import torch in every run where torch is installed (about 2 s).

TFRecord framing: uint64 length, uint32 masked CRC-32C of the length, the data, uint32 masked CRC-32C of
the data; all little-endian. Event fields: wall_time (1, double), step (2, int64), file_version (3,
string) or summary (5). Summary: repeated value (1). Summary.Value: tag (1, string), simple_value (2,
float).
"""
from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, bit-reversed
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 is its two's complement, as protobuf encodes it
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_FLOAT32_MAX = 3.4028234663852886e38


def _float32(value) -> bytes:
    """`value` as a little-endian float32, saturating to +-inf past float32's range as a cast would."""
    v = float(value)
    if abs(v) > _FLOAT32_MAX and not math.isnan(v):
        v = math.copysign(math.inf, v)
    return struct.pack("<f", v)


def event(wall_time: float, step: int, *, file_version: str = "", scalars: dict | None = None) -> bytes:
    """One serialized Event: a file-version header, or a summary of {tag: value} scalars."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version:
        return out + _bytes_field(3, file_version.encode())
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + _float32(value))
        for tag, value in (scalars or {}).items())
    return out + _bytes_field(5, values)


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


_files_opened = itertools.count()


class EventFile:
    """Writes scalar summaries to a new `events.out.tfevents.<time>.<host>.<pid>.<n>` file in `log_dir`
    (the process id and a counter keep two writers started in the same second apart)."""

    def __init__(self, log_dir: str):
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_files_opened)}"
        self._file = open(os.path.join(log_dir, name), "xb")
        self._file.write(record(event(time.time(), 0, file_version="brain.Event:2")))

    def add_scalars(self, scalars: dict, step: int) -> None:
        self._file.write(record(event(time.time(), step, scalars=scalars)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
