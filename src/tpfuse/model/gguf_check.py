"""A GGUF file's container checked before the gguf package parses it: every count and length of the
header, the metadata and the tensor table against the bytes the file has.

The gguf package trusts them: a corrupted array length makes it build one Python object per claimed
element until it runs off the end of the file, which for a large file is gigabytes and minutes before
any error. This walk allocates nothing per element and refuses such a file at once. Layout (GGUF v2
and v3, little- or big-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry a key (u64 length + bytes), a value type u32 and the value (an array: item type u32,
count u64, items); each tensor a name, a dimension count u32, that many u64 dimensions, a type u32 and
an offset u64.
"""

from __future__ import annotations

import mmap
import os
import struct

# metadata value type -> its size in bytes; STRING (8) and ARRAY (9) have variable sizes
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


class Damaged(ValueError):
    """The file's container is inconsistent: what and where."""


class _Cursor:
    def __init__(self, data, size: int, order: str = "<"):
        self.data, self.size, self.offset, self.order = data, size, 0, order

    def take(self, nbytes: int, what: str) -> int:
        """The offset of the next nbytes, which must lie inside the file; moves past them."""
        if nbytes < 0 or self.offset + nbytes > self.size:
            raise Damaged(f"{what} at byte {self.offset} claims {nbytes} bytes, past the end of the file")
        start = self.offset
        self.offset += nbytes
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from(self.order + "I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from(self.order + "Q", self.data, self.take(8, what))[0]

    def string(self, what: str) -> None:
        self.take(self.u64(what), what)


def _value(cursor: _Cursor, kind: int, what: str) -> None:
    if kind in _FIXED_SIZES:
        cursor.take(_FIXED_SIZES[kind], what)
    elif kind == _STRING:
        cursor.string(what)
    elif kind == _ARRAY:
        item, count = cursor.u32(what), cursor.u64(what)
        if item in _FIXED_SIZES:
            cursor.take(count * _FIXED_SIZES[item], f"{what} ({count} items)")
        elif item == _STRING:
            if count * 8 > cursor.size - cursor.offset:  # each string has at least its u64 length
                raise Damaged(f"{what} claims {count} strings, more than the file's bytes can hold")
            for _ in range(count):
                cursor.string(what)
        else:  # nested arrays do not occur in model files
            raise Damaged(f"{what} is an array of value type {item}, which GGUF does not define here")
    else:
        raise Damaged(f"{what} has value type {kind}, which GGUF does not define")


def check_container(path: str) -> None:
    """Raises Damaged naming the first count or length that runs past the end of the file, or a value
    type GGUF does not define; returns when the header, metadata and tensor table fit (the tensor
    data's own extents are left to the gguf package, which checks them without per-element work)."""
    size = os.path.getsize(path)
    if size < 24:
        raise Damaged(f"the file has {size} bytes, fewer than a GGUF header's 24")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        order = "<" if struct.unpack_from("<I", data, 4)[0] in (2, 3) else ">"  # big-endian files exist
        cursor = _Cursor(data, size, order)
        cursor.take(4, "magic")
        version = cursor.u32("version")
        if version not in (2, 3):
            raise Damaged(f"GGUF version {version}; tpfuse reads versions 2 and 3")
        tensors, entries = cursor.u64("the tensor count"), cursor.u64("the metadata count")
        if entries * 12 > size or tensors * 24 > size:  # the least bytes an entry or a tensor takes
            raise Damaged(f"the header claims {entries} metadata entries and {tensors} tensors; too many")
        for i in range(entries):
            cursor.string(f"metadata entry {i}'s key")
            _value(cursor, cursor.u32(f"metadata entry {i}'s type"), f"metadata entry {i}")
        for i in range(tensors):
            cursor.string(f"tensor {i}'s name")
            dims = cursor.u32(f"tensor {i}'s dimension count")
            if dims > _MAX_DIMS:
                raise Damaged(f"tensor {i} claims {dims} dimensions")
            cursor.take(8 * dims + 4 + 8, f"tensor {i}'s shape, type and offset")
