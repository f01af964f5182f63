"""The ZooKeeper shell of the allocator: reads and compare-and-set writes of the block
znode, each bounded by a timeout, with kazoo's outcomes mapped to what the core needs.

    read  -> (data or None, version)          or raises ZooKeeperUnavailable
    write -> WriteOk(version) | WriteConflict | WriteUncertain | raises ZooKeeperUnavailable

A write raises ZooKeeperUnavailable only when it was never sent (no connection); once
it may have reached ZooKeeper, a missing answer is WriteUncertain, never a failure,
because the core must then prove by a re-read whether the write was ours.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kazoo.exceptions import (BadVersionError, ConnectionClosedError, ConnectionLoss,
                              NodeExistsError, NoNodeError, OperationTimeoutError,
                              SessionExpiredError)

from id_allocator.core import ABSENT
from services.zk import ZkSession, aio

# The block znode, under the cluster's chroot (ZkSession applies it).
BLOCK_PATH = "/producer_id_block"

# Outcomes of a call that may or may not have reached ZooKeeper.
_LOST = (ConnectionLoss, SessionExpiredError, ConnectionClosedError, OperationTimeoutError,
         TimeoutError)


class ZooKeeperUnavailable(Exception):
    """No ZooKeeper session to make the call on, or no answer to a read in time."""


@dataclass(frozen=True)
class WriteOk:
    version: int


@dataclass(frozen=True)
class WriteConflict:
    why: str


@dataclass(frozen=True)
class WriteUncertain:
    why: str


WriteResult = WriteOk | WriteConflict | WriteUncertain


class ZkBlockStore:
    def __init__(self, zk: ZkSession, op_timeout_s: float, path: str = BLOCK_PATH):
        self.zk = zk
        self.op_timeout_s = op_timeout_s
        self.path = path

    def _require_connection(self) -> None:
        if not self.zk.connected:
            raise ZooKeeperUnavailable(f"no ZooKeeper connection to {self.zk.hosts} "
                                       f"(state {self.zk.client.state})")

    async def read(self, sync: bool = False) -> tuple[bytes | None, int]:
        """The znode's data and version; (None, ABSENT) if it does not exist. With sync,
        the server first catches up with the leader, so the read sees every write that
        ZooKeeper applied before it (including ours whose reply was lost)."""
        self._require_connection()
        client = self.zk.client
        try:
            async with asyncio.timeout(self.op_timeout_s):
                if sync:
                    await aio(client.sync_async(self.path))
                data, stat = await aio(client.get_async(self.path))
        except NoNodeError:
            return None, ABSENT
        except _LOST as error:
            raise ZooKeeperUnavailable(f"reading {self.path} failed: "
                                       f"{type(error).__name__} {error}".strip()) from None
        return data, stat.version

    async def write(self, expected_version: int, data: bytes) -> WriteResult:
        """Create the znode (expected_version ABSENT) or set it at expected_version."""
        self._require_connection()
        client = self.zk.client
        try:
            async with asyncio.timeout(self.op_timeout_s):
                if expected_version == ABSENT:
                    await aio(client.create_async(self.path, data))
                    return WriteOk(0)
                stat = await aio(client.set_async(self.path, data, version=expected_version))
                return WriteOk(stat.version)
        except BadVersionError:
            return WriteConflict(f"{self.path} is no longer at version {expected_version}")
        except NodeExistsError:
            return WriteConflict(f"{self.path} was created by someone else")
        except NoNodeError:
            return WriteConflict(f"{self.path} was deleted")
        except _LOST as error:
            return WriteUncertain(f"{type(error).__name__} {error}".strip())
