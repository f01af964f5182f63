"""Disks that lose power: a server's data directory on an ext4 filesystem of its own, on a
loop device whose backing image is the "disk". A power cut keeps what reached the device
(every fsync's data: ext4 and the loop driver write it there before the fsync returns)
and loses what only the page cache held (writes never fsynced, renames and creations whose
directory was never fsynced), as a machine that loses power does. A `kill -9` alone loses
nothing the page cache holds, so it cannot show a durability promise broken.

The cut (`LoopDisk.cut`, after the server was killed): a copy of the image as it is now
(the device's contents), attached and checked with `e2fsck -p` (what a machine runs at
boot: it replays the journal); the old filesystem unmounted lazily (the page cache it
still holds is written into the old image, which is thrown away), and the copy mounted
where the old one was.

A cut may also tear the writes that were on their way (`tear`, a seeded random source):
power fails while the kernel writes a file's unsynced tail back, and the device keeps
part of it. Before the old filesystem goes, each file whose tail the cut lost may get
(each with even odds) the first sectors of that tail back (512 bytes at a time, a random
number of them), the last of them zeros half the time (a sector the device never wrote).
A server must cut such a tail, as it cuts any torn write, and never take it for data.

Needs root, `losetup`, `mkfs.ext4`, `e2fsck` and loop devices (`available`). The images
live on a tmpfs (/dev/shm) when there is one, so a cut's copy takes a fraction of a second.
What a cut may also keep: dirty pages the kernel happened to write back between the kill
and the copy (a power cut a moment later), and, should a write-back run during the copy,
a mix of before and after in blocks nobody fsynced (as a power cut during a write-back).
The filesystem is mounted with `noauto_da_alloc`: ext4 otherwise flushes a file's data
when a rename replaces it, a courtesy other filesystems do not give, which would hide a
missing fsync before a rename.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

MOUNT_OPTIONS = "noauto_da_alloc"
TOOLS = ("losetup", "mkfs.ext4", "e2fsck", "mount", "umount", "cp")
SHM = Path("/dev/shm")
SECTOR = 512


def available() -> str | None:
    """Why disks that lose power cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (loop devices and mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control)"
    return None


def images_dir(run_name: str, fallback: Path) -> Path:
    """Where a run's disk images go: a tmpfs if there is one (fast copies), else
    `fallback`."""
    base = SHM / "atomlog-chaos" if SHM.is_dir() else fallback
    return base / run_name


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _must(*command: str) -> str:
    result = _run(*command)
    if result.returncode != 0:
        raise OSError(f"{' '.join(command)}: exit {result.returncode}: "
                      f"{(result.stderr or result.stdout).strip()}")
    return result.stdout.strip()


@dataclass
class LoopDisk:
    image: Path            # the backing file: the disk's contents
    mount: Path            # where its filesystem is mounted (a server's data directory)
    size: int              # bytes (the image is sparse)
    device: str = ""       # /dev/loopN while attached

    def create(self) -> None:
        """A new filesystem on a new image, mounted at `mount` (made if missing)."""
        self.image.parent.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as image:
            image.truncate(self.size)
        _must("mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=1", str(self.image))
        self._attach_and_mount()

    def _attach_and_mount(self) -> None:
        self.device = _must("losetup", "-f", "--show", str(self.image))
        try:
            _must("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, self.device, str(self.mount))
        except OSError:
            _run("losetup", "-d", self.device)
            self.device = ""
            raise

    def snapshot(self) -> Path:
        """A copy of the image as the device holds it now (the first step of a cut: take
        every disk's copy right after the kills, before any is swapped)."""
        copy = self.image.with_name(self.image.name + ".cut")
        _must("cp", "--sparse=always", str(self.image), str(copy))
        return copy

    def cut(self, copy: Path | None = None, tear: random.Random | None = None) -> str:
        """Lose power: the filesystem now holds what its device held at `snapshot` (taken
        now if not given), and with `tear` some lost tails' first sectors (module doc).
        Whoever used it must be dead already. Returns what the boot check said
        (`e2fsck -p`: "clean", or its exit code and output) and how many tails were torn;
        a check that fails (exit 4 or more: a boot would stop) raises, the old
        filesystem left in place."""
        copy = copy if copy is not None else self.snapshot()
        device = _must("losetup", "-f", "--show", str(copy))
        check = _run("e2fsck", "-p", device)
        said = ("clean" if check.returncode == 0 else
                f"e2fsck exit {check.returncode}: "
                f"{' '.join((check.stdout + check.stderr).split())[:300]}")
        if check.returncode >= 4:
            _run("losetup", "-d", device)
            copy.unlink(missing_ok=True)
            raise OSError(f"{self.mount}: {said}")
        if tear is not None:
            staging = self.image.with_name(self.image.name + ".mnt")
            staging.mkdir(exist_ok=True)
            try:
                _must("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, device, str(staging))
            except OSError:
                _run("losetup", "-d", device)
                raise
            try:
                torn = tear_tails(self.mount, staging, tear)
            finally:
                _run("umount", str(staging))
                staging.rmdir()
            said += f", {torn} torn" if torn else ""
        self.detach()
        os.replace(copy, self.image)  # (the loop device holds the file, not its name)
        self.device = device
        _must("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, self.device, str(self.mount))
        return said

    def detach(self) -> None:
        """Unmount (lazily: the old filesystem's page cache goes to the old image, if
        anywhere) and free the loop device. Idempotent."""
        if self.device:
            _run("umount", "-l", str(self.mount))
            _run("losetup", "-d", self.device)
            self.device = ""

    def remove(self) -> None:
        self.detach()
        self.image.unlink(missing_ok=True)
        self.image.with_name(self.image.name + ".cut").unlink(missing_ok=True)


def tear_tails(live: Path, cut: Path, rng: random.Random) -> int:
    """Give files under `cut` (the filesystem after a cut) part of the tail they lost
    against `live` (the same files before it), as a device that kept part of a write-back
    when power failed: for each file `cut` holds shorter than `live`, with even odds, the
    first 1..n sectors of what it lost, the last of them zeros with even odds. Returns
    how many files were torn."""
    torn = 0
    for directory, dirs, files in os.walk(cut):
        dirs.sort()  # (one order for a seed's draws)
        for name in sorted(files):
            path = Path(directory) / name
            source = live / path.relative_to(cut)
            try:
                kept = path.stat().st_size
                lost = source.stat().st_size - kept
            except OSError:  # (not in the live filesystem, or not a plain file)
                continue
            if lost <= 0 or rng.random() < 0.5:
                continue
            sectors = rng.randint(1, -(-lost // SECTOR))
            length = min(lost, sectors * SECTOR)
            with open(source, "rb") as live_file:
                live_file.seek(kept)
                data = bytearray(live_file.read(length))
            if rng.random() < 0.5:
                last = (len(data) - 1) // SECTOR * SECTOR
                data[last:] = bytes(len(data) - last)
            with open(path, "ab") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            torn += 1
    return torn
