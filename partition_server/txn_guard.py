"""Verification cache and late-write guard of one partition: a pure core (no I/O, clock
or threads). It closes the window that makes "hanging transactions" in Kafka: a write
verified with the coordinator (OPEN, includes this partition) that reaches the log only
after the transaction's marker was applied here. Such a write would open a transaction
no marker will ever end, holding max_read_position (and retention) for good.

How the shell uses it, per partition (the owner task is the only caller of the `on_*`
and `allows`; the servicer calls `token`, `cached` and `remember` before queueing):

    token = guard.token()                  # before asking the coordinator
    answer = await coordinator.verify(...) # OPEN and included, else the write is refused
    guard.remember(txn, token, session)    # cache it (ignored if a marker came meanwhile)
    ... queue the batch with `token` ...
    owner, in log order:  guard.allows(txn, token) → append, else refuse (retriable)
    every marker applied here (WRITE or NOOP):  guard.on_marker(txn)

Markers are numbered (a generation counter). `on_marker` records the generation at which
the transaction ended here and drops its cache entry. A verification started at token t
is usable only if the transaction has not ended here (by any marker, at any time: the
coordinator decides before it sends markers, so a verification racing a marker may have
seen OPEN) and t is not below the horizon. The ended set is bounded; when its oldest
entry is evicted, the horizon rises past its generation, so a verification older than
any forgotten marker is refused (the client retries and the coordinator answers afresh).
Nothing here is durable: after a restart the cache and the ended set are empty, and no
verification from before the restart can be in flight.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from partition_server.record_batch import TxnId, txn_key, txn_key_of

DEFAULT_MAX_CACHED = 100_000
DEFAULT_MAX_ENDED = 100_000


@dataclass(frozen=True, slots=True)
class Verified:
    """A cached verification: the generation it started at, the transaction's
    session ((producer id, epoch) the batches must carry), None without a session, and
    the principal that opened it, as its coordinator said ("": not known)."""

    token: int
    session: tuple[int, int] | None
    opener: str = ""


class TxnGuard:
    def __init__(self, max_cached: int = DEFAULT_MAX_CACHED,
                 max_ended: int = DEFAULT_MAX_ENDED) -> None:
        assert max_cached >= 1 and max_ended >= 1, (max_cached, max_ended)
        self.max_cached = max_cached
        self.max_ended = max_ended
        self._generation = 0
        self._horizon = 0
        # Keyed by txn_key(txn), an int. The ended set holds up to max_ended (100,000)
        # entries for long, and the garbage collector scanned every entry of it at each
        # full collection (as an OrderedDict of TxnIds: 37 ms for 4 partitions in a quiet
        # process, about 90 ms in a loaded server). So it is a dict of ints, which the
        # collector never tracks, and its order (oldest marker first) is kept in arrays,
        # which hold no objects: an entry ended again is appended anew, and its older
        # place, whose generation no longer matches, is skipped when reached.
        self._cache: OrderedDict[int, Verified] = OrderedDict()  # ~ the open transactions
        self._ended: dict[int, int] = {}  # txn_key -> generation of its last marker here
        self._ended_order = (array("I"), array("Q"), array("Q"))  # tc, sequence, generation
        self._ended_head = 0

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def horizon(self) -> int:
        return self._horizon

    @property
    def cached_count(self) -> int:
        return len(self._cache)

    def token(self) -> int:
        """Take before asking the coordinator."""
        return self._generation

    def cached(self, txn: TxnId) -> Verified | None:
        """A still-usable verification of txn on this partition, or None."""
        key = txn_key(txn)
        entry = self._cache.get(key)
        if entry is None:
            return None
        if not self.allows(txn, entry.token):
            del self._cache[key]
            return None
        self._cache.move_to_end(key)
        return entry

    def remember(self, txn: TxnId, token: int, session: tuple[int, int] | None,
                 opener: str = "") -> bool:
        """Cache a positive answer obtained with `token`; False (and nothing cached) when
        a marker for txn came meanwhile or the token fell below the horizon."""
        if not self.allows(txn, token):
            return False
        key = txn_key(txn)
        self._cache[key] = Verified(token, session, opener)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)  # only costs a new verification
        return True

    def allows(self, txn: TxnId, token: int) -> bool:
        """May a write verified with `token` be appended now?"""
        return txn_key(txn) not in self._ended and token >= self._horizon

    def on_marker(self, txn: TxnId) -> None:
        """A marker for txn was applied here (written or not)."""
        key = txn_key(txn)
        self._cache.pop(key, None)
        self._ended[key] = self._generation
        tcs, sequences, generations = self._ended_order
        tcs.append(txn.tc_partition)
        sequences.append(txn.sequence)
        generations.append(self._generation)
        self._generation += 1
        while len(self._ended) > self.max_ended:
            head = self._ended_head
            self._ended_head += 1
            oldest, generation = txn_key_of(tcs[head], sequences[head]), generations[head]
            if self._ended.get(oldest) == generation:  # else ended again since: skipped
                del self._ended[oldest]
                self._horizon = max(self._horizon, generation + 1)
        head = self._ended_head
        if len(tcs) - head > 2 * len(self._ended) + 64:  # mostly places ended again since
            live = [index for index in range(head, len(tcs)) if self._ended.get(
                txn_key_of(tcs[index], sequences[index])) == generations[index]]
            self._ended_order = tuple(array(column.typecode, (column[index] for index in live))
                                      for column in self._ended_order)
            self._ended_head = 0
        elif head > 64 and head * 2 > len(tcs):
            for column in self._ended_order:
                del column[:head]
            self._ended_head = 0
