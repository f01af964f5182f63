"""A consumer that reads partitions directly by offset (no subscription): it assigns
itself every partition of its topics (or the partition numbers given), starts each at
the earliest (or latest) offset, and long-polls the owning servers, one Fetch per server
for all its partitions; while it decodes what came, the next Fetch is already on its way.
Fetched batches are kept as Arrow columns: poll() makes Message tuples of what it
returns, poll_arrow() a pyarrow Table.
`read_committed` (the default) gets only committed data — the servers filter it."""

from __future__ import annotations

import time
import grpc
import pyarrow as pa

from atomlog.v1 import common_pb2, partition_pb2
from partition_server.record_batch import iter_batches
from spark_client import errors, link
from spark_client.fetched import Fetched, Message, block_of
from services import allocator
from services.backoff import Backoff

ISOLATION = {"read_committed": common_pb2.ISOLATION_LEVEL_READ_COMMITTED,
             "read_uncommitted": common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED}
RETRIABLE = {"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION", "PARTITION_LOADING",
             "SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT", "SHUTTING_DOWN", "RESOURCE_EXHAUSTED"}


class Consumer:
    def __init__(self, client, topics: list[str] | str, *, isolation: str = "read_committed",
                 start: str = "earliest", max_bytes_per_partition: int = 4 << 20,
                 max_bytes_per_request: int = 8 << 20,
                 request_timeout_s: float = 30.0,
                 partitions: list[int] | None = None):
        if isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {sorted(ISOLATION)}")
        if start not in ("earliest", "latest"):
            raise ValueError("start must be 'earliest' or 'latest'")
        self.client = client
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self.isolation = isolation
        self.max_bytes_per_partition = max_bytes_per_partition
        self.max_bytes_per_request = max_bytes_per_request
        tune_for_fetches(max_bytes_per_request)
        self.request_timeout_s = request_timeout_s
        self.backoff = Backoff()
        self._positions: dict[tuple[str, int], int] = {}
        self._fetched = Fetched()  # fetched, not yet returned by poll
        # The Fetch sent ahead (see _fetch): (generation, calls, servers), or None; a
        # seek starts a new generation, and a call of an older one is dropped.
        self._prefetched: tuple | None = None
        self._generation = 0
        self._closed = False
        for topic in self.topics:
            for route in client.metadata.partitions(topic):
                if partitions is None or route.partition in partitions:
                    self._positions[(topic, route.partition)] = -1
        if partitions is not None and len(self._positions) != len(self.topics) * len(set(partitions)):
            raise ValueError(f"partitions {sorted(set(partitions))} do not all exist in "
                             f"{self.topics}")
        # Resolved now: "earliest" is the log start offset, which retention or
        # DeleteRecords may have moved past 0 (before, every consumer began at 0, and
        # such a partition answered OFFSET_OUT_OF_RANGE).
        spec = (partition_pb2.OFFSET_SPEC_LATEST if start == "latest"
                else partition_pb2.OFFSET_SPEC_EARLIEST)
        if self._positions:
            self._positions.update(self._list_offsets(spec))

    def assignment(self) -> dict[tuple[str, int], int]:
        """Each (topic, partition) and the next offset this consumer will read."""
        return dict(self._positions)

    def position(self, topic: str, partition: int) -> int:
        """The offset poll() goes on from in this partition: that of the first message
        fetched but not yet returned, else the next offset to fetch."""
        held = self._fetched.position(topic, partition)
        return self._positions[(topic, partition)] if held is None else held

    def seek(self, topic: str, partition: int, offset: int) -> None:
        if (topic, partition) not in self._positions:
            raise ValueError(f"{topic}-{partition} is not assigned to this consumer")
        if offset < 0:
            raise ValueError("offset must be >= 0")
        self._positions[(topic, partition)] = offset
        self._fetched.drop(topic, partition)
        self._generation += 1  # a Fetch sent before the seek is of no use

    def end_offsets(self) -> dict[tuple[str, int], int]:
        """Per partition, the offset after the last readable record (the max read position
        under read_committed, else the high watermark)."""
        spec = (partition_pb2.OFFSET_SPEC_MAX_READ_POSITION if self.isolation == "read_committed"
                else partition_pb2.OFFSET_SPEC_LATEST)
        return self._list_offsets(spec)

    def beginning_offsets(self) -> dict[tuple[str, int], int]:
        """Per partition, the first offset still in the log (the log start offset)."""
        return self._list_offsets(partition_pb2.OFFSET_SPEC_EARLIEST)

    def read_until(self, ends: dict[tuple[str, int], int] | None = None, *,
                   idle_timeout_s: float = 60.0, max_records: int = 10_000,
                   arrow: bool | str = False):
        """Lists of messages (with arrow, pyarrow Tables as poll_arrow() returns; with
        arrow="blocks", lists of fetched.Block: each a run of one stored batch's rows as
        slices of the fetched buffers) from the current positions up to `ends` (offset
        per assigned partition, exclusive; default: end_offsets() now — the max read
        position under read_committed), then stop. A partition that makes no progress
        for idle_timeout_s raises REQUEST_TIMED_OUT (its range is not readable: open, or
        beyond the end)."""
        take = {True: self._fetched.take_table, False: self._fetched.take_messages,
                "blocks": self._fetched.take_blocks}[arrow]
        if ends is None:
            ends = self.end_offsets()
        deadline = time.monotonic() + idle_timeout_s
        while True:
            behind = [key for key, end in ends.items() if self.position(*key) < end]
            if not behind:
                return
            before = sum(self.position(*key) for key in behind)
            self._wait_for_data(1.0)
            messages = take(max_records, ends)
            if len(messages) or sum(self.position(*key) for key in behind) > before:
                # Progress, rows or not: a long run of aborted data or markers under
                # read_committed moves the positions with nothing to hand out, and
                # counting only rows failed a read of it as "not readable".
                deadline = time.monotonic() + idle_timeout_s
                if len(messages):
                    yield messages
            elif time.monotonic() > deadline:
                key = behind[0]
                raise errors.error_for(
                    "REQUEST_TIMED_OUT", f"{key[0]}-{key[1]}: offsets {self.position(*key)}.."
                    f"{ends[key]} were not readable for {idle_timeout_s:.0f} s "
                    "(an open transaction, or past the end of the log?)")

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Message]:
        """Up to max_records messages, waiting up to timeout_s for the first."""
        self._wait_for_data(timeout_s)
        return self._fetched.take_messages(max_records)

    def poll_arrow(self, timeout_s: float = 1.0, max_records: int = 100_000) -> pa.Table:
        """poll() as a pyarrow Table (fetched.TABLE_SCHEMA: topic, partition, offset, key,
        value, headers, timestamp), empty when nothing came within timeout_s. Key, value
        and headers are the fetched buffers, not copies (columnar batches, uncompressed);
        no Python object is made per record."""
        self._wait_for_data(timeout_s)
        return self._fetched.take_table(max_records)

    def _wait_for_data(self, timeout_s: float) -> None:
        if self._closed:
            raise RuntimeError("consumer is closed")
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while not self._fetched:
            remaining = deadline - time.monotonic()
            try:
                self._fetch(max(0.0, remaining))
                attempt = 0
            except errors.AtomlogClientError as error:
                if not error.retriable:
                    raise
                attempt += 1
                time.sleep(min(self.backoff.delay(attempt), max(0.0, remaining)))
            if time.monotonic() >= deadline:
                break

    def _by_server(self) -> dict[str, list[tuple[str, int]]]:
        servers: dict[str, list[tuple[str, int]]] = {}
        for topic, partition in self._positions:
            address = self.client.metadata.route(topic, partition).address
            if address:
                servers.setdefault(address, []).append((topic, partition))
        return servers

    def _fetch(self, wait_s: float) -> None:
        """One Fetch per server (or the one prefetched after the last, if no seek came
        between): take what they return into the buffer. As soon as the replies are in
        and their data reached past the old positions, the next Fetch is sent (without
        waiting at the servers), so it travels while this one's batches are decoded."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == self._generation:
            calls, servers = prefetched[1], prefetched[2]
        else:
            _cancel(prefetched)
            servers = self._by_server()
            if not servers:
                self._refresh()
                raise errors.error_for("SERVER_UNAVAILABLE",
                                       "no owner of any partition is reachable")
            calls = self._send_fetches(servers, wait_s)
        failure: errors.AtomlogClientError | None = None
        fatal: errors.AtomlogClientError | None = None  # a partition's, not retriable
        taken = []
        for call in calls:
            try:
                reply = call.result()
            except grpc.RpcError as rpc_error:
                failure = errors.from_grpc(rpc_error)
                continue
            for result in reply.results:
                if result.error.reason:
                    failure = errors.error_for(result.error.reason, result.error.message,
                                               dict(result.error.metadata))
                    if not failure.retriable and fatal is None:
                        tp = result.topic_partition
                        fatal = errors.error_for(
                            result.error.reason, f"{tp.topic}-{tp.partition}: "
                            f"{result.error.message}", dict(result.error.metadata))
                    continue
                taken.append(result)
        after = dict(self._positions)
        for result in taken:
            key = (result.topic_partition.topic, result.topic_partition.partition)
            after[key] = max(after[key], result.next_fetch_offset)
        # (Moved: data came, or only filtered-out batches. Not `result.record_batches`:
        # each read of that field copies it.)
        if any(after[key] > self._positions[key] for key in after) and not self._closed:
            moved = self._by_server()
            if moved:
                self._prefetched = (self._generation,
                                    self._send_fetches(moved, 0.0, after), moved)
        for result in taken:
            key = (result.topic_partition.topic, result.topic_partition.partition)
            try:
                self._take(result)
            except errors.AtomlogClientError:
                # A batch that cannot be read (CORRUPT_BATCH, CRC_MISMATCH): its partition
                # stays before it, so every poll fails on it again; nothing is skipped.
                prefetched, self._prefetched = self._prefetched, None
                _cancel(prefetched)
                raise
            self._positions[key] = after[key]
        if fatal is not None:
            # Raised even though other partitions brought data (kept for the next poll):
            # before, it was dropped whenever they did, and that partition was never read
            # again while poll() went on without a word.
            raise fatal
        if failure is not None and not self._fetched:
            if failure.reason in ("NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION",
                                  "SERVER_UNAVAILABLE"):
                self._refresh()
            raise failure
        if len(servers) > 1 and not self._fetched and wait_s > 0:
            time.sleep(min(wait_s, 0.05))  # several servers: short polls instead of long ones

    def _send_fetches(self, servers: dict[str, list[tuple[str, int]]], wait_s: float,
                      positions: dict | None = None) -> list:
        """A Fetch to each server for its partitions at `positions` (default: the current
        ones), long-polling up to wait_s when there is one server; returns the calls."""
        positions = self._positions if positions is None else positions
        calls = []
        for address, partitions in servers.items():
            request = partition_pb2.FetchRequest(
                isolation_level=ISOLATION[self.isolation],
                max_wait_ms=int(wait_s * 1000) if len(servers) == 1 else 0,
                max_bytes=self.max_bytes_per_request,
                items=[partition_pb2.FetchItem(
                    topic_partition=common_pb2.TopicPartition(topic=t, partition=p),
                    fetch_offset=positions[(t, p)], max_bytes=self.max_bytes_per_partition)
                    for t, p in partitions])
            # On the server's link when it has one, else gRPC's future. On the link, a
            # long poll (one server) is made on this thread when its result is asked for,
            # which is at once; the rest (several servers, a Fetch sent ahead) on the
            # links' threads.
            call, over_grpc = link.partition_call(self.client, address, "Fetch")
            timeout_s = self.request_timeout_s + wait_s
            calls.append(call.future(request, timeout=timeout_s) if over_grpc
                         else link.Deferred(call, request, timeout_s) if request.max_wait_ms
                         else self.client.links.submit(call, request, timeout_s))
        return calls

    def _take(self, result) -> None:
        """The batches of one partition's result from its position on, into the buffer."""
        tp = result.topic_partition
        position = self._positions[(tp.topic, tp.partition)]
        data = memoryview(result.record_batches)
        for start, header in iter_batches(data):
            if header.is_control or header.last_offset < position:
                continue
            self._fetched.add(block_of(tp.topic, tp.partition, data[start:start + header.size],
                                       header, position))

    def _list_offsets(self, spec) -> dict[tuple[str, int], int]:
        """ListOffsets of every assigned partition from its owner. A retriable refusal (a
        partition still loading after a failover, an owner moved or unreachable) is
        retried with a backoff and fresh routes for up to request_timeout_s, as fetches
        are; then it is raised (errors.py: the SDK already retried it)."""
        deadline = time.monotonic() + self.request_timeout_s
        attempt = 0
        while True:
            try:
                return self._list_offsets_once(spec)
            except errors.AtomlogClientError as error:
                attempt += 1
                remaining = deadline - time.monotonic()
                if not error.retriable or remaining <= 0:
                    raise
                self._refresh()
                time.sleep(min(self.backoff.delay(attempt), remaining))

    def _list_offsets_once(self, spec) -> dict[tuple[str, int], int]:
        found: dict[tuple[str, int], int] = {}
        for address, partitions in self._by_server().items():
            stub = self.client.channels.partition(address)
            try:
                reply = stub.ListOffsets(partition_pb2.ListOffsetsRequest(items=[
                    partition_pb2.ListOffsetsItem(
                        topic_partition=common_pb2.TopicPartition(topic=t, partition=p), spec=spec)
                    for t, p in partitions]), timeout=self.request_timeout_s)
            except grpc.RpcError as rpc_error:
                raise errors.from_grpc(rpc_error) from None
            for result in reply.results:
                if result.error.reason:
                    raise errors.error_for(result.error.reason, result.error.message)
                found[(result.topic_partition.topic, result.topic_partition.partition)] = result.offset
        missing = sorted(set(self._positions) - set(found))
        if missing:  # no owner now (a failover): not an answer to leave out
            raise errors.error_for("SERVER_UNAVAILABLE", "no owner of "
                                   + ", ".join(f"{t}-{p}" for t, p in missing[:5]) + " now")
        return found

    def _refresh(self) -> None:
        for topic in self.topics:
            self.client.metadata.invalidate(topic)

    def close(self) -> None:
        self._closed = True
        prefetched, self._prefetched = self._prefetched, None
        _cancel(prefetched)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tune_for_fetches(max_bytes_per_request: int) -> None:
    """Keep a Fetch reply of up to max_bytes_per_request on glibc's heap, if the process
    lets the SDK tune its allocator (Client(tune_allocator=True), the default: it set 4 MiB).

    A reply is held about three times over while it is read (gRPC's receive buffer, the
    message's bytes, the copy that reading `record_batches` makes). Above the mmap
    threshold, each is a fresh mapping that is faulted in page by page and unmapped when
    freed: measured with 8 MiB replies (8 partitions, or one partition read 8 MiB at a
    time), 265-770 minor faults per MB read and 2.0-3.3 ms of client CPU per MB, against
    28-36 faults and 1.3-1.4 ms/MB with the replies on the heap; poll_arrow() went from
    87% of raw Fetch to 120% on 8 partitions in the same round (docs/benchmarks.md)."""
    if allocator.applied()[0]:  # tuned by the Client: raise it (tune never lowers it)
        allocator.tune(2 * max_bytes_per_request, 8 * max_bytes_per_request)


def _cancel(prefetched: tuple | None) -> None:
    if prefetched is not None:
        for call in prefetched[1]:
            call.cancel()
