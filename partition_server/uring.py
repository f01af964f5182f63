"""Many fsyncs in one system call, through Linux io_uring, without threads.

The durability barrier (partition_server/durability.py) makes logs durable with fsync.
On threads, each fsync is a Python thread that must take the GIL back after its system
call, and every hand-off makes the event loop's thread wait. Here the event loop writes
one submission entry per fsync into the ring's shared memory (`queue_fsync`) and makes
one non-blocking `io_uring_enter` (`submit`) for all it queued in a turn; the kernel
runs them at once on its own workers and signals an eventfd (`register_eventfd`) as
each completes, and the loop reads the results from the ring's shared memory
(`completions`). No thread of ours waits, so none takes the GIL.

Pure ctypes, mmap and struct (the kernel ABI of linux/io_uring.h); no dependency. A
ring is used by one thread at a time (its event loop's: the barrier's LoopRing).
`Ring.open()` returns None where io_uring cannot be used: not Linux, a kernel without
it, `kernel.io_uring_disabled`, or a seccomp profile that refuses it (Docker's and
containerd's default profiles do), and the barrier then keeps its threads.

Completions the kernel could not post into the completion ring wait on its overflow
list (the kernel then sets IORING_SQ_CQ_OVERFLOW; every later completion queues behind
them, to keep their order) until an `io_uring_enter` with IORING_ENTER_GETEVENTS
flushes them into the ring, as liburing does before it reads (`cq_ring_needs_flush`).
`completions` does that whenever the flag is up. Without it, a fsync that overflowed
once (seen on kernel 6.18 with fewer completions out than the ring holds) left every
later one unread, and the partitions waiting on them hung. A kernel that drops
completions (the ring's overflow counter grows; kernels before IORING_FEAT_NODROP)
fails the ring: those fsyncs' outcomes are unknown.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform
import struct

# linux/io_uring.h
_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427  # the same on every architecture
_REGISTER_EVENTFD = 4
_FEAT_SINGLE_MMAP = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_FSYNC = 3
_ENTER_GETEVENTS = 1
_SQ_CQ_OVERFLOW = 1 << 1  # sq_ring flag: completions wait on the overflow list
_MOST_FLUSHES = 8  # per look at the completions
_SQE_ASYNC = 1 << 4  # IOSQE_ASYNC: straight to the kernel's workers (an fsync blocks)
# struct io_uring_params: 10 u32 (sq_entries, cq_entries, flags, sq_thread_cpu,
# sq_thread_idle, features, wq_fd, resv[3]), then io_sqring_offsets (head, tail,
# ring_mask, ring_entries, flags, dropped, array, resv1: u32; user_addr: u64) and
# io_cqring_offsets (head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1:
# u32; user_addr: u64).
_PARAMS = struct.Struct("<10I8IQ8IQ")
_SQE = struct.Struct("<BBHiQQIIQ24x")  # opcode, flags, ioprio, fd, off, addr, len,
# fsync_flags, user_data; the rest zero (64 bytes)
_CQE = struct.Struct("<QiI")  # user_data, res, flags (16 bytes)
_U32 = struct.Struct("<I")
ENTRIES = 64  # submission entries: the most fsyncs in flight on one ring (more wait)


class Ring:
    """One io_uring instance for fsyncs (ENTRIES submission entries, twice as many
    completion entries: at most `entries` fsyncs may be in flight at once)."""

    def __init__(self, fd: int, entries: int, sq_off: tuple, cq_off: tuple,
                 memory: mmap.mmap, cq_memory: mmap.mmap, sqes: mmap.mmap, enter,
                 register) -> None:
        self._fd, self._enter, self._register = fd, enter, register
        self._sq, self._cq, self._sqes = memory, cq_memory, sqes
        self._sq_head, self._sq_tail, sq_mask_at, _, self._sq_flags, _, self._sq_array = \
            sq_off[:7]
        self._cq_head, self._cq_tail, cq_mask_at, _, self._cq_overflow, self._cqes = cq_off[:6]
        self._sq_mask = _U32.unpack_from(memory, sq_mask_at)[0]
        self._cq_mask = _U32.unpack_from(cq_memory, cq_mask_at)[0]
        self._tail = _U32.unpack_from(memory, self._sq_tail)[0]
        self._queued = 0  # entries written but not yet taken by the kernel
        self.entries = entries
        self.closed = False
        self.calls = 0  # io_uring_enter calls made (a metric)
        self.flushes = 0  # of them, to flush completions off the kernel's overflow list
        self._dropped = _U32.unpack_from(cq_memory, self._cq_overflow)[0]

    @classmethod
    def open(cls, entries: int = ENTRIES) -> Ring | None:
        """A ring, or None where io_uring is not usable here."""
        if platform.system() != "Linux":
            return None
        try:
            # Every call here is short (nothing waits: submissions never ask for
            # completions), so it is made holding the GIL (a PyDLL function): the event
            # loop does not give the GIL away and wait to get it back.
            syscall = ctypes.PyDLL(ctypes.util.find_library("c"), use_errno=True).syscall
        except (OSError, AttributeError):
            return None
        syscall.restype = ctypes.c_long
        params = ctypes.create_string_buffer(_PARAMS.size)
        fd = syscall(ctypes.c_long(_SYS_SETUP), ctypes.c_long(entries), params)
        if fd < 0:
            return None  # ENOSYS, EPERM (disabled, seccomp), ENOMEM: keep the threads
        try:
            values = _PARAMS.unpack(params.raw)
            sq_entries, cq_entries, features = values[0], values[1], values[5]
            sq_off, cq_off = values[10:19], values[19:28]
            sq_size = sq_off[6] + sq_entries * 4
            cq_size = cq_off[5] + cq_entries * _CQE.size
            shared = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            access = mmap.PROT_READ | mmap.PROT_WRITE
            if features & _FEAT_SINGLE_MMAP:
                memory = mmap.mmap(fd, max(sq_size, cq_size), shared, access,
                                   offset=_OFF_SQ_RING)
                cq_memory = memory
            else:
                memory = mmap.mmap(fd, sq_size, shared, access, offset=_OFF_SQ_RING)
                cq_memory = mmap.mmap(fd, cq_size, shared, access, offset=_OFF_CQ_RING)
            sqes = mmap.mmap(fd, sq_entries * _SQE.size, shared, access, offset=_OFF_SQES)
        except (OSError, ValueError):
            os.close(fd)
            return None

        # syscall(2) is variadic and reads every argument as a long: pass longs.
        def enter(to_submit: int, flags: int = 0) -> int:
            done = syscall(ctypes.c_long(_SYS_ENTER), ctypes.c_long(fd),
                           ctypes.c_long(to_submit), ctypes.c_long(0), ctypes.c_long(flags),
                           None, ctypes.c_long(0))
            return done if done >= 0 else -ctypes.get_errno()

        def register(opcode: int, argument, count: int) -> int:
            done = syscall(ctypes.c_long(_SYS_REGISTER), ctypes.c_long(fd),
                           ctypes.c_long(opcode), argument, ctypes.c_long(count))
            return done if done >= 0 else -ctypes.get_errno()

        return cls(fd, min(sq_entries, cq_entries), sq_off, cq_off, memory, cq_memory, sqes,
                   enter, register)

    def register_eventfd(self, efd: int) -> None:
        """Have the kernel signal eventfd `efd` whenever it posts a completion."""
        value = ctypes.c_int(efd)
        done = self._register(_REGISTER_EVENTFD, ctypes.byref(value), 1)
        if done < 0:
            raise OSError(-done, f"io_uring_register(EVENTFD): {os.strerror(-done)}")

    def queue_fsync(self, fd: int, user_data: int) -> None:
        """Write an fsync of `fd`'s submission entry (the next submit submits it); its
        completion carries `user_data`. The caller keeps at most `entries` fsyncs queued
        or in flight."""
        tail = self._tail
        slot = tail & self._sq_mask
        _SQE.pack_into(self._sqes, slot * _SQE.size, _OP_FSYNC, _SQE_ASYNC, 0, fd, 0, 0, 0, 0,
                       user_data)
        _U32.pack_into(self._sq, self._sq_array + slot * 4, slot)
        self._tail = (tail + 1) & 0xFFFFFFFF
        self._queued += 1

    def submit(self) -> list[tuple[int, int]]:
        """Submit every queued entry without waiting for any; returns the completions
        posted meanwhile (as `completions`). Raises OSError when the ring itself fails
        (then nothing it holds is known to be done)."""
        # The entries are written before the tail that publishes them; the kernel reads
        # them only inside io_uring_enter (no SQPOLL), a full barrier after these stores.
        _U32.pack_into(self._sq, self._sq_tail, self._tail)
        taken: list[tuple[int, int]] = []
        busy = 0
        while self._queued:
            done = self._enter(self._queued)
            self.calls += 1
            if done == -errno.EINTR:
                continue
            if done == -errno.EBUSY and busy < _MOST_FLUSHES:
                # Kernels that refuse submissions while completions wait on the overflow
                # list: take those first.
                busy += 1
                taken += self.completions()
                continue
            if done < 0:
                raise OSError(-done, f"io_uring_enter: {os.strerror(-done)}")
            if done == 0:
                raise OSError(errno.EAGAIN, "io_uring_enter submitted nothing")
            self._queued -= done
        return taken + self.completions()

    def completions(self) -> list[tuple[int, int]]:
        """(user_data, 0 or the errno its fsync failed with) of every completion posted
        since the last look, those waiting on the kernel's overflow list included (module
        doc). Raises OSError when the kernel dropped completions or a flush failed (the
        ring's outcomes are then unknown)."""
        cq, mask = self._cq, self._cq_mask
        done: list[tuple[int, int]] = []
        for _ in range(_MOST_FLUSHES):  # each flush moves up to a ring's worth
            flush = _U32.unpack_from(self._sq, self._sq_flags)[0] & _SQ_CQ_OVERFLOW
            if flush:
                self._flush()
            head = _U32.unpack_from(cq, self._cq_head)[0]
            tail = _U32.unpack_from(cq, self._cq_tail)[0]  # x86-64 and arm64 order this
            while head != tail:  # load before the entries' below (written before it)
                user_data, res, _flags = _CQE.unpack_from(
                    cq, self._cqes + (head & mask) * _CQE.size)
                done.append((user_data, -res if res < 0 else 0))
                head = (head + 1) & 0xFFFFFFFF
            _U32.pack_into(cq, self._cq_head, head)
            dropped = _U32.unpack_from(cq, self._cq_overflow)[0]
            if dropped != self._dropped:
                self._dropped = dropped
                raise OSError(errno.EIO, "io_uring dropped completions (its completion ring "
                              "overflowed on a kernel that drops them)")
            if not flush:
                break
        return done  # what is still on the list: the next look (LoopRing looks every WATCH_S)

    def _flush(self) -> None:
        """io_uring_enter(GETEVENTS) without waiting: the kernel moves what it can of its
        overflow list into the completion ring."""
        while True:
            done = self._enter(0, _ENTER_GETEVENTS)
            self.calls += 1
            self.flushes += 1
            if done != -errno.EINTR:
                break
        if done < 0 and done != -errno.EBUSY:  # EBUSY: the ring is full; reading drains it
            raise OSError(-done, f"io_uring_enter(GETEVENTS): {os.strerror(-done)}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for memory in {id(m): m for m in (self._sq, self._cq, self._sqes)}.values():
                memory.close()
            os.close(self._fd)
