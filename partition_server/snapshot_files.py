"""What the partition's snapshot formats (producer state, transaction buffer) share:
the CRC32C seal, the check of the common header start (magic u8[4], version u16,
reserved u16 = 0), and file names that sort by the log offset a snapshot covers."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import crc32c

_TRAILER = struct.Struct("<I")
TMP_SUFFIX = ".tmp"
OFFSET_MAX = (1 << 63) - 1


class SnapshotCorrupt(Exception):
    """A snapshot cannot be trusted; the owner must rebuild by full replay."""


def seal(body: bytes) -> bytes:
    """The snapshot: body, then the CRC32C (Castagnoli) u32 of every byte before it."""
    return body + _TRAILER.pack(crc32c.crc32c(body))


def unseal(data: bytes, header: struct.Struct, magic: bytes, version: int,
           what: str) -> tuple[tuple, memoryview]:
    """(header fields, body without the trailer) of a sealed snapshot whose header
    starts with magic, version, reserved; SnapshotCorrupt if any of it is wrong."""
    if len(data) < header.size + _TRAILER.size:
        raise SnapshotCorrupt(f"snapshot is {len(data)} bytes, shorter than its header")
    fields = header.unpack_from(data, 0)
    if fields[0] != magic:
        raise SnapshotCorrupt(f"not a {what} snapshot (magic {fields[0]!r})")
    body = memoryview(data)[:-_TRAILER.size]
    (stored_crc,) = _TRAILER.unpack_from(data, len(body))
    computed_crc = crc32c.crc32c(body)
    if computed_crc != stored_crc:
        raise SnapshotCorrupt(f"CRC32C mismatch: stored {stored_crc:#010x}, "
                              f"computed {computed_crc:#010x}")
    if fields[1] != version:
        raise SnapshotCorrupt(f"unsupported snapshot version {fields[1]} "
                              f"(this build reads {version})")
    if fields[2] != 0:
        raise SnapshotCorrupt(f"reserved header field is {fields[2]}, not 0")
    return fields, body


class SnapshotFileNames:
    """`<covered offset, 20 digits>.<suffix>`: names sort by the offset covered."""

    def __init__(self, suffix: str):
        self.suffix = suffix
        self._pattern = re.compile(r"^(\d{20})\." + re.escape(suffix) + "$")

    def name(self, covered_offset: int) -> str:
        """File name of a snapshot covering the log below covered_offset."""
        assert 0 <= covered_offset <= OFFSET_MAX, covered_offset
        return f"{covered_offset:020d}.{self.suffix}"

    def parse(self, name: str) -> int | None:
        """covered_offset of a snapshot file name; None for any other name."""
        match = self._pattern.match(name)
        return int(match.group(1)) if match else None


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` durably: a temporary file, fsync, rename, directory fsync
    (a crash leaves the old contents or the new, never a mix)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory(directory: Path) -> None:
    """`mkdir -p`, each directory it creates made durable in its parent (an fsync of the
    parent): a new directory's entry is metadata of its parent, which a power cut may
    lose on file systems without ordered metadata, and with it every file inside."""
    missing = []
    path = Path(directory)
    while not path.exists():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:  # made meanwhile by another: its maker syncs it
            continue
        fsync_directory(path.parent)
