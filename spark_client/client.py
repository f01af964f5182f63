"""The entry point of the SDK: `Client("host:port")` — any server's address."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterable

import grpc

from atomlog.v1 import coordinator_pb2, metadata_pb2
from spark_client import errors
from services import allocator
from services.auth import TokenSource
from services.backoff import Backoff
from services.tls import ChannelTls, TlsConfig
from spark_client.link import Links
from spark_client.routing import Channels, MetadataCache

_Transaction = None  # spark_client.transactions.Transaction, once begin_transaction() ran


class Client:
    """A connection to an atomlog cluster. Thread-safe; share one per process."""

    def __init__(self, bootstrap: str | list[str], *, request_timeout_s: float = 30.0,
                 tune_allocator: bool = True, one_call_max_bytes: int = 1 << 20,
                 tls: TlsConfig | None = None, token: str | None = None,
                 token_file: str | None = None, commit_threads: int = 16,
                 links: bool = True, gather_one_calls: bool = True):
        """`tls`: reach a cluster that serves TLS (tls.enabled on the servers) —
        `TlsConfig(ca_file=...)` with the CA that signed the servers' certificates, plus
        `cert_file` and `key_file` when the servers require client certificates
        (tls.client_auth=require). Every channel of this client uses it; files replaced
        on disk are picked up (checked once a second) for the channels opened after. The
        files are read and checked here: a missing or unusable one raises ValueError
        (TlsFileError) naming it.

        `token` or `token_file`: reach a cluster that authenticates with bearer tokens
        (auth.mode=token or mtls_or_token on the servers): the token (a JWT or a static
        token) is sent on every call as `authorization: Bearer <token>`. `token_file` is
        re-read when it changes on disk (looked at once a second at most), so a renewed
        token is used from then on. A missing or empty file raises ValueError
        (AuthFileError) here.

        `one_call_max_bytes`: a transaction from begin_transaction() keeps its records
        and acks here while they are at most this many bytes (and each partition's at
        most its producer's batch_max_bytes), and commit() sends them in one CommitTxn
        call; a bigger one switches to NewTxn, Produce and EndTxn transparently. 0 turns
        one-call transactions off (spark_client/transactions.py).

        `commit_threads`: the threads commit_async() runs commits on; at most this many
        commit at once, the rest queue. A one-call commit waits on its thread for its
        turn and then for the call that carries it, so this also bounds how many
        pipelined commits of one producer can leave together in one CommitTxns call: 4
        threads held pipelined consume-transform-produce to 2.3-2.6 commits per call,
        16 let 8 transactions committing at once ride together, 30-40% more inputs/s
        (docs/benchmarks.md, "Commit threads").

        `links`: send the calls to coordinators (CommitTxn, CommitTxns, NewTxn, EndTxn
        and the rest of the transaction calls) on their links where they advertise one
        (coordinator.client_link), and the consumers' Fetch, the subscription
        consumers' Receive, Ack and Nack and the producers' Produce on the partition
        servers' links, which costs this process and the servers less CPU than gRPC
        calls; everything else, and every call whose link cannot be reached, goes over
        gRPC (spark_client/link.py). False: gRPC only.

        `gather_one_calls`: a transaction from begin_transaction() with a timeout up to
        60 s goes to the lowest TC partition of one of the coordinators (each in turn),
        the same one for every client, so that under load its one-call commit shares
        that TC partition's log appends with the others' (docs/coordinator.md,
        "Gathered one-call commits"). False (and for longer timeouts): to the TC
        partition its random key hashes to, spread over all of them.

        `tune_allocator`: keep buffers under 4 MiB on glibc's heap and return freed
        heap memory to the kernel only past 32 MiB (process-wide, services/allocator.py).
        Encoding and sending batches then costs about a quarter less CPU: by default glibc
        unmaps such buffers when freed and faults them in again for the next batch. Pass
        False to leave the process's allocator as it is."""
        if not 1 <= commit_threads <= 256:
            raise ValueError("commit_threads must be 1..256")
        if tune_allocator:
            allocator.tune(4 << 20, 32 << 20)
        addresses = [bootstrap] if isinstance(bootstrap, str) else list(bootstrap)
        addresses = [a.strip() for item in addresses for a in item.split(",") if a.strip()]
        self.tls = tls
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        self.token_file = token_file
        self.token_source = (TokenSource(token, token_file)
                             if token is not None or token_file is not None else None)
        self.channels = Channels(ChannelTls(tls) if tls is not None else None, self.token_source)
        self.metadata = MetadataCache(addresses, self.channels)
        self.links = Links(self.channels.tls, self.token_source, enabled=links)
        self.request_timeout_s = request_timeout_s
        if one_call_max_bytes < 0:
            raise ValueError("one_call_max_bytes must be >= 0 (0: no one-call transactions)")
        self.one_call_max_bytes = one_call_max_bytes
        self.commit_threads = commit_threads
        self.gather_one_calls = gather_one_calls
        self._commit_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    # ------------------------------------------------------------------ topics
    def create_topic(self, name: str, partitions: int, config: dict[str, str] | None = None,
                     replication_factor: int = 0):
        """Create a topic; returns its TopicMetadata. Raises TopicAlreadyExists, ...
        `replication_factor` 0: the cluster's default (docs/replication.md)."""
        reply = self.metadata.call("CreateTopic", metadata_pb2.CreateTopicRequest(
            name=name, partitions=partitions, config=config or {},
            replication_factor=replication_factor))
        self.metadata.invalidate(name)
        return reply.topic

    def alter_topic_config(self, name: str, set: dict[str, str] | None = None,  # noqa: A002
                           delete: list[str] | None = None, validate_only: bool = False):
        """Change a topic's settings (docs/operations.md, "Topic settings"): `set` adds or
        replaces, `delete` removes; the servers apply them without a restart. Returns the
        TopicMetadata after the change (or as it would be, with `validate_only`). Raises
        InvalidTopicConfig (nothing changed), UnknownTopicOrPartition, ..."""
        reply = self.metadata.call("AlterTopicConfig", metadata_pb2.AlterTopicConfigRequest(
            topic=name, set=set or {}, delete=delete or [], validate_only=validate_only))
        self.metadata.invalidate(name)
        return reply.topic

    def list_topics(self) -> list[str]:
        return list(self.metadata.call("ListTopics", metadata_pb2.ListTopicsRequest()).names)

    def partitions_for(self, topic: str) -> int:
        return len(self.metadata.partitions(topic))

    # ------------------------------------------------------------------ clients
    def producer(self, **options):
        """An idempotent producer (see spark_client.producer.Producer for options)."""
        from spark_client.producer import Producer

        return Producer(self, **options)

    def consumer(self, topics, *, subscription: str | None = None, **options):
        """A consumer of every partition of `topics`: with `subscription`, of that named
        durable subscription (acks, nacks, redelivery, transactional acks: see
        spark_client.subscriber); without, reading by offset (spark_client.consumer)."""
        if subscription is not None:
            from spark_client.subscriber import SubscriptionConsumer

            return SubscriptionConsumer(self, topics, subscription=subscription, **options)
        from spark_client.consumer import Consumer

        return Consumer(self, topics, **options)

    def describe_partition(self, topic: str, partition: int):
        """The partition server's DescribePartition answer (high watermark, max read
        position, open transactions, producers, subscriptions)."""
        from atomlog.v1 import common_pb2, partition_pb2

        address = self.metadata.route(topic, partition).address
        stub = self.channels.partition(address)
        try:
            return stub.DescribePartition(partition_pb2.DescribePartitionRequest(
                topic_partition=common_pb2.TopicPartition(topic=topic, partition=partition)),
                timeout=self.request_timeout_s)
        except grpc.RpcError as rpc_error:
            raise errors.from_grpc(rpc_error) from None

    def delete_records(self, topic: str, before: dict[int, int],
                       timeout_s: float = 30.0) -> dict[int, int]:
        """Delete the records of `topic` below `before[partition]` in each partition
        named (DeleteRecords; Kafka's deleteRecords): every whole segment ending at or
        below that offset goes, so the log starts at the base of the segment holding it
        (the active segment and open transactions' data stay). Returns each partition's
        log start offset after it. On a replicated topic each answers once every
        in-sync replica has deleted too (so no failover shows the records again).

        Partitions are trimmed independently, each on its leader, retried on retriable
        failures (a moved leader, a follower still deleting) until `timeout_s`; the
        first error that is not retriable is raised (OffsetOutOfRange past the high
        watermark, InvalidArgument, ...), and partitions trimmed before it stay
        trimmed. Needs `alter` on the topic with ACLs."""
        from atomlog.v1 import partition_pb2

        if not before:
            return {}
        deadline = time.monotonic() + timeout_s
        pending, done = dict(before), {}
        backoff = Backoff(maximum_s=1.0)
        attempt = 0
        last: errors.AtomlogClientError | None = None
        while pending:
            attempt += 1
            left_s = deadline - time.monotonic()
            if attempt > 1:
                if left_s <= 0:
                    raise last or errors.error_for("REQUEST_TIMED_OUT", "DeleteRecords "
                                                   f"did not end within {timeout_s} s")
                time.sleep(min(backoff.delay(attempt - 1), left_s))
                left_s = deadline - time.monotonic()
                self.metadata.invalidate(topic)
            by_address: dict[str, list[int]] = {}
            for partition in sorted(pending):
                route = self.metadata.route(topic, partition)
                by_address.setdefault(route.address, []).append(partition)
            for address, partitions in by_address.items():
                if not address:  # offline: no leader now
                    last = errors.error_for("NOT_PARTITION_OWNER", f"{topic} partitions "
                                            f"{partitions} have no live leader")
                    continue
                wait_ms = int(max(0.0, min(left_s, 300.0)) * 1000)
                request = partition_pb2.DeleteRecordsRequest(
                    items=[partition_pb2.DeleteRecordsItem(
                        topic=topic, partition=p, before_offset=pending[p])
                        for p in partitions], timeout_ms=wait_ms)
                try:
                    reply = self.channels.partition(address).DeleteRecords(
                        request, timeout=max(1.0, left_s) + 1.0)
                except grpc.RpcError as rpc_error:
                    last = errors.from_grpc(rpc_error)
                    if not last.retriable:
                        raise last from None
                    continue
                for result in reply.results:
                    if not result.error.reason:
                        done[result.partition] = result.log_start_offset
                        pending.pop(result.partition, None)
                        continue
                    last = errors.error_for(result.error.reason, result.error.message,
                                            dict(result.error.metadata))
                    if not last.retriable:
                        raise last
        return done

    # ------------------------------------------------------------------ transactions
    def begin_transaction(self, timeout_s: float = 60.0, *,
                          partitions: Iterable[tuple[str, int]] = (),
                          subscriptions: Iterable[tuple[str, int, str]] = ()):
        """Begin a transaction (see spark_client.transactions.Transaction): commit() or
        abort() it; it is aborted timeout_s after this call if neither comes.

        Nothing is sent yet: the coordinator hears of the transaction with its first
        partitions or subscriptions, in one NewTxn call (or when `id` is asked for). A
        transaction that never wrote or acked anything commits without a call.
        `partitions` ((topic, partition)) and `subscriptions` ((topic, partition,
        subscription)) that the transaction will write or ack are registered in that same
        NewTxn, so writes and acks to them need no call of their own."""
        global _Transaction
        if _Transaction is None:  # (imported once: an import statement per call cost ~1 us)
            from spark_client.transactions import Transaction as _Transaction
        return _Transaction(self, timeout_s, lazy=True, partitions=partitions,
                            subscriptions=subscriptions)

    def transaction(self, timeout_s: float = 60.0, *,
                    partitions: Iterable[tuple[str, int]] = (),
                    subscriptions: Iterable[tuple[str, int, str]] = ()):
        """`with client.transaction() as txn:` commits on success, aborts on an exception."""
        return self.begin_transaction(timeout_s, partitions=partitions,
                                      subscriptions=subscriptions)

    # ------------------------------------------------------------------ producer ids
    def allocate_producer_id(self) -> tuple[int, int]:
        """A fresh (producer id, epoch) for an idempotent producer, from any coordinator
        (coordinators hold producer-id blocks, so this rarely touches ZooKeeper)."""
        backoff = Backoff(maximum_s=2.0)
        last: errors.AtomlogClientError | None = None
        for attempt in range(1, 8):
            if attempt > 1 or not self.metadata.coordinators:
                self.metadata.refresh()  # servers and their roles come with it
            coordinators = list(self.metadata.coordinators)
            random.shuffle(coordinators)
            for address in coordinators:
                stub = self.channels.coordinator(address)
                try:
                    reply = stub.InitProducerId(coordinator_pb2.InitProducerIdRequest(),
                                                timeout=self.request_timeout_s)
                    return reply.producer_id, reply.producer_epoch
                except grpc.RpcError as rpc_error:
                    last = errors.from_grpc(rpc_error)
                    if not last.retriable:
                        raise last from None
            time.sleep(backoff.delay(attempt))
        raise last or errors.error_for("SERVER_UNAVAILABLE", "no coordinator is registered")

    def commit_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads Transaction.commit_async() runs commits on (made on first use; at
        most `commit_threads` commits at a time, the rest queue)."""
        with self._executor_lock:
            if self._commit_executor is None:
                self._commit_executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.commit_threads, thread_name_prefix="atomlog-commit")
            return self._commit_executor

    def close(self) -> None:
        """Wait for commits begun with commit_async(), then close the links and channels."""
        with self._executor_lock:
            executor, self._commit_executor = self._commit_executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.links.close()
        self.channels.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
