"""The partition owner restarts from its producer-state snapshot plus the log tail (not a
full replay), and the result equals a full replay."""

from __future__ import annotations

import asyncio

from partition_server.log import LogConfig
from partition_server.owner import OwnerSettings, PartitionOwner
from partition_server.record_batch import Record, encode_batch, parse_header


def batch(producer_id: int, sequence: int) -> bytes:
    return encode_batch([Record(b"k", b"v" * 50)] * 2, producer_id=producer_id,
                        producer_epoch=0, base_sequence=sequence, timestamp_ms=1_000)


async def produce(owner: PartitionOwner, batches: list[bytes]) -> None:
    for b in batches:
        await owner.produce([(b, parse_header(b))])


def test_restart_uses_the_snapshot_and_replays_only_the_tail(tmp_path):
    settings = OwnerSettings(log=LogConfig(segment_bytes=4_000), fsync=False,
                             snapshot_interval_batches=10, snapshot_interval_ms=3_600_000)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        await produce(owner, [batch(p, s) for s in range(0, 24, 2) for p in (7, 8)])  # 24
        await owner.close()  # a clean stop snapshots everything
        assert list((tmp_path / "t-0").glob("*.producer_snapshot"))

        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert again.replayed_batches == 0
        await produce(again, [batch(7, 24), batch(8, 24), batch(9, 0)])
        before_crash = again.producers.snapshot(again.log.high_watermark)
        again.log.close()  # a crash: no final snapshot (the periodic one covered 24)

        third = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await third.start()
        assert third.replayed_batches == 3
        assert third.producers.snapshot(third.log.high_watermark) == before_crash
        await third.close()

        # Without any snapshot, a full replay gives the same table.
        for path in (tmp_path / "t-0").glob("*.producer_snapshot"):
            path.unlink()
        full = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await full.start()
        assert full.replayed_batches == 27
        assert full.producers.snapshot(full.log.high_watermark) == before_crash
        await full.close()

    asyncio.run(scenario())
