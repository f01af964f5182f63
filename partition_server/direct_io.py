"""Appending to a segment file around the page cache (O_DIRECT): how a follower writes
the copies it takes from its leader (docs/replication.md, "Followers write around the page
cache").

A follower's copy is read only if it is promoted (and then once, by the recovery that
rebuilds its state), yet a buffered write puts every byte of it in the page cache: with
factor 3, two thirds of what a cluster writes fill memory that no consumer will read, and
each byte costs the kernel a copy into a freshly allocated page. A direct write hands the
device the bytes from a reused, aligned buffer instead.

O_DIRECT wants the buffer, the file position and the length aligned to the device's block
(BLOCK, 4 KiB: enough for every device we know; the kernel refuses less with EINVAL). So
each append rewrites the segment's last partial block, taken from memory, and pads the
written length with zeros up to a block: **the file may end up to BLOCK - 1 bytes past the
log's end**. The log's in-memory size stays the truth; `DirectAppender.finish` cuts the file
back to it (before a roll seals the segment, before a close, before any other kind of
write), and a crash leaves the zeros to recovery, which cuts them off as a torn tail (they
lie past every flushed offset, so past the recovery point).

Pure mechanics, no policy: `partition_server/log.py` decides when to use it.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

BLOCK = 4096
CHUNK = 1 << 20  # bytes per direct write; one aligned buffer of this size per thread

_buffers = threading.local()


def _buffer() -> memoryview:
    """This thread's aligned buffer (an anonymous mapping is page aligned). One per thread
    rather than per log: followers append on worker threads, so memory stays bounded by
    the thread pool, not by the number of partitions followed."""
    view = getattr(_buffers, "view", None)
    if view is None:
        view = _buffers.view = memoryview(mmap.mmap(-1, CHUNK))
    return view


def supported() -> bool:
    return hasattr(os, "O_DIRECT")


class DirectAppender:
    """Appends to one segment file with O_DIRECT from its current logical `size`. Not
    thread-safe (the log calls it one call at a time), but any thread may call it."""

    def __init__(self, path: Path, size: int, read_fd: int) -> None:
        """`read_fd`: a descriptor of the same file, to read the partial last block from.
        Raises OSError when the file system refuses O_DIRECT (then write buffered)."""
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        try:
            start = size - size % BLOCK
            tail = os.pread(read_fd, size - start, start) if size > start else b""
            if len(tail) != size - start:
                raise OSError(errno.EIO, f"{path}: read {len(tail)} of the last block's "
                                         f"{size - start} bytes")
        except BaseException:
            os.close(self._fd)
            raise
        self._start = start  # file position of the buffer's first byte: block aligned
        self._tail = tail    # the bytes of the partial last block, written already

    @property
    def size(self) -> int:
        return self._start + len(self._tail)

    def write(self, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
        """Append `buffers` at `size`. On OSError the file holds an unknown prefix of them
        (the log fails until reopened, as with a buffered write)."""
        view = _buffer()
        fill = len(self._tail)
        view[:fill] = self._tail
        for data in buffers:
            data = memoryview(data)
            position, length = 0, len(data)
            while position < length:
                count = min(length - position, CHUNK - fill)
                view[fill:fill + count] = data[position:position + count]
                fill += count
                position += count
                if fill == CHUNK:
                    self._pwrite(view, CHUNK)
                    self._start += CHUNK
                    fill = 0
        if fill:
            padded = -(-fill // BLOCK) * BLOCK
            view[fill:padded] = bytes(padded - fill)
            self._pwrite(view, padded)
        whole = fill - fill % BLOCK
        self._tail = bytes(view[whole:fill])
        self._start += whole

    def _pwrite(self, view: memoryview, length: int) -> None:
        done = 0
        while done < length:
            written = os.pwrite(self._fd, view[done:length], self._start + done)
            if written <= 0:
                raise OSError(errno.EIO, f"{self.path}: direct write of {length - done} bytes "
                                         f"at {self._start + done} wrote {written}")
            done += written

    def finish(self, *, cut: bool = True) -> None:
        """Stop: cut the file back to `size` (the zeros padding its last block go) and
        close. cut=False only closes (after a failed write: recovery decides)."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            if cut:
                os.ftruncate(fd, self.size)
        finally:
            os.close(fd)
