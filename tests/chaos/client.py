"""Workload client processes of a chaos run. Each is its own OS process (the nemesis may
kill it), writes its half of the history through `EventLog`, and stops at SIGTERM or at
its deadline, finishing the operation in hand.

    python -m tests.chaos.client ROLE --run-dir D --name NAME --seed S

Roles (see docs/verification.md):
  producer     idempotent sends of unique values, up to 8 in flight
  txn          transactions of 1-4 partitions over 1-2 topics, 80% commit, 20% abort;
               half commit with commit_async(), up to 8 committing while the next send
  session      Kafka-style transactional-id sessions; every few transactions a second
               session takes the id (fence) while the first has a transaction open, and
               the first then tries to commit it (it must fail)
  reader       an assigned-partition reader (--isolation) of every topic, restarting from
               the offsets it reached, or from earlier ones, every few polls
  feeder       ctp: idempotent sends of the input values
  ctp          ctp: consume-transform-produce through the subscription with
               transactional acks, the way tests/ctp_loop.py does it; ctp-1 on the
               streaming transaction path with 2 s transaction timeouts, taking an
               aborted round's inputs again as they were (the same records to the same
               partitions)
  cursors      ctp: observes the subscription's cursors every 0.5 s
  driver       spark-lite: jobs of parent and prepared child transactions, as the Spark
               writer runs them, some with failed or speculative attempts, and one in ten
               abandoned by a "dead" driver; the jobs are the steps of a stream, as a
               streaming query's micro-batches, replayed (sometimes by a key the
               coordinator is taken to have forgotten) when not known to have committed
  trimmer      log: idempotent sends of padded values to the trim topic, and every few
               sends a DeleteRecords (Client.delete_records) below one of its own
               acknowledged offsets, so segments of a replicated partition are deleted
               while the nemesis fails leaders over (the checker's resurrected-delete)

The run directory's workload.json says which topics exist and the settings of the run.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

from spark_client import Client, TlsConfig, errors
from tests.chaos.history import EventLog

SEND_TIMEOUT_S = 15.0
TRIM_PAD = "|" + "x" * 2_000  # values of ~2 KB: the trim topic's 64 KiB segments roll


def trim_value(data: bytes) -> str:
    """A trim topic record's value as the trimmer logged it (its padding cut)."""
    return data.decode(errors="replace").split("|", 1)[0]


CTP_BATCH_RECORDS = (3, 50)  # inputs per ctp transaction (3: one per partition server)
# A ctp worker's consumer receives this many inputs beyond each poll's (its pick, per
# consumer): what it holds is leased to it until acked, expired or released on close.
CTP_PREFETCH = (0, 0, 50, 200)
TRANSFORM_PREFIX = "out:"
MAX_ASYNC_COMMITS = 8  # txn: commit_async() commits in flight at once (chains up to 8)
ASYNC_COMMIT_WAIT_S = 90.0  # longer than any commit retries (then: unknown)
STREAMING_CTP_WORKER = "ctp-1"
CTP_RETRIES = 2  # the streaming worker: rounds an aborted round's inputs are taken again
STREAMING_TXN_TIMEOUT_S = 2.0  # the streaming worker's transaction timeout
RETRY_PAUSE_S = (0.2, 0.6)  # before it takes an aborted round's inputs again


class Stop:
    """Set by SIGTERM or the deadline: the loop finishes what it does and leaves."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, *_args) -> None:
        self.requested = True

    def __bool__(self) -> bool:
        return self.requested or time.time() >= self.deadline

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def _reason(error: BaseException) -> str:
    return getattr(error, "reason", type(error).__name__)


def _records(messages) -> list:
    """[topic, partition, offset, value] of poll()'s messages or a poll_arrow() table."""
    if hasattr(messages, "column_names"):
        messages = zip(*(messages.column(name).to_pylist()
                         for name in ("topic", "partition", "offset", "value")))
        return [[t, p, o, (v or b"").decode(errors="replace")] for t, p, o, v in messages]
    return [[m.topic, m.partition, m.offset, (m.value or b"").decode(errors="replace")]
            for m in messages]


def send_writes(rng, producer, writes: list, txn) -> None:
    """Send a transaction's [topic, partition, value] writes: one send() each, or (half
    the transactions) one send_batch() per partition, in the same order per partition."""
    if rng.random() < 0.5:
        for topic, partition, value in writes:
            producer.send(topic, value.encode(), partition=partition, txn=txn)
        return
    by_partition: dict = {}
    for topic, partition, value in writes:
        by_partition.setdefault((topic, partition), []).append(value.encode())
    for (topic, partition), values in by_partition.items():
        producer.send_batch(topic, values, partition=partition, txn=txn)


class StreamPlace:
    """A spark-lite driver's place in its stream, kept in the run directory across its
    incarnations as a streaming query keeps its offset and commit logs in its
    checkpoint: the step under way, and whether it is known to have committed. A killed
    driver's next incarnation replays a step not known to have committed."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = {"ordinal": 0, "done": False}
        self.ordinal = kept["ordinal"] + (1 if kept["done"] else 0)
        self.replay = not kept["done"] and path.exists()  # (it may have committed)

    def _keep(self, done: bool) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"ordinal": self.ordinal, "done": done}))
        temporary.replace(self.path)

    def begin(self) -> None:
        self._keep(False)

    def committed(self, forget_it: bool = False) -> None:
        """The step committed: the next one follows, unless `forget_it` (the commit log's
        entry lost: the step is replayed, and must be found committed)."""
        if forget_it:
            self.replay = True
            return
        self._keep(True)
        self.ordinal += 1
        self.replay = False

    def again(self) -> None:
        """The step did not commit, or may have: it runs again."""
        self.replay = True


def close_quietly(producer) -> None:
    """Close a producer whose records may never be acknowledged (a fenced session):
    close() waits 5 s for them, then gives up (their outcomes are unknown already)."""
    try:
        producer.close(timeout=5)
    except (errors.AtomlogClientError, TimeoutError):
        pass


class Workload:
    def __init__(self, args):
        self.args = args
        self.spec = json.loads((Path(args.run_dir) / "workload.json").read_text())
        self.rng = random.Random(f"{args.seed}/{args.name}")
        self.log = EventLog(Path(args.run_dir), args.name)
        self.stop = Stop(self.spec["deadline"])
        tls = TlsConfig(**self.spec["tls"]) if self.spec.get("tls") else None  # --tls runs
        # ctp-1: the streaming transaction path (sends under its own producer's sequence
        # numbers), as the Go client and larger SDK transactions take it.
        self.streaming = args.name == STREAMING_CTP_WORKER
        self.client = Client(self.spec["bootstrap"], request_timeout_s=10.0, tls=tls,
                             **({"one_call_max_bytes": 0} if self.streaming else {}))
        self.topics: dict[str, int] = self.spec["topics"]
        self.txn_timeout_s = self.spec["txn_timeout_s"]
        self.counter = 0

    def value(self, prefix: str = "") -> str:
        self.counter += 1
        return f"{prefix}{self.args.name}-{self.spec['incarnations'].get(self.args.name, 0)}" \
               f"-{self.counter}-{self.rng.randrange(1 << 30):x}"

    def data_topics(self) -> list[str]:
        return [t for t in self.topics if t in self.spec["data_topics"]]

    # ------------------------------------------------------------------ sends
    def run_producer(self, topics: list[str] | None = None, prefix: str = "") -> None:
        topics = topics or self.data_topics()
        with self.client.producer(linger_ms=2, delivery_timeout_s=SEND_TIMEOUT_S) as producer:
            while not self.stop:
                pending = []
                for _ in range(self.rng.randint(1, 8)):
                    topic = self.rng.choice(topics)
                    partition = self.rng.randrange(self.topics[topic])
                    value = self.value(prefix)
                    self.send_logged(producer, "send", topic, partition, value,
                                     value.encode(), pending)
                self.settle_sends(pending)
                self.stop.sleep(self.rng.uniform(0, 0.05))

    def send_logged(self, producer, f: str, topic: str, partition: int, value: str,
                    payload: bytes, pending: list) -> None:
        """One send invoked as op `f` (its future into `pending`; a refusal at once is an
        unknown outcome)."""
        op = self.log.invoke(f, topic=topic, partition=partition, value=value)
        try:
            pending.append((op, producer.send(topic, payload, partition=partition)))
        except errors.AtomlogClientError as error:
            self.log.complete(op, "unknown", error=_reason(error))

    def settle_sends(self, pending: list) -> list[int]:
        """Each pending send's outcome completed; the offsets of those acknowledged."""
        offsets = []
        for op, future in pending:
            try:
                offset = future.result(timeout=SEND_TIMEOUT_S + 5).offset
                self.log.complete(op, "ok", offset=offset)
                offsets.append(offset)
            except Exception as error:  # noqa: BLE001 — may or may not be written
                self.log.complete(op, "unknown", error=_reason(error))
        return offsets

    # ------------------------------------------------------------------ transactions
    def pick_writes(self) -> list:
        names = self.data_topics()
        topics = self.rng.sample(names, self.rng.randint(1, min(2, len(names))))
        slots = [(t, p) for t in topics for p in range(self.topics[t])]
        chosen = self.rng.sample(slots, self.rng.randint(1, min(4, len(slots))))
        return [[t, p, self.value()] for t, p in chosen for _ in range(self.rng.randint(1, 3))]

    def run_txn(self) -> None:
        """Transactions of one producer, committed with commit() or, half of them, with
        commit_async(): up to MAX_ASYNC_COMMITS commit while the next ones send. Every
        txn op names its producer, so the checker can hold the producer's send order
        (reordered-writes)."""
        producer_name = f"{self.args.name}-{self.spec['incarnations'].get(self.args.name, 0)}"
        pending: list = []  # commit_async() commits, in commit order
        with self.client.producer(linger_ms=1, delivery_timeout_s=SEND_TIMEOUT_S) as producer:
            while not self.stop:
                txn = self.client.begin_transaction(timeout_s=self.txn_timeout_s)
                if self.rng.random() < 0.5:
                    self.one_transaction(producer, txn, self.pick_writes(), [],
                                         op_fields={"producer": producer_name})
                else:
                    self.async_transaction(producer, txn, self.pick_writes(), pending,
                                           producer_name)
                self.finish_commits(pending, wait=len(pending) >= MAX_ASYNC_COMMITS)
                self.stop.sleep(self.rng.uniform(0, 0.05))
            self.finish_commits(pending, wait=True)

    def async_transaction(self, producer, txn, writes: list, pending: list,
                          producer_name: str) -> None:
        """Send `writes`, then commit_async() (80%) or abort; a commit's op completes in
        finish_commits."""
        decision = "commit" if self.rng.random() < 0.8 else "abort"
        op = self.log.invoke("txn", writes=writes, acks=[], decision=decision,
                             producer=producer_name, commit="async")
        try:
            send_writes(self.rng, producer, writes, txn)
            if decision == "abort":
                txn.abort()
                self.log.complete(op, "ok", result="aborted",
                                  txn_id=txn.id if txn.opened else None)
                return
            commit_invoke = time.time()
            pending.append((op, txn, txn.commit_async(), commit_invoke))
        except (errors.AtomlogClientError, TimeoutError) as error:
            result = self.settle(txn)
            self.log.complete(op, "fail" if result == "aborted" else "unknown", result=result,
                              error=_reason(error), txn_id=txn.id if txn.opened else None)

    def finish_commits(self, pending: list, wait: bool) -> None:
        """Complete the ops of finished commit_async() commits, oldest first; with `wait`,
        wait for every one (a commit that never answers stays unknown)."""
        while pending and (wait or pending[0][2].done()):
            op, txn, future, commit_invoke = pending.pop(0)
            try:
                future.result(timeout=ASYNC_COMMIT_WAIT_S)
            except TimeoutError as error:
                self.log.complete(op, "unknown", result="unknown", error=_reason(error),
                                  commit_invoke=commit_invoke)
                continue
            except errors.AtomlogClientError as error:
                result = self.settle(txn)
                self.log.complete(op, "fail" if result == "aborted" else "unknown",
                                  result=result, error=_reason(error),
                                  txn_id=txn.id if txn.opened else None,
                                  commit_invoke=commit_invoke)
                continue
            self.log.complete(op, "ok", result="committed", commit_invoke=commit_invoke,
                              txn_id=txn.id if txn.opened else None)

    def one_transaction(self, producer, txn, writes: list, acks: list, consumer=None,
                        messages=(), op_fields: dict | None = None, **fields) -> str:
        """Send `writes`, ack `messages` (ctp), then commit (80%) or abort; log it as one
        txn op (with `op_fields` and `fields`) and return its result: committed, aborted
        or unknown."""
        decision = "commit" if acks or self.rng.random() < 0.8 else "abort"
        op = self.log.invoke("txn", writes=writes, acks=acks, decision=decision,
                             **(op_fields or {}), **fields)
        try:
            send_writes(self.rng, producer, writes, txn)
            if consumer is not None:
                consumer.ack(messages, txn=txn)
            if decision == "commit":
                fields_at_commit = {"commit_invoke": time.time()}  # for the fencing check
                txn.commit()
                self.log.complete(op, "ok", result="committed",
                                  txn_id=txn.id if txn.opened else None, **fields_at_commit)
                return "committed"
            txn.abort()
            self.log.complete(op, "ok", result="aborted", txn_id=txn.id if txn.opened else None)
            return "aborted"
        except (errors.AtomlogClientError, TimeoutError) as error:
            result = self.settle(txn)
            self.log.complete(op, "fail" if result == "aborted" else "unknown", result=result,
                              error=_reason(error),
                              txn_id=txn.id if txn.opened else None)
            return result

    def settle(self, txn) -> str:
        """After a failed step: abort, and learn from that what became of the transaction."""
        for _ in range(3):
            try:
                txn.abort()
                return "aborted"
            except errors.TransactionAlreadyCommitted:
                return "committed"
            except errors.AtomlogClientError:
                if self.stop:
                    break
                time.sleep(0.5)
        return "unknown"

    def run_session(self) -> None:
        transactional_id = f"{self.args.name}-{self.spec['incarnations'].get(self.args.name, 0)}"
        producer = self.new_session(transactional_id)
        while not self.stop and producer is not None:
            try:  # may start a new epoch of the session (after an unknown outcome)
                txn = producer.begin_transaction(timeout_s=self.txn_timeout_s)
            except (errors.AtomlogClientError, TimeoutError):
                self.stop.sleep(0.5)
                continue
            fields = {"transactional_id": transactional_id, "epoch": producer.epoch}
            if self.rng.random() < 0.15:  # fence while this transaction is open
                writes = self.pick_writes()
                op = self.log.invoke("txn", writes=writes, acks=[], decision="commit", **fields)
                try:
                    for topic, partition, value in writes:
                        producer.send(topic, value.encode(), partition=partition, txn=txn)
                    producer.flush(timeout=SEND_TIMEOUT_S)
                except (errors.AtomlogClientError, TimeoutError):
                    pass  # the commit below says what became of it
                successor = self.new_session(transactional_id)
                commit_invoke = time.time()
                try:
                    txn.commit()
                    self.log.complete(op, "ok", result="committed", commit_invoke=commit_invoke,
                                      txn_id=txn.id if txn.opened else None)
                except (errors.AtomlogClientError, TimeoutError) as error:
                    # Fenced: the successor's InitProducerId aborted this transaction
                    # (documented); the checker holds us to that.
                    result = "aborted" if isinstance(error, errors.ProducerFenced) \
                        else self.settle(txn)
                    self.log.complete(op, "fail" if result == "aborted" else "unknown",
                                      result=result, error=_reason(error),
                                      commit_invoke=commit_invoke)
                close_quietly(producer)
                producer = successor
                continue
            self.one_transaction(producer, txn, self.pick_writes(), [], **fields)
            self.stop.sleep(self.rng.uniform(0, 0.05))
        if producer is not None:
            close_quietly(producer)

    def new_session(self, transactional_id: str):
        while not self.stop:
            op = self.log.invoke("fence", transactional_id=transactional_id)
            try:
                producer = self.client.producer(transactional_id=transactional_id, linger_ms=1,
                                                transaction_timeout_s=self.txn_timeout_s,
                                                delivery_timeout_s=SEND_TIMEOUT_S)
            except (errors.AtomlogClientError, TimeoutError) as error:
                self.log.complete(op, "unknown", error=_reason(error))
                self.stop.sleep(0.5)
                continue
            self.log.complete(op, "ok", epoch=producer.epoch)
            return producer
        return None

    # ------------------------------------------------------------------ spark-lite
    def run_driver(self) -> None:
        """Jobs the way the Spark writer runs them (spark_client/spark.py): a parent
        transaction per job, a prepared child per task attempt, and the parent's commit
        naming the children to keep; every other child must be aborted with it. A task
        attempt may fail (its child is left out), a speculative second attempt may also
        prepare (one of the two is kept), and in one job in ten the driver "dies": it
        abandons the parent, which must then time out and take every child with it.

        The jobs are the steps of a stream (TxnStream, docs/coordinator.md "Streams"), as
        a streaming query's micro-batches: step N's parent is keyed "<stream>:N" and
        committed as its ordinal N. A step not known to have committed (aborted, an
        unknown outcome, the driver dead or killed) runs again, half the time by a fresh
        key, as when the coordinator has forgotten the parent's; and one committed step
        in ten is replayed so (its commit-log entry lost). The stream must refuse every
        replay of a committed step (the checker's stream-step-twice)."""
        self.place = StreamPlace(Path(self.args.run_dir) / f"{self.args.name}.stream",
                                 f"chaos-stream-{self.args.name}")
        with self.client.producer(linger_ms=1, delivery_timeout_s=SEND_TIMEOUT_S) as producer:
            while not self.stop:
                self.one_job(producer)
                self.stop.sleep(self.rng.uniform(0, 0.1))

    def one_job(self, producer) -> None:
        from spark_client.transactions import Transaction

        place = self.place
        key = f"{place.name}:{place.ordinal}"
        if place.replay and self.rng.random() < 0.5:
            key += f"/forgotten-{self.value()}"
        place.begin()
        op = self.log.invoke("stream-step", stream=place.name, ordinal=place.ordinal, key=key,
                             replay=place.replay)
        try:
            parent = Transaction(self.client, self.spec["parent_timeout_s"], key=key,
                                 stream=(place.name, place.ordinal))
        except errors.AtomlogClientError as error:
            if error.reason == "STREAM_ORDINAL_COMMITTED":  # a replay of a committed step
                self.log.complete(op, "ok", result="refused",
                                  committed_ordinal=error.metadata.get("committed_ordinal"))
                place.committed()
                return
            self.log.complete(op, "fail", error=_reason(error))
            place.again()
            self.stop.sleep(0.5)
            return
        except TimeoutError as error:
            self.log.complete(op, "fail", error=_reason(error))
            place.again()
            self.stop.sleep(0.5)
            return
        if parent.state_at_open in ("COMMITTING", "COMMITTED"):  # found by its key
            self.log.complete(op, "ok", result="found", parent=parent.id)
            place.committed()
            return
        if parent.state_at_open != "OPEN":  # being aborted: the next try replaces it
            self.log.complete(op, "fail", result=parent.state_at_open, parent=parent.id)
            place.again()
            return
        self.log.complete(op, "ok", result="opened", parent=parent.id)
        step = {"stream": place.name, "ordinal": place.ordinal, "parent": parent.id}
        attempts = []  # (op, child or None, prepared)
        for _task in range(self.rng.randint(1, 3)):
            for _attempt in range(2 if self.rng.random() < 0.2 else 1):
                attempts.append(self.task_attempt(producer, parent, Transaction, step))
        kept, parent_error = [], None
        for op, child, prepared in attempts:
            if prepared and self.rng.random() < 0.85:
                kept.append((op, child))
        if self.rng.random() < 0.1:  # the driver dies: nobody ends the parent
            for op, _child, _prepared in attempts:
                self.log.complete(op, "ok", decision="abort", result="aborted",
                                  abandoned=True)
            place.again()
            return
        keep_ids = [child.key for _op, child in kept]
        try:
            parent.commit(keep_children=keep_ids)
            outcome = "committed"
        except (errors.AtomlogClientError, TimeoutError) as error:
            # (STREAM_ORDINAL_COMMITTED: another parent of the step committed it, as the
            # Spark writer learns at a commit; this one is aborted.)
            outcome = self.settle(parent)
            parent_error = _reason(error)
        if outcome == "committed":
            place.committed(forget_it=self.rng.random() < 0.1)
        else:
            place.again()
        for op, child, _prepared in attempts:
            is_kept = any(child is k for _op, k in kept)
            if is_kept:
                self.log.complete(op, "ok" if outcome != "unknown" else "unknown",
                                  result=outcome, parent_error=parent_error)
            else:
                self.log.complete(op, "ok", decision="abort", result="aborted")

    def task_attempt(self, producer, parent, transaction_class, step: dict):
        """One task attempt: a child of the parent, its writes, prepare. Returns (op, child
        or None, prepared); the op is completed by the job once the parent is decided."""
        writes = self.pick_writes()
        op = self.log.invoke("txn", writes=writes, acks=[], decision="commit", child=True,
                             **step)
        try:
            child = transaction_class(self.client, self.spec["child_timeout_s"], parent=parent)
        except (errors.AtomlogClientError, TimeoutError):
            return op, None, False  # no child: nothing written
        try:
            for topic, partition, value in writes:
                producer.send(topic, value.encode(), partition=partition, txn=child)
            child.prepare(self.spec["prepared_timeout_s"])
            return op, child, True
        except (errors.AtomlogClientError, TimeoutError):
            try:  # a failed attempt: Spark calls abort() on its writer
                child.abort()
            except (errors.AtomlogClientError, TimeoutError):
                pass  # the parent's decision aborts it anyway (it is not kept)
            return op, child, False

    # ------------------------------------------------------------------ readers
    def run_reader(self) -> None:
        isolation = self.args.isolation
        topics = [self.spec["output_topic"]] if self.spec.get("input_topic") else list(self.topics)
        session = 0
        positions: dict = {}
        while not self.stop:
            session += 1
            incarnation = self.spec["incarnations"].get(self.args.name, 0)
            session_id = f"{self.args.name}/{incarnation}/{session}"
            try:
                consumer = self.client.consumer(topics, isolation=isolation)
            except errors.AtomlogClientError:
                self.stop.sleep(0.5)
                continue
            with consumer:
                start = []
                for (topic, partition), _offset in consumer.assignment().items():
                    offset = positions.get((topic, partition), 0)
                    if offset and self.rng.random() < 0.3:  # go back: re-read some
                        offset = self.rng.randrange(offset)
                    consumer.seek(topic, partition, offset)
                    start.append([topic, partition, offset])
                self.log.record("seek", session=session_id, isolation=isolation, positions=start)
                for _ in range(self.rng.randint(5, 40)):
                    if self.stop:
                        break
                    op = self.log.invoke("poll", session=session_id, isolation=isolation,
                                         subscription=None)
                    try:
                        messages = (consumer.poll if self.rng.random() < 0.5
                                    else consumer.poll_arrow)(timeout_s=0.5, max_records=2000)
                    except Exception as error:  # noqa: BLE001 — a failed poll returned nothing
                        self.log.complete(op, "fail", records=[], error=_reason(error))
                        self.stop.sleep(0.2)
                        continue
                    self.log.complete(op, "ok", records=_records(messages))
                for key in consumer.assignment():
                    positions[key] = consumer.position(*key)

    # ------------------------------------------------------------------ trims
    def run_trimmer(self) -> None:
        """Sends to the trim topic and DeleteRecords below acknowledged offsets (the role
        list above)."""
        topic, count = self.spec["trim_topic"]["name"], self.spec["trim_topic"]["partitions"]
        acked: dict[int, list[int]] = {p: [] for p in range(count)}
        with self.client.producer(linger_ms=1, delivery_timeout_s=SEND_TIMEOUT_S) as producer:
            while not self.stop:
                partition = self.rng.randrange(count)
                pending = []
                for _ in range(self.rng.randint(1, 16)):
                    value = self.value("trim-")
                    self.send_logged(producer, "trim-send", topic, partition, value,
                                     (value + TRIM_PAD).encode(), pending)
                acked[partition] = (acked[partition] + self.settle_sends(pending))[-40:]
                if acked[partition] and self.rng.random() < 0.25:
                    # Below one of the newest acknowledged offsets: at most the high watermark
                    # (acknowledged means every in-sync replica holds it).
                    before = self.rng.choice(acked[partition]) + 1
                    op = self.log.invoke("delete", topic=topic, partition=partition,
                                         before_offset=before)
                    try:
                        start = self.client.delete_records(topic, {partition: before},
                                                           timeout_s=20.0)[partition]
                        self.log.complete(op, "ok", log_start=start)
                    except Exception as error:  # noqa: BLE001 — it may have deleted some
                        self.log.complete(op, "unknown", error=_reason(error))
                self.stop.sleep(self.rng.uniform(0, 0.05))

    # ------------------------------------------------------------------ ctp
    def run_feeder(self) -> None:
        self.run_producer([self.spec["input_topic"]], prefix="in-")

    def run_ctp(self) -> None:
        spec = self.spec
        subscription = spec["subscription"]
        session_id = f"{self.args.name}/{spec['incarnations'].get(self.args.name, 0)}"
        outputs = self.topics[spec["output_topic"]]
        consumer = self.subscribe()
        if consumer is None:
            return
        producer = self.client.producer(linger_ms=1, delivery_timeout_s=SEND_TIMEOUT_S)
        # The streaming worker takes an aborted round's inputs again as they were, before
        # it gives them back: the next transaction then sends the same records to the same
        # partitions right behind the aborted one's (the Go loop's shape, which found a
        # retried batch refused after its abort: docs/verification.md, "Found 2026-11-28").
        again: list = []
        retries = 0
        # ... and its transactions time out sooner (as the Go loop's), so that a fault
        # often ends one at its coordinator while its sends are still being retried.
        timeout_s = STREAMING_TXN_TIMEOUT_S if self.streaming else self.txn_timeout_s
        with producer, consumer:
            while not self.stop:
                if again:
                    # A moment first: until the abort's marker reaches the subscription,
                    # the inputs are still held by the aborted transaction's acks (an ack
                    # now is refused TRANSACTION_CONFLICT, after the sends).
                    self.stop.sleep(self.rng.uniform(*RETRY_PAUSE_S))
                    messages, again = again, []
                else:
                    retries = 0
                    op = self.log.invoke("poll", session=session_id,
                                         isolation="read_committed", subscription=subscription)
                    try:
                        # At least one record per partition server, so the SDK's Receive
                        # asks every server for a share and nothing is left over in its
                        # buffer (docs/verification.md, "Found and fixed"), beyond what
                        # a consumer with a prefetch keeps on purpose: "received" says
                        # when the server delivered what the poll returns.
                        messages = consumer.poll(
                            timeout_s=0.3, max_records=self.rng.randint(*CTP_BATCH_RECORDS))
                    except Exception as error:  # noqa: BLE001 — a failed poll returned nothing
                        self.log.complete(op, "fail", records=[], error=_reason(error))
                        self.stop.sleep(0.2)
                        continue
                    self.log.complete(op, "ok", records=_records(messages),
                                      received=consumer.received_at)
                    if not messages:
                        continue
                writes = [[spec["output_topic"], m.partition % outputs,
                           TRANSFORM_PREFIX + m.value.decode()] for m in messages]
                acks = [[subscription, m.topic, m.partition, m.offset] for m in messages]
                try:
                    txn = self.client.begin_transaction(timeout_s=timeout_s)
                except errors.AtomlogClientError:
                    self.give_back(consumer, messages)
                    continue
                result = self.one_transaction(producer, txn, writes, acks, consumer, messages)
                if result == "aborted" and self.streaming and retries < CTP_RETRIES:
                    retries += 1
                    again = messages
                elif result == "aborted":
                    self.give_back(consumer, messages)

    def subscribe(self):
        """A consumer of the input subscription (created at the earliest offset by the
        first one); retried while the servers it needs are down. None once stopped."""
        while not self.stop:
            prefetch = self.rng.choice(CTP_PREFETCH)
            try:
                consumer = self.client.consumer(self.spec["input_topic"],
                                                subscription=self.spec["subscription"],
                                                ack_timeout_s=self.spec["ack_timeout_s"],
                                                prefetch=prefetch)
                # An observation for the record (the checker has no rule about it).
                self.log.record("subscribe", subscription=self.spec["subscription"],
                                prefetch=prefetch)
                return consumer
            except errors.AtomlogClientError:
                self.stop.sleep(0.5)
        return None

    def give_back(self, consumer, messages) -> None:
        try:
            consumer.nack(messages)
        except errors.AtomlogClientError:
            pass  # the ack timeout redelivers them

    def run_cursors(self) -> None:
        spec = self.spec
        consumer = self.subscribe()
        if consumer is None:
            return
        with consumer:
            while not self.stop:
                op = self.log.invoke("cursor", subscription=spec["subscription"],
                                     topic=spec["input_topic"])
                try:
                    results = consumer.describe()
                    positions = [[r.subscription_partition.partition, r.cumulative_end_offset,
                                  [[i.start_offset, i.end_offset] for i in r.individual_ranges]]
                                 for r in results]
                    self.log.complete(op, "ok", positions=positions)
                except Exception as error:  # noqa: BLE001 — an observation that failed
                    self.log.complete(op, "fail", positions=[], error=_reason(error))
                self.stop.sleep(0.5)


ROLES = {"producer": Workload.run_producer, "txn": Workload.run_txn,
         "session": Workload.run_session, "reader": Workload.run_reader,
         "feeder": Workload.run_feeder, "ctp": Workload.run_ctp, "cursors": Workload.run_cursors,
         "driver": Workload.run_driver, "trimmer": Workload.run_trimmer}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--isolation", default="read_committed",
                        choices=["read_committed", "read_uncommitted"])
    args = parser.parse_args(argv)
    workload = Workload(args)
    try:
        while not workload.stop:
            try:
                ROLES[args.role](workload)
            except (errors.AtomlogClientError, TimeoutError) as error:
                # Making a producer or consumer needs the servers (a producer id, the
                # metadata): with every server down it fails. Start the role again; an
                # operation in flight stays without a completion (unknown).
                print(f"{args.name}: {error!r}; starting the role again", flush=True)
                workload.stop.sleep(0.5)
    finally:
        workload.log.close()
        workload.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
