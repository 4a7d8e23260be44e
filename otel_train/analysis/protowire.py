"""Protobuf wire primitives shared by the Perfetto export and its profiler merge (no protobuf library:
the fields are few and the export builds thousands of packets from columns; docs/export.md).

Field numbers live with the module that writes each message; here are only the encodings and the
Perfetto track-uuid scheme both writers must agree on.
"""

from __future__ import annotations

WT_VARINT, WT_I64, WT_LEN = 0, 1, 2
UUID_STRIDE = 1 << 24
"""Each process's tracks get uuids ``pid * UUID_STRIDE + k``: the process track is k = 0."""


def varint(n: int) -> bytes:
    """Base-128 varint; negative numbers as their 64-bit two's complement (protobuf int64)."""
    if n < 0:
        n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def uint_field(field: int, value: int) -> bytes:
    """A varint field (uint64, int64, int32, bool, enum)."""
    return key(field, WT_VARINT) + varint(value)


def bytes_field(field: int, value: bytes) -> bytes:
    """A length-delimited field (bytes, string, embedded message)."""
    return key(field, WT_LEN) + varint(len(value)) + value


def str_field(field: int, value: str) -> bytes:
    """A string field."""
    return bytes_field(field, value.encode("utf-8", "replace"))


def process_uuid(pid: int) -> int:
    """The uuid of the (synthetic) process ``pid``'s track."""
    return pid * UUID_STRIDE
