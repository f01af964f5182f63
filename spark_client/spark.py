"""The `atomlog` Spark data source (pyspark >= 4.3 Python data source API).

    from spark_client.spark import register
    register(spark)                      # spark.dataSource.register(AtomlogDataSource)
    df.write.format("atomlog").option("bootstrap", "host:port").option("topic", "t") \\
        .mode("append").save()           # exactly once
    spark.read.format("atomlog").option("bootstrap", ...).option("topic", "t").load()
    spark.readStream.format("atomlog")...; df.writeStream.format("atomlog")...

Exactly-once writes use parent and child transactions (docs/spark.md):

- Batch: the writer, built on the driver, opens a *parent* transaction. Each task attempt
  opens a *child* of it on the same coordinator, writes its rows with an idempotent
  producer, PREPAREs the child and returns the child's id. Spark hands the driver's
  `commit(messages)` only the messages of successful attempts; committing the parent
  names exactly those children, and every other child — failed, killed and losing
  speculative attempts — is aborted in the same coordinator log record. `abort()` aborts
  the parent. A driver that dies leaves the parent OPEN until its timeout, which aborts
  it and every child: nothing becomes visible. Task attempts restart the parent's timeout
  as they start (its idempotency key), so the timeout bounds the silence of a dead
  driver, not the length of a job.
- Streaming: the parent is keyed by (query id, batch id). Tasks open it by that key
  (the first creates it) and their children under it; the driver's commit is idempotent,
  so a micro-batch replayed after a restart commits at most once: if the batch was
  already committed, its tasks find the parent decided and write nothing.

Reads are read_committed by default: the end offset of each partition is pinned at
planning (its max read position, below which everything is decided), so a batch read
is repeatable and never sees open or aborted data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from pyspark.sql.datasource import (DataSource, DataSourceArrowWriter, DataSourceReader,
                                    DataSourceStreamArrowWriter, DataSourceStreamReader,
                                    InputPartition, WriterCommitMessage)
from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadLimit, ReadMaxRows,
                                              SupportsTriggerAvailableNow)
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, LongType, MapType,
                               StringType, StructField, StructType, TimestampType)

from services.auth import AuthFileError, TokenSource
from services.tls import TlsConfig, TlsFileError
from spark_client import errors

NAME = "atomlog"
_log = logging.getLogger("atomlog.spark")
SCHEMA = StructType([
    StructField("topic", StringType(), False), StructField("partition", IntegerType(), False),
    StructField("offset", LongType(), False), StructField("key", BinaryType()),
    StructField("value", BinaryType()),
    StructField("headers", ArrayType(StructType([StructField("key", StringType(), False),
                                                 StructField("value", BinaryType())]), False)),
    StructField("timestamp", TimestampType(), False)])
# Every option, its default and meaning: docs/spark.md lists the same table.
OPTIONS = {
    "bootstrap": (None, "address(es) of any atomlog server, comma-separated (required)"),
    "topic": (None, "the topic to write; or the topic(s) to read, comma-separated"),
    "topics": (None, "the topics to read, comma-separated (alias of topic for reads)"),
    "isolation": ("read_committed", "reads: read_committed or read_uncommitted"),
    "failOnDataLoss": ("true", "reads: true (a range whose records were deleted before it "
                       "was read, by retention or DeleteRecords, fails the query) or false "
                       "(the deleted records are skipped and the read goes on from the log "
                       "start, logged; as Kafka's source)"),
    "startingOffsets": ("earliest", "reads: earliest, latest, or JSON "
                        '{"topic": {"0": offset}} (missing partitions: earliest)'),
    "endingOffsets": ("latest", "batch reads: latest (the max read position under "
                      "read_committed) or JSON like startingOffsets"),
    "maxOffsetsPerSplit": ("1000000", "batch and stream reads: a partition range longer "
                           "than this is split over several Spark partitions"),
    "maxRecordsPerTrigger": ("", "streams: at most about this many offsets per "
                             "micro-batch, spread over the partitions (default: all)"),
    "transactionTimeoutMs": ("120000", "writes: the parent's OPEN timeout, restarted while "
                             "any write task runs; a dead driver's write is aborted this "
                             "long after its last task ended"),
    "childTimeoutMs": ("", "writes: a task attempt's OPEN timeout (default: "
                       "transactionTimeoutMs)"),
    "preparedTimeoutMs": ("0", "writes: how long a prepared child waits for its parent's "
                          "decision, past the parent's own timeout (while the parent is "
                          "open, the child waits as long; 0: the coordinator's default)"),
    "batchMaxBytes": ("1048576", "writes: producer batch size in bytes (at most the "
                      "servers' partition.max_batch_bytes, 1 MiB by default)"),
    "lingerMs": ("5", "writes: producer linger in milliseconds"),
    "compression": ("none", "writes: none, zstd or lz4"),
    "requestTimeoutMs": ("30000", "every call's timeout"),
    "sourceSubscription": ("", "stream writes: record each micro-batch's end offsets of its "
                           "atomlog source(s) as cumulative acks of this subscription, in "
                           "the micro-batch's transaction"),
    "tls.ca": ("", "a cluster serving TLS: the CA certificate file (PEM) that signed the "
               "servers; the same path must exist on the driver and every executor"),
    "tls.cert": ("", "mTLS (tls.client_auth=require): the client certificate file (PEM)"),
    "tls.key": ("", "mTLS: the key file (PEM) of tls.cert"),
    "auth.tokenFile": ("", "a cluster authenticating bearer tokens (auth.mode=token or "
                       "mtls_or_token): a file holding the token (a JWT or a static token), "
                       "sent on every call and re-read when it changes; the same path must "
                       "exist on the driver and every executor"),
}
# Options Spark itself passes along with ours.
_SPARK_OPTIONS = {"path", "checkpointlocation", "queryname"}
_WRITE_COLUMNS = {"value", "key", "headers", "partition", "topic"}


def register(spark) -> None:
    """Make `format("atomlog")` available in this SparkSession."""
    spark.dataSource.register(AtomlogDataSource)


def local_session(app: str = "atomlog", master: str = "local[2,4]", **conf):
    """A local SparkSession whose Python workers run this interpreter (so they import
    atomlog and grpc), with the atomlog source registered. `local[N,F]` lets a failed
    task be retried up to F-1 times, as on a cluster."""
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.driver.memory", "1g"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


class OptionError(ValueError):
    """A data source option is missing or wrong (raised on the driver, before any write)."""


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Options:
    bootstrap: list[str]
    topics: list[str]
    isolation: str
    starting: str
    ending: str
    max_offsets_per_split: int
    max_records_per_trigger: int | None
    transaction_timeout_s: float
    child_timeout_s: float
    prepared_timeout_s: float
    batch_max_bytes: int
    linger_ms: float
    compression: str | None
    request_timeout_s: float
    source_subscription: str = ""
    checkpoint: str = ""
    tls: TlsConfig | None = None
    token_file: str = ""
    fail_on_data_loss: bool = True

    @classmethod
    def parse(cls, options) -> Options:
        given = {k.lower(): v for k, v in dict(options).items()}
        known = {k.lower() for k in OPTIONS} | _SPARK_OPTIONS
        unknown = sorted(set(given) - known)
        if unknown:
            raise OptionError(f"unknown atomlog option(s) {unknown}; known: {sorted(OPTIONS)}")

        def get(name: str) -> str:
            return given.get(name.lower(), OPTIONS[name][0]) or ""

        def number(name: str, low: float, high: float, kind=int):
            text = get(name)
            try:
                value = kind(text)
            except ValueError:
                raise OptionError(f"option {name}={text!r} is not a number") from None
            if not low <= value <= high:
                raise OptionError(f"option {name}={value} must be between {low} and {high}")
            return value

        bootstrap = [a.strip() for a in get("bootstrap").split(",") if a.strip()]
        if not bootstrap:
            raise OptionError("option bootstrap (an atomlog server address) is required")
        topics = [t.strip() for t in (get("topics") or get("topic") or given.get("path", ""))
                  .split(",") if t.strip()]
        fail_on_data_loss = get("failOnDataLoss").strip().lower()
        if fail_on_data_loss not in ("true", "false"):
            raise OptionError(f"option failOnDataLoss={fail_on_data_loss!r}: true or false")
        isolation = get("isolation")
        if isolation not in ("read_committed", "read_uncommitted"):
            raise OptionError(f"option isolation={isolation!r}: read_committed or "
                              "read_uncommitted")
        compression = get("compression").lower()
        if compression not in ("none", "zstd", "lz4"):
            raise OptionError(f"option compression={compression!r}: none, zstd or lz4")
        txn_ms = number("transactionTimeoutMs", 1000, 900_000)
        child_ms = number("childTimeoutMs", 1000, 900_000) if get("childTimeoutMs") else txn_ms
        trigger = (number("maxRecordsPerTrigger", 1, 2**62) if get("maxRecordsPerTrigger")
                   else None)
        parsed = cls(bootstrap=bootstrap, topics=topics, isolation=isolation,
                     starting=get("startingOffsets"), ending=get("endingOffsets"),
                     max_offsets_per_split=number("maxOffsetsPerSplit", 1, 2**62),
                     max_records_per_trigger=trigger,
                     transaction_timeout_s=txn_ms / 1000, child_timeout_s=child_ms / 1000,
                     prepared_timeout_s=(number("preparedTimeoutMs", 1000, 3_600_000)
                                         if get("preparedTimeoutMs") not in ("", "0")
                                         else 0) / 1000,
                     batch_max_bytes=number("batchMaxBytes", 1024, 16 << 20),
                     linger_ms=number("lingerMs", 0, 60_000, float),
                     compression=None if compression == "none" else compression,
                     request_timeout_s=number("requestTimeoutMs", 100, 600_000) / 1000,
                     source_subscription=get("sourceSubscription"),
                     checkpoint=given.get("checkpointlocation", ""),
                     fail_on_data_loss=fail_on_data_loss == "true")
        for which in ("starting", "ending"):
            _parse_offsets_spec(getattr(parsed, which), f"{which}Offsets")
        ca, cert, key = get("tls.ca"), get("tls.cert"), get("tls.key")
        if cert or key or ca:
            if not ca:
                raise OptionError("options tls.cert and tls.key need tls.ca (the CA that "
                                  "signed the servers' certificates)")
            tls = TlsConfig(ca, cert, key)
            try:
                tls.check()
            except TlsFileError as error:
                raise OptionError(f"options tls.*: {error}") from None
            parsed = dataclasses.replace(parsed, tls=tls)
        token_file = get("auth.tokenFile")
        if token_file:
            try:
                TokenSource(token_file=token_file)
            except AuthFileError as error:
                raise OptionError(f"option auth.tokenFile: {error}") from None
            parsed = dataclasses.replace(parsed, token_file=token_file)
        return parsed

    def client(self):
        from spark_client import Client

        return Client(self.bootstrap, request_timeout_s=self.request_timeout_s, tls=self.tls,
                      token_file=self.token_file or None)

    def write_topic(self) -> str:
        if len(self.topics) != 1:
            raise OptionError("writes need exactly one topic (option topic), or a topic column")
        return self.topics[0]


def _parse_offsets_spec(spec: str, name: str) -> dict | str:
    if spec in ("earliest", "latest"):
        return spec
    try:
        parsed = json.loads(spec)
        if not isinstance(parsed, dict) or not all(
                isinstance(v, dict) and all(int(p) >= 0 and isinstance(o, int) and o >= -2
                                            for p, o in v.items()) for v in parsed.values()):
            raise ValueError
    except (ValueError, TypeError):
        raise OptionError(f"option {name}={spec!r}: earliest, latest or JSON "
                          '{"topic": {"partition": offset}}') from None
    return parsed


# ---------------------------------------------------------------------------- source
class AtomlogDataSource(DataSource):
    """format("atomlog"): see the module docstring and docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self):
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(_not_for(Options.parse(self.options), "batch reads"), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        if overwrite:
            raise OptionError("atomlog topics are append-only: use mode('append')")
        return BatchWriter(_not_for(Options.parse(self.options), "batch writes"), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(_not_for(Options.parse(self.options), "stream reads"), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        if overwrite:
            raise OptionError("atomlog topics are append-only: use outputMode('append')")
        return StreamWriter(Options.parse(self.options), schema)


def _not_for(options: Options, what: str) -> Options:
    """Refuse sourceSubscription where it would do nothing (it is a stream write's option:
    taken and ignored elsewhere, a query meant to record its positions would not)."""
    if options.source_subscription:
        raise OptionError(f"option sourceSubscription is for stream writes (the sink of a "
                          f"streaming query), not {what}")
    return options


# ---------------------------------------------------------------------------- reads
@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One Spark partition of a read: offsets [start, end) of one topic partition."""

    topic: str
    partition: int
    start: int
    end: int


def _check_read_schema(schema: StructType) -> None:
    """A read yields SCHEMA's columns, or the ones a schema given to the reader names
    (`spark.read.format("atomlog").schema("offset long, value binary")`): any of SCHEMA's
    columns, each at most once, in any order, each of SCHEMA's type (nullability aside,
    but a column that may be null must be declared nullable). The Python data source API
    does not pass Spark's column pruning on, so naming the columns is how a read skips
    the others (they are neither built nor shipped to the JVM)."""
    ours = {f.name: f for f in SCHEMA.fields}
    names = [f.name for f in schema.fields]
    problems = []
    if not names:
        problems.append("no columns")
    if len(set(names)) != len(names):
        problems.append(f"repeated column(s) in {names}")
    for field in schema.fields:
        mine = ours.get(field.name)
        if mine is None:
            problems.append(f"unknown column `{field.name}`")
        elif field.dataType.simpleString() != mine.dataType.simpleString():
            problems.append(f"column `{field.name}` is {mine.dataType.simpleString()}, not "
                            f"{field.dataType.simpleString()}")
        elif mine.nullable and not field.nullable:
            problems.append(f"column `{field.name}` may be null: declare it nullable")
    if problems:
        raise OptionError(f"an atomlog read has the schema {SCHEMA.simpleString()}, or a "
                          f"subset of its columns given as the reader's schema: "
                          + "; ".join(problems))


def _check_topics_exist(options: Options, client) -> None:
    missing = sorted(set(options.topics) - set(client.list_topics()))
    if missing:
        raise OptionError(f"unknown topic(s) {missing}: create them first")


def _topics_or_fail(options: Options, client) -> list[str]:
    if not options.topics:
        raise OptionError("reads need option topic (or topics)")
    _check_topics_exist(options, client)
    return options.topics


class _Positions:
    """The earliest and latest offsets of every partition of the topics, each asked of
    the servers once, and only if a spec needs it (planning runs on the driver, in a
    Python worker of its own: its calls are part of every query's fixed cost)."""

    def __init__(self, options: Options, client):
        from spark_client.consumer import Consumer

        self._consumer = Consumer(client, options.topics, isolation=options.isolation)
        self._found: dict[str, dict] = {}

    def __enter__(self) -> _Positions:
        return self

    def __exit__(self, *exc) -> None:
        self._consumer.close()

    def _get(self, which: str) -> dict:
        if which not in self._found:
            self._found[which] = (self._consumer.end_offsets() if which == "latest"
                                  else self._consumer.beginning_offsets())
        return self._found[which]

    def offsets(self, spec: str, default_latest: bool) -> dict[str, dict[str, int]]:
        """{topic: {"partition": offset}} for every partition of the topics, for a spec of
        earliest / latest / JSON (JSON entries -2 = earliest, -1 = latest, like Kafka)."""
        parsed = _parse_offsets_spec(spec, "offsets")
        out: dict[str, dict[str, int]] = {}
        for topic, partition in sorted(self._consumer.assignment()):
            if parsed in ("latest", "earliest"):
                offset = self._get(parsed)[(topic, partition)]
            else:
                given = parsed.get(topic, {}).get(str(partition))
                if given is None:
                    given = -1 if default_latest else -2
                offset = (self._get("latest")[(topic, partition)] if given == -1 else
                          self._get("earliest")[(topic, partition)] if given == -2 else given)
            out.setdefault(topic, {})[str(partition)] = offset
        return out


def _offsets(options: Options, client, spec: str, default_latest: bool) -> dict[str, dict[str, int]]:
    """_Positions.offsets of one spec."""
    with _Positions(options, client) as positions:
        return positions.offsets(spec, default_latest)


def _ranges(start: dict, end: dict, max_per_split: int) -> list[OffsetRange]:
    ranges = []
    for topic in sorted(end):
        for partition_text in sorted(end[topic], key=int):
            first = start.get(topic, {}).get(partition_text, 0)
            last = end[topic][partition_text]
            while first < last:
                upto = min(last, first + max_per_split)
                ranges.append(OffsetRange(topic, int(partition_text), first, upto))
                first = upto
    return ranges


def _arrow_schema(schema: StructType | None = None):
    """The read's schema (default SCHEMA) in Arrow, nullability included (Spark checks it
    exactly)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema or SCHEMA, timezone="UTC")


class _SparkColumns:
    """Builds the Spark batches of one read task: a RecordBatch of SCHEMA per fetched
    block (the records of one stored batch). Key, value and headers are the block's own
    Arrow arrays — slices of the fetched bytes, handed to Spark without a copy; offset and
    timestamp are one kernel call each; topic, partition and empty headers are slices of
    arrays built once. No Python per row, and no copy of keys and values before Spark's
    own (its Arrow stream to the JVM)."""

    _shared: dict = {}  # per process: counting and empty-headers arrays, grown on demand

    def __init__(self, topic: str, partition: int, schema: StructType | None = None):
        self.schema = _arrow_schema(schema)
        self.names = self.schema.names  # SCHEMA's, or the columns the reader was given
        self.topic, self.partition = topic, partition
        self._rows = 0
        self._topics = self._partitions = None
        full = _arrow_schema()
        self._headers_type = (self.schema.field("headers").type if "headers" in self.names
                              else full.field("headers").type)
        self._stamp_type = full.field("timestamp").type

    def _constants(self, rows: int) -> tuple:
        """(topics, partitions, counting, no headers): arrays of at least `rows` rows."""
        import pyarrow as pa

        if rows > self._rows:
            self._rows = max(rows, 2 * self._rows, 1 << 14)
            self._topics = pa.repeat(pa.scalar(self.topic, pa.string()), self._rows)
            self._partitions = pa.repeat(pa.scalar(self.partition, pa.int32()), self._rows)
        shared = self._shared
        if shared.get("rows", 0) < rows:
            size = max(rows, 2 * shared.get("rows", 0), 1 << 16)
            shared.update(rows=size, counting=pa.array(range(size), pa.int64()),
                          no_headers=pa.ListArray.from_arrays(
                              pa.repeat(pa.scalar(0, pa.int32()), size + 1),
                              pa.array([], self._headers_type.value_type),
                              type=self._headers_type))
        return self._topics, self._partitions, shared["counting"], shared["no_headers"]

    def batch(self, block):
        import pyarrow as pa
        import pyarrow.compute as pc

        columns = block.columns
        n = columns.num_rows
        topics, partitions, counting, no_headers = self._constants(n)
        out = []
        for name in self.names:  # only the columns the read yields are built
            if name == "value":
                out.append(columns.column(1))
            elif name == "key":
                out.append(columns.column(0))
            elif name == "offset":
                out.append(pc.add(counting.slice(0, n), block.first_offset))
            elif name == "topic":
                out.append(topics.slice(0, n))
            elif name == "partition":
                out.append(partitions.slice(0, n))
            elif name == "timestamp":  # Spark's timestamps are microseconds
                stamps = pc.multiply(pc.add(columns.column(2), block.base_timestamp_ms), 1000)
                out.append(stamps.view(self._stamp_type))
            else:
                headers = columns.column(3)
                if not len(headers.values):  # no record of the stored batch has headers
                    out.append(no_headers.slice(0, n))
                else:
                    out.append(headers.cast(self._headers_type))
        return pa.RecordBatch.from_arrays(out, schema=self.schema)


# Per Python worker process: the Client its read tasks share (pyspark reuses a worker for
# the next tasks), by cluster settings: {key: (client, made at)}. A read task then skips
# the Client's set-up (a GetMetadata call, a channel and its connection to each server):
# about 18 ms of a task's wall time and 4 ms of its CPU here, on the cluster's side one
# metadata read of ZooKeeper. Kept for TASK_CLIENT_MAX_AGE_S at most, so a worker long
# idle starts again from fresh metadata (stale routes are refreshed on errors anyway).
# `_TASK_CLIENTS_PID`: the process they belong to (a forked worker starts without them).
_TASK_CLIENTS: dict = {}
_TASK_CLIENTS_PID = [0]
TASK_CLIENT_MAX_AGE_S = 60.0


def _task_client(options: Options):
    """This worker's shared Client for `options`' cluster (not to be closed by the task)."""
    import os
    import time

    if _TASK_CLIENTS_PID[0] != os.getpid():  # forked: the parent's clients are not ours
        _TASK_CLIENTS.clear()
        _TASK_CLIENTS_PID[0] = os.getpid()
    now = time.monotonic()
    for key, (client, made) in list(_TASK_CLIENTS.items()):
        if now - made > TASK_CLIENT_MAX_AGE_S:
            del _TASK_CLIENTS[key]
            client.close()
    key = (tuple(options.bootstrap), options.tls, options.token_file,
           options.request_timeout_s)
    if key not in _TASK_CLIENTS:
        _TASK_CLIENTS[key] = (options.client(), now)
    return _TASK_CLIENTS[key][0]


def _read_range(options: Options, part: OffsetRange, schema: StructType | None = None):
    """The records of one range, in offset order, as Arrow record batches of SCHEMA (or
    of the columns of `schema`, a subset of SCHEMA's: _check_read_schema)."""
    from spark_client.consumer import Consumer

    if not isinstance(part, OffsetRange):
        return  # Spark's stand-in partition when planning found no range: no rows
    spark = _SparkColumns(part.topic, part.partition, schema)
    consumer = Consumer(_task_client(options), part.topic, isolation=options.isolation,
                        partitions=[part.partition], request_timeout_s=options.request_timeout_s)
    key = (part.topic, part.partition)
    try:
        consumer.seek(part.topic, part.partition, part.start)
        ends = {key: part.end}
        idle_s = max(60.0, 4 * options.request_timeout_s)
        while True:
            try:
                for blocks in consumer.read_until(ends, idle_timeout_s=idle_s, arrow="blocks",
                                                  max_records=1 << 20):
                    for block in blocks:
                        yield spark.batch(block)
                return
            except errors.AtomlogClientError as error:
                if options.fail_on_data_loss or error.reason != "OFFSET_OUT_OF_RANGE":
                    raise
                # Deleted before they were read (retention, DeleteRecords): with
                # failOnDataLoss=false, on from the log start. (Before, such a range
                # failed every attempt and every restart of the query, for good.)
                position = consumer.position(part.topic, part.partition)
                log_start = consumer.beginning_offsets()[key]
                if log_start <= position:
                    raise  # (not a deletion: nothing to skip)
                _log.warning("atomlog: records %d-%d of %s-%d were deleted before they were "
                             "read; skipped (failOnDataLoss=false)", position,
                             min(log_start, part.end) - 1, part.topic, part.partition)
                if log_start >= part.end:
                    return
                consumer.seek(part.topic, part.partition, log_start)
    finally:
        consumer.close()


class BatchReader(DataSourceReader):
    """Ranges pinned at planning: [startingOffsets, endingOffsets) per partition, where
    latest is the max read position (read_committed) or the high watermark."""

    def __init__(self, options: Options, schema: StructType):
        _check_read_schema(schema)
        self.options = options
        self.schema = schema
        client = options.client()
        try:
            _topics_or_fail(options, client)
            with _Positions(options, client) as positions:
                self.start = positions.offsets(options.starting, default_latest=False)
                self.end = positions.offsets(options.ending, default_latest=True)
        finally:
            client.close()

    def partitions(self) -> list[OffsetRange]:
        return _ranges(self.start, self.end, self.options.max_offsets_per_split)

    def read(self, partition: OffsetRange):
        return _read_range(self.options, partition, self.schema)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets {topic: {"partition": next offset}}; admission control through
    maxRecordsPerTrigger (ReadMaxRows), and Trigger.AvailableNow."""

    def __init__(self, options: Options, schema: StructType):
        _check_read_schema(schema)
        self.options = options
        self.schema = schema
        self._client = None
        _topics_or_fail(options, self.client)
        self._target: dict | None = None  # AvailableNow: the end fixed at its start
        self._initial: dict | None = None  # initialOffset, resolved once (below)

    @property
    def client(self):
        """The driver's client, made on first use (never pickled to the tasks)."""
        if self._client is None:
            self._client = self.options.client()
        return self._client

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}

    def initialOffset(self) -> dict:
        """Resolved once per reader: Spark asks for it when it plans micro-batch 0's end
        and again when it runs the batch, and a "latest" resolved anew the second time
        read past what was planned (the records between were in no micro-batch). A
        driver restarted before batch 0 committed resolves it again (documented)."""
        if self._initial is None:
            self._initial = _offsets(self.options, self.client, self.options.starting,
                                     default_latest=False)
        return json.loads(json.dumps(self._initial))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_records_per_trigger:
            return ReadMaxRows(self.options.max_records_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def _latest(self) -> dict:
        return _offsets(self.options, self.client, "latest", default_latest=True)

    def reportLatestOffset(self) -> dict:
        return self._latest()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        end = self._target if self._target is not None else self._latest()
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return cap_offsets(self._starts(start, end), end, budget)

    def partitions(self, start: dict, end: dict) -> list[OffsetRange]:
        return _ranges(self._starts(start, end), end, self.options.max_offsets_per_split)

    def _starts(self, start: dict, end: dict) -> dict:
        """`start`, with a partition it does not name (a topic added to the query, as a
        restart from its checkpoint sees it) at the partition's log start, not offset 0:
        after retention, 0 failed every read of it (OFFSET_OUT_OF_RANGE), and the same
        start was planned again at every restart."""
        missing = any(p not in start.get(topic, {}) for topic, parts in end.items()
                      for p in parts)
        if not missing:
            return start
        earliest = _offsets(self.options, self.client, "earliest", default_latest=False)
        return {topic: {p: start.get(topic, {}).get(p, earliest.get(topic, {}).get(p, 0))
                        for p in parts} for topic, parts in end.items()}

    def read(self, partition: OffsetRange):
        return _read_range(self.options, partition, self.schema)

    def commit(self, end: dict) -> None:
        pass  # positions live in Spark's checkpoint

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def cap_offsets(start: dict, end: dict, budget: int | None) -> dict:
    """`end`, but at most `budget` offsets past `start` in all, shared fairly: every
    partition with data gets an equal share, and what a small partition does not use goes
    to the others. Never moves a partition backwards. Pure."""
    lag = {}
    for topic, partitions in end.items():
        for p, offset in partitions.items():
            first = start.get(topic, {}).get(p, 0)
            lag[(topic, p)] = (first, max(first, offset))
    if budget is None or sum(e - s for s, e in lag.values()) <= budget:
        grant = {k: e - s for k, (s, e) in lag.items()}
    else:
        grant = {k: 0 for k in lag}
        wanting = {k for k, (s, e) in lag.items() if e > s}
        left = budget
        while left > 0 and wanting:
            share = max(1, left // len(wanting))
            for k in sorted(wanting):
                s, e = lag[k]
                take = min(share, e - s - grant[k], left)
                grant[k] += take
                left -= take
                if s + grant[k] >= e:
                    wanting.discard(k)
                if left == 0:
                    break
    out: dict[str, dict[str, int]] = {}
    for (topic, p), (s, _) in lag.items():
        out.setdefault(topic, {})[p] = s + grant[(topic, p)]
    return out


# ---------------------------------------------------------------------------- writes
@dataclass
class ChildCommit(WriterCommitMessage):
    """What a task attempt hands the driver: its prepared child (or why it has none)."""

    parent: tuple[int, int] | None
    child: tuple[int, int] | None
    rows: int = 0
    skipped: str = ""  # why nothing was written (e.g. "parent COMMITTED": a replay)
    # A micro-batch's place in its query's stream (query_stream), which the driver's
    # commit of the parent carries (None for a batch write).
    stream: tuple[str, int] | None = None


def _check_write_schema(schema: StructType, options: Options) -> None:
    names = [f.name for f in schema.fields]
    unknown = [n for n in names if n not in _WRITE_COLUMNS]
    problems = []
    if "value" not in names:
        problems.append("a column `value` (binary or string) is required")
    if unknown:
        problems.append(f"unknown column(s) {unknown}; allowed: {sorted(_WRITE_COLUMNS)}")
    types = {f.name: f.dataType for f in schema.fields}
    for name in ("value", "key"):
        if name in types and not isinstance(types[name], (BinaryType, StringType)):
            problems.append(f"column `{name}` must be binary or string, not "
                            f"{types[name].simpleString()}")
    if "partition" in types and not isinstance(types["partition"], (IntegerType, LongType)):
        problems.append("column `partition` must be an integer")
    if "topic" in types and not isinstance(types["topic"], StringType):
        problems.append("column `topic` must be a string")
    if "headers" in types:
        h = types["headers"]
        ok = (isinstance(h, MapType) and isinstance(h.keyType, StringType)
              and isinstance(h.valueType, (BinaryType, StringType))) or (
            isinstance(h, ArrayType) and isinstance(h.elementType, StructType)
            and [f.name for f in h.elementType.fields] == ["key", "value"])
        if not ok:
            problems.append("column `headers` must be map<string,binary|string> or "
                            "array<struct<key:string,value:binary|string>>")
    if "topic" not in types and len(options.topics) != 1:
        problems.append("give exactly one topic (option topic) or a `topic` column")
    if problems:
        raise OptionError("cannot write this DataFrame to atomlog: " + "; ".join(problems))


# How many producer batches' worth of rows a task hands send_batch() at once: Spark's
# Arrow batches (10,000 rows by default, about 1.3 MB of 100-byte values) are gathered
# until they fill this many, so a call is cut into full batches of one partition
# instead of one full and one partial batch per Spark batch. Keyless rows of one call
# go to one partition, the next call to the next: a task spreads its rows over its
# partitions about every 4 MiB (with the default batchMaxBytes).
_BATCHES_PER_CALL = 4


def _row_bytes(batch) -> int:
    """About what a Spark Arrow batch's rows weigh in producer batches (values, keys
    and a per-row overhead; headers' bytes counted by their buffers)."""
    from spark_client.columns import ROW_OVERHEAD

    return batch.nbytes + batch.num_rows * ROW_OVERHEAD


def _gathered(batches, limit_bytes: int):
    """Spark's Arrow batches, gathered into lists of about `limit_bytes` (in order)."""
    pending, size = [], 0
    for batch in batches:
        if not batch.num_rows:
            continue
        pending.append(batch)
        size += _row_bytes(batch)
        if size >= limit_bytes:
            yield pending
            pending, size = [], 0
    if pending:
        yield pending


def _write_rows(options: Options, client, txn, batches) -> int:
    """Send every row of the Arrow batches in `txn`, several Spark batches at a time
    through send_batch() (no Python per row); returns how many."""
    import pyarrow as pa
    import pyarrow.compute as pc

    producer = client.producer(batch_max_bytes=options.batch_max_bytes,
                               linger_ms=options.linger_ms, compression=options.compression)
    default_topic = options.topics[0] if len(options.topics) == 1 else None
    rows = 0
    try:
        for group in _gathered(batches, _BATCHES_PER_CALL * options.batch_max_bytes):
            table = pa.Table.from_batches(group)
            names = table.schema.names
            if "topic" not in names:
                groups = [(default_topic, table)]
            else:
                topics = table.column("topic")
                if default_topic is not None:
                    topics = pc.fill_null(topics, default_topic)
                if topics.null_count:
                    first = pc.indices_nonzero(topics.is_null())[0].as_py()
                    raise OptionError(f"row {rows + first} has no topic")
                rest = table.drop_columns(["topic"])
                groups = [(topic, rest.filter(pc.equal(topics, topic)))
                          for topic in pc.unique(topics).to_pylist()]
            for topic, columns in groups:
                producer.send_batch(topic, columns, txn=txn)
            rows += table.num_rows
        producer.flush()
    finally:
        producer.close(timeout=options.request_timeout_s)
    return rows


def _peek(batches) -> tuple[bool, Iterator]:
    """Whether there is at least one row, and the batches unchanged."""
    iterator = iter(batches)
    for batch in iterator:
        if batch.num_rows:
            def chained(first=batch):
                yield first
                yield from iterator
            return True, chained()
    return False, iter(())


class _ParentKeepAlive:
    """While a task runs, its write's parent stays open: NewTxn with the parent's key
    every third of its timeout restarts the timeout (a thread: the task's own thread
    waits in Spark's iterator for its first row, which a sort or an aggregation upstream
    may take longer than the timeout to give). It stops at the task's end, or when the
    key no longer opens that parent (decided, or replaced after a timeout). So the
    timeout bounds how long a write outlives its last task, as after a dead driver, and
    not how long a task may compute."""

    def __init__(self, options: Options, client, key: str, parent: tuple[int, int],
                 stream: tuple[str, int] | None = None):
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run,
                                        args=(options, client, key, parent, stream),
                                        name="atomlog-parent-keep-alive", daemon=True)
        self._thread.start()

    def _run(self, options: Options, client, key: str, parent: tuple[int, int],
             stream: tuple[str, int] | None) -> None:
        from spark_client.transactions import Transaction

        interval = max(0.5, options.transaction_timeout_s / 3)
        while not self._stopped.wait(interval):
            try:
                again = Transaction(client, options.transaction_timeout_s, key=key,
                                    stream=stream)
            except errors.AtomlogClientError as error:
                if error.reason == "STREAM_ORDINAL_COMMITTED":
                    return  # the micro-batch committed (its key since forgotten)
                continue  # tried again next interval; the task decides
            except Exception:  # noqa: BLE001 — tried again next interval; the task decides
                continue
            if again.key != parent or again.state_at_open != "OPEN":
                if again.key != parent and again.state_at_open == "OPEN":
                    again.abort()  # opened anew by the key: not this write's parent
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=1.0)  # (a call under way ends on its own; nothing waits)


def _write_child(options: Options, parent_key: str, batches,
                 stream: tuple[str, int] | None = None) -> ChildCommit:
    """One task attempt: open the parent by its key (the first task of the write creates
    it, every later one finds it and restarts its timeout; a keep-alive restarts it
    while the task runs), open a child under it, write, prepare. A parent already
    decided (a replayed micro-batch) means: write nothing; so does a micro-batch whose
    `stream` (query, batch id) committed it already, its parent since forgotten. An
    exception aborts the child (best effort) and fails the attempt."""
    from spark_client.transactions import Transaction

    client = options.client()
    child = None
    keep_alive = None
    try:
        try:
            parent = Transaction(client, options.transaction_timeout_s, key=parent_key,
                                 stream=stream)
        except errors.AtomlogClientError as error:
            if error.reason != "STREAM_ORDINAL_COMMITTED":
                raise
            return ChildCommit(parent=None, child=None, skipped=_committed_already(error))
        if parent.state_at_open != "OPEN":
            return ChildCommit(parent=parent.key, child=None,
                               skipped=f"parent {parent.state_at_open}")
        keep_alive = _ParentKeepAlive(options, client, parent_key, parent.key, stream)
        has_rows, batches = _peek(batches)
        if not has_rows:
            return ChildCommit(parent=parent.key, child=None, skipped="no rows")
        try:
            child = Transaction(client, options.child_timeout_s, parent=parent)
        except errors.AtomlogClientError as error:
            if error.reason != "PARENT_NOT_OPEN":
                raise
            return ChildCommit(parent=parent.key, child=None,
                               skipped=f"parent {error.metadata.get('parent_state', 'decided')}")
        rows = _write_rows(options, client, child, batches)
        child.prepare(options.prepared_timeout_s)
        return ChildCommit(parent=parent.key, child=child.key, rows=rows)
    except BaseException:
        if child is not None:
            try:
                child.abort()
            except Exception:  # noqa: BLE001 — the parent's decision aborts it anyway
                pass
        raise
    finally:
        if keep_alive is not None:
            keep_alive.stop()
        client.close()


class BatchWriter(DataSourceArrowWriter):
    """Built on the driver, before the job: picks the parent's key. Pickled to the tasks
    (the first opens the parent by the key) and to commit/abort. The parent is not
    opened here: the stages before the write (a shuffle, a sort) may run longer than its
    timeout before any task writes."""

    def __init__(self, options: Options, schema: StructType):
        _check_write_schema(schema, options)
        self.options = options
        client = options.client()
        try:
            _check_topics_exist(options, client)
        finally:
            client.close()
        self.parent_key = f"spark-write:{uuid.uuid4()}"

    def write(self, iterator) -> ChildCommit:
        return _write_child(self.options, self.parent_key, iterator)

    def commit(self, messages: list[ChildCommit | None]) -> None:
        parent = _one_parent(self.options, messages, "the write")
        if parent is not None:
            _commit_parent(self.options, parent, messages)

    def abort(self, messages: list[ChildCommit | None]) -> None:
        _abort_parents(self.options, messages, self.parent_key)


def _one_parent(options: Options, messages: list[ChildCommit | None],
                what: str) -> tuple[int, int] | None:
    """The one parent the tasks' messages name (None if none does). Several: the parent
    timed out while no task kept it open, and later tasks opened a new one by its key;
    every one is aborted and the write fails (Spark runs a micro-batch again)."""
    parents = {m.parent for m in messages if m is not None and m.parent is not None}
    if len(parents) > 1:
        for parent in parents:
            _abort_parent(options, parent)
        raise errors.error_for("TRANSACTION_TIMED_OUT", f"{what} outlived its parent's "
                               "timeout (transactionTimeoutMs) between its tasks")
    return parents.pop() if parents else None


def _abort_parents(options: Options, messages: list[ChildCommit | None],
                   key: str | None = None) -> None:
    """Abort the parents the messages name and, given its key, the one the key opens
    now (a task that failed may have opened it, and its message is not given)."""
    from spark_client.transactions import Transaction

    for parent in {m.parent for m in messages if m is not None and m.parent is not None}:
        _abort_parent(options, parent)
    if key is not None:
        client = options.client()
        try:
            found = Transaction(client, options.transaction_timeout_s, key=key)
            if found.state_at_open == "OPEN":
                found.abort()
        finally:
            client.close()


def _commit_parent(options: Options, parent_id: tuple[int, int],
                   messages: list[ChildCommit | None],
                   stream: tuple[str, int] | None = None) -> list:
    """Commit the parent keeping the children of these (successful) attempts; waits for
    the markers, so the rows are readable when Spark's write returns. A micro-batch's
    parent commits as its place in its query's `stream`."""
    from spark_client.transactions import Transaction

    children = [m.child for m in messages if m is not None and m.child is not None]
    client = options.client()
    try:
        parent = Transaction.resume(client, parent_id, options.transaction_timeout_s, stream)
        try:
            parent.commit(wait_for_markers=True, keep_children=children)
        except errors.AtomlogClientError as unknown:
            if not unknown.retriable:
                raise
            # No answer within the call's retries: the decision may be logged already.
            # Asked once more (EndTxn is idempotent: a parent committed with these
            # children answers so). Still no answer: say that the write may have
            # committed, so that nobody writes it again blindly (Spark reports the
            # write failed, and a new write of the same rows would duplicate them).
            try:
                parent.commit(wait_for_markers=True, keep_children=children)
            except errors.AtomlogClientError as again:
                if not again.retriable:
                    raise
                name = f"{parent_id[0]}:{parent_id[1]}"
                raise errors.error_for(
                    again.reason, f"the commit of parent transaction {name} has an unknown "
                    f"outcome ({again.message}): the write may have committed; "
                    f"`atomlog txn describe {name}` says, before it is written again",
                    {**again.metadata, "txn_id": name}) from None
        kept = {(c.tc_partition, c.sequence) for c in parent.kept_children}
        if not set(children) <= kept:
            # A retried commit of a parent decided earlier with other children: the
            # rows of this attempt are not what was committed.
            raise errors.error_for("INTERNAL", f"parent {parent_id[0]}:{parent_id[1]} was "
                                   f"committed with children {sorted(kept)}, not {children}")
        return sorted(kept)
    finally:
        client.close()


def _abort_parent(options: Options, parent_id: tuple[int, int]) -> None:
    from spark_client.transactions import Transaction

    client = options.client()
    try:
        Transaction.resume(client, parent_id, options.transaction_timeout_s).abort()
    finally:
        client.close()


def stream_parent_key(query_id: str, batch_id: int | str) -> str:
    return f"spark-stream:{query_id}:{batch_id}"


def query_stream(query_id: str, batch_id: int | str) -> tuple[str, int]:
    """A micro-batch's place in its query's stream (coordinator.proto, TxnStream): the
    query's TC partition keeps the highest batch id committed for days (7 by default),
    so a replay of a committed micro-batch writes nothing however long after it comes,
    where the parent's key alone is remembered only while its TC partition retains
    finished transactions (transaction.max_finished, finished_grace_ms)."""
    return f"spark-stream:{query_id}", int(batch_id)


_COMMITTED_ALREADY = "micro-batch committed already"


def _committed_already(error) -> str:
    return (f"{_COMMITTED_ALREADY} (stream {error.metadata.get('stream', '?')}, up to batch "
            f"{error.metadata.get('committed_ordinal', '?')})")


class StreamWriter(DataSourceStreamArrowWriter):
    """A parent per (query id, batch id), opened by the tasks through its key; the
    driver's commit(messages, batchId) commits it keeping the messages' children."""

    def __init__(self, options: Options, schema: StructType):
        _check_write_schema(schema, options)
        if options.source_subscription and not options.checkpoint:
            raise OptionError("sourceSubscription needs the query's checkpointLocation option "
                              "(the batch's source offsets are read from it)")
        if options.source_subscription:
            _checkpoint_files(options.checkpoint)  # a location pyarrow cannot open fails now
        self.options = options
        client = options.client()
        try:
            _check_topics_exist(options, client)
        finally:
            client.close()

    def write(self, iterator) -> ChildCommit:
        from pyspark import TaskContext

        context = TaskContext.get()
        query_id = context.getLocalProperty("sql.streaming.queryId")
        batch_id = context.getLocalProperty("streaming.sql.batchId")
        if not query_id or batch_id is None:
            raise OptionError("the atomlog stream writer runs only inside a streaming query")
        stream = query_stream(query_id, batch_id)
        message = _write_child(self.options, stream_parent_key(query_id, batch_id), iterator,
                               stream)
        message.stream = stream
        return message

    def commit(self, messages: list[ChildCommit | None], batchId: int) -> None:
        stream = next((m.stream for m in messages if m is not None and m.stream), None)
        if self.options.source_subscription:
            # The acks need the batch's parent even when no task wrote a row.
            parent, stream = _ack_source_positions(self.options, batchId)
            messages = [*messages, ChildCommit(
                parent=parent, child=None,
                skipped="acks" if parent is not None else f"{_COMMITTED_ALREADY}: no acks")]
        parent = _one_parent(self.options, messages, f"micro-batch {batchId}")
        if parent is None:  # nothing written, or committed already (a replay)
            skipped = next((m.skipped for m in messages if m is not None
                            and m.skipped.startswith(_COMMITTED_ALREADY)), None)
            if skipped is not None:
                _log.info("micro-batch %s: %s; nothing written again", batchId, skipped)
            return
        try:
            _commit_parent(self.options, parent, messages, stream)
        except errors.AtomlogClientError as error:
            if error.reason != "STREAM_ORDINAL_COMMITTED":
                raise
            # Another parent of this micro-batch committed it (its tasks ran before that
            # commit, by a key since forgotten): this one is redundant.
            _log.warning("micro-batch %s: %s; its other parent %s:%s is aborted", batchId,
                         _committed_already(error), *parent)
            _abort_parent(self.options, parent)

    def abort(self, messages: list[ChildCommit | None], batchId: int) -> None:
        _abort_parents(self.options, messages)


# ---------------------------------------------------------------------------- source acks
def _checkpoint_files(location: str):
    """(file system, base path) of a checkpoint location: a local path, or a URI of any
    file system pyarrow reaches (file://, hdfs://, s3://, gs://, abfs://, ...)."""
    from pyarrow import fs

    if "://" not in location and not location.startswith("file:"):
        return fs.LocalFileSystem(), str(Path(location).absolute())
    if location.startswith("file:") and not location.startswith("file://"):
        location = "file://" + location[len("file:"):]  # Hadoop's file:/path form
    try:
        return fs.FileSystem.from_uri(location)
    except Exception as error:  # noqa: BLE001 — pyarrow raises several types here
        raise OptionError(f"sourceSubscription reads the checkpoint's offset log, and "
                          f"pyarrow cannot open {location!r}: {error}") from None


def _read_checkpoint_file(files, base: str, *parts: str) -> str:
    with files.open_input_stream("/".join([base.rstrip("/"), *parts])) as stream:
        return stream.read().decode()


def source_positions(checkpoint: str, batch_id: int) -> tuple[str, dict[tuple[str, int], int]]:
    """The query id and the end offsets of micro-batch `batch_id`, per (topic, partition),
    from the checkpoint's offset log (written by Spark before the batch runs): line 1 is
    the log version, line 2 the batch metadata, then one line per source with its offset
    JSON. Sources whose offsets have the atomlog shape {topic: {partition: offset}} count."""
    files, base = _checkpoint_files(checkpoint)
    query_id = json.loads(_read_checkpoint_file(files, base, "metadata"))["id"]
    lines = _read_checkpoint_file(files, base, "offsets", str(batch_id)).splitlines()
    positions: dict[tuple[str, int], int] = {}
    for line in lines[2:]:
        try:
            offsets = json.loads(line)
        except ValueError:
            # Offset log format 2 (spark.sql.streaming.offsetLog.formatVersion): each
            # source's line is "<its name>:<its offset JSON>" (read as nothing until
            # 2026-12-06: no source acked, silently). Else "-": no data in this batch.
            _, colon, rest = line.partition(":")
            try:
                offsets = json.loads(rest) if colon else None
            except ValueError:
                continue
            if offsets is None:
                continue
        if isinstance(offsets, dict) and all(
                isinstance(parts, dict) and all(isinstance(o, int) for o in parts.values())
                for parts in offsets.values()):
            for topic, parts in offsets.items():
                for partition, offset in parts.items():
                    positions[(topic, int(partition))] = offset
    return query_id, positions


def _previous_positions(checkpoint: str, batch_id: int) -> dict[tuple[str, int], int]:
    """The source end offsets of the micro-batch before `batch_id` (where this one's
    reading began); empty for the first batch, or when its offset log entry is gone."""
    if batch_id <= 0:
        return {}
    try:
        return source_positions(checkpoint, batch_id - 1)[1]
    except FileNotFoundError:
        return {}


def _ack_source_positions(options: Options, batch_id: int
                          ) -> tuple[tuple[int, int] | None, tuple[str, int]]:
    """Cumulatively ack the micro-batch's source end offsets on `sourceSubscription`, in
    the micro-batch's parent transaction (opened here by its key when no task did).
    Returns the parent (None: the query's stream committed the micro-batch already) and
    the micro-batch's place in the stream; when the parent is already decided (a
    replay), acks nothing."""
    from atomlog.v1 import common_pb2

    from spark_client.transactions import Transaction

    query_id, positions = source_positions(options.checkpoint, batch_id)
    # Only the partitions this micro-batch read from: the batch before it committed its
    # own ends, and a cumulative ack that acknowledges nothing new is refused
    # (TRANSACTION_CONFLICT: it is how two consumers of the same offsets are told
    # apart), so a partition without new data would fail this batch and every replay.
    previous = _previous_positions(options.checkpoint, batch_id)
    client = options.client()
    try:
        known = set(client.list_topics())
        positions = {k: v for k, v in positions.items()
                     if k[0] in known and v > max(previous.get(k, 0), 0)}
        stream = query_stream(query_id, batch_id)
        try:
            parent = Transaction(client, options.transaction_timeout_s,
                                 key=stream_parent_key(query_id, batch_id), stream=stream)
        except errors.AtomlogClientError as error:
            if error.reason != "STREAM_ORDINAL_COMMITTED":
                raise
            return None, stream
        if parent.state_at_open != "OPEN":
            return parent.key, stream
        name = options.source_subscription
        targets = sorted(positions)
        by_server: dict[str, list[tuple[str, int]]] = {}
        for topic, partition in targets:
            by_server.setdefault(client.metadata.route(topic, partition).address, []).append(
                (topic, partition))
        parent.register_subscriptions((t, p, name) for t, p in targets)
        for address, group in by_server.items():
            stub = client.channels.partition(address)
            cursors = [common_pb2.SubscriptionPartition(topic=t, partition=p, subscription=name)
                       for t, p in group]
            try:
                created, acked = _create_and_ack(stub, options, cursors, group, positions,
                                                 parent.txn_id, first=not previous)
            except grpc.RpcError as rpc_error:
                raise errors.from_grpc(rpc_error) from None
            for result in list(created.results) + list(acked.results):
                if result.error.reason:
                    raise errors.error_for(result.error.reason, result.error.message,
                                           dict(result.error.metadata))
        return parent.key, stream
    finally:
        client.close()


def _create_and_ack(stub, options: Options, cursors, group, positions, txn_id,
                    first: bool = False):
    """Create the cursors if missing (from the earliest offset), then ack in txn_id.
    `first` (a query's first micro-batch, no positions before it): a cursor already at
    or past its position is not acked. The batch before would have told which
    partitions moved; without it, a new query taking over a subscription whose cursors
    stood at the ends acked its idle partitions at their cursors, which is refused
    (TRANSACTION_CONFLICT), and micro-batch 0 failed on every replay, for good."""
    from atomlog.v1 import partition_pb2

    created = stub.CreateSubscription(partition_pb2.CreateSubscriptionRequest(
        subscription_partitions=cursors,
        initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_EARLIEST),
        timeout=options.request_timeout_s)
    standing = {(r.subscription_partition.topic, r.subscription_partition.partition):
                r.cumulative_end_offset for r in created.results if not r.error.reason}
    items = [partition_pb2.AckItem(subscription_partition=cursor,
                                   cumulative_end_offset=positions[(t, p)], txn_id=txn_id)
             for cursor, (t, p) in zip(cursors, group, strict=True)
             if not first or positions[(t, p)] > standing.get((t, p), -1)]
    acked = stub.Ack(partition_pb2.AckRequest(items=items), timeout=options.request_timeout_s) \
        if items else partition_pb2.AckResponse()
    return created, acked
