"""A consume-transform-produce loop, written the way a user of the SDK would write it.

Each round: poll a batch from a subscription of the input topic, open a transaction,
send the transformed messages to the output topic with txn=, acknowledge the inputs
with txn=, commit. On an error that is retriable or ends the transaction (abortable),
the round aborts the transaction (or accepts that the coordinator already did) and
negatively acknowledges its inputs, so they come back (if the Nack is lost, the ack
timeout brings them back). No de-duplication on the output side: exactly-once is the
transaction's job. A fatal error stops the loop (it is a bug).

The loop stops once the subscription has acknowledged every input (the cursor of every
partition is at the end of the input topic, nothing pending), or after `deadline_s`.

tests/test_consume_transform_produce.py runs it as its own OS process while it kills
servers:

    python tests/ctp_loop.py BOOTSTRAP INPUT OUTPUT SUBSCRIPTION [--batch 100] [--deadline-s 80]

It prints a JSON line of progress every 0.1 s and a last one with "done": true.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark_client import Client, errors  # noqa: E402

BATCH = 100
# Short, so that crashes end transactions: commit() waits at most this long for the
# transaction's sends (a restarting partition server fails the round, which aborts), and
# a transaction stranded on a dead coordinator times out soon and releases its acks.
# An undisturbed round takes tens of milliseconds. (commit() itself still retries
# coordinator failover for the client's request timeout.)
TRANSACTION_TIMEOUT_S = 2.0
# A lost Nack (the owner was down) redelivers after this; buffered deliveries older than
# this are dropped by poll() and come back from the server.
ACK_TIMEOUT_S = 5.0


def transform(value: bytes) -> bytes:
    return b"out:" + value[::-1]


def input_ends(client: Client, topic: str) -> dict[int, int]:
    """High watermark of every input partition (the input is written before the loop)."""
    with client.consumer(topic, isolation="read_uncommitted") as reader:
        return {partition: end for (_, partition), end in reader.end_offsets().items()}


class Loop:
    def __init__(self, client: Client, input_topic: str, output_topic: str,
                 subscription: str, batch: int = BATCH):
        self.client = client
        self.output_topic = output_topic
        self.batch = batch
        self.stats: Counter = Counter()
        self.consumer = client.consumer(input_topic, subscription=subscription,
                                        ack_timeout_s=ACK_TIMEOUT_S)
        self.producer = client.producer(linger_ms=1)
        self.output_partitions = client.partitions_for(output_topic)

    def close(self) -> None:
        self.producer.close(timeout=30)
        self.consumer.close()

    def step(self, timeout_s: float = 0.2) -> int:
        """One round; returns how many inputs it committed."""
        try:
            messages = self.consumer.poll(timeout_s=timeout_s, max_records=self.batch)
        except errors.AtomlogClientError as error:
            self._expected(error, "poll")
            time.sleep(0.1)
            return 0
        if not messages:
            return 0
        self.stats["delivered"] += len(messages)
        try:
            txn = self.client.begin_transaction(timeout_s=TRANSACTION_TIMEOUT_S)
        except errors.AtomlogClientError as error:
            self._expected(error, "begin")
            self._give_back(messages)
            return 0
        try:
            for message in messages:
                self.producer.send(self.output_topic, transform(message.value), key=message.key,
                                   partition=message.partition % self.output_partitions, txn=txn)
            self.consumer.ack(messages, txn=txn)
            txn.commit()
        except errors.AtomlogClientError as error:
            self._expected(error, "round")
            if self._abort(txn):
                self._give_back(messages)
                return 0
        self.stats["committed"] += len(messages)
        self.stats["transactions"] += 1
        return len(messages)

    def _abort(self, txn) -> bool:
        """Abort after a failed round; False when the commit went through after all."""
        try:
            txn.abort()
            self.stats["aborted"] += 1
        except errors.TransactionAlreadyCommitted:
            self.stats["committed_after_error"] += 1
            return False
        except errors.AtomlogClientError as error:
            # The coordinator aborts it at its timeout; its acks are released then.
            self._expected(error, "abort")
        return True

    def _give_back(self, messages) -> None:
        try:
            self.consumer.nack(messages)
        except errors.AtomlogClientError as error:
            self._expected(error, "nack")  # the ack timeout redelivers them

    def _expected(self, error: errors.AtomlogClientError, where: str) -> None:
        if not (error.retriable or error.abortable):
            raise error
        self.stats[f"{where}:{error.reason}"] += 1

    def acknowledged_everything(self, ends: dict[int, int]) -> bool:
        try:
            cursors = self.consumer.describe()
        except errors.AtomlogClientError as error:
            self._expected(error, "describe")
            return False
        return all(c.cumulative_end_offset >= ends[c.subscription_partition.partition]
                   and not c.pending_acks and not c.individual_ranges for c in cursors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bootstrap")
    parser.add_argument("input_topic")
    parser.add_argument("output_topic")
    parser.add_argument("subscription")
    parser.add_argument("--deadline-s", type=float, default=80.0)
    parser.add_argument("--batch", type=int, default=BATCH, help="inputs per transaction")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # the test asks where a stuck loop is
    began = time.monotonic()
    client = Client(args.bootstrap)
    ends = input_ends(client, args.input_topic)
    loop = Loop(client, args.input_topic, args.output_topic, args.subscription,
                args.batch)
    done, reported, idle_since = False, began, None
    try:
        while time.monotonic() - began < args.deadline_s:
            if loop.step():
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 0.5:  # nothing delivered for a while
                idle_since = time.monotonic()
                if loop.acknowledged_everything(ends):
                    done = True
                    break
            if time.monotonic() - reported >= 0.1:
                reported = time.monotonic()
                print(json.dumps({"t": round(reported - began, 1), **loop.stats}), flush=True)
    finally:
        loop.close()
        client.close()
    print(json.dumps({"t": round(time.monotonic() - began, 1), "done": done, **loop.stats}),
          flush=True)
    sys.exit(0 if done else 1)


if __name__ == "__main__":
    main()
