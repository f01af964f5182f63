"""The producer-id block allocator core: pure, no I/O, no clock, no randomness.

State lives in one znode (`/producer_id_block` under the cluster's chroot) holding
the last block issued, as JSON:

    {"version": 1, "last_block": {"first": F, "last": L}, "blocks": k,
     "owner": "<allocator name>", "requester": "<caller names>", "nonce": "<per attempt>"}

One write may issue several blocks (one per queued request, `blocks` of them); then
`last_block` is the union [F, L] of the blocks that write issued.

An `Allocation` is one sans-I/O state machine per write round (h11/raft style): the
shell asks it for the next action, performs it against ZooKeeper, and feeds the
result back. Actions, in the order the shell meets them:

    Read(sync, backoff_attempt)  -> shell sleeps (jittered, if backoff_attempt), syncs
                                    if asked, reads the znode, calls on_read(snapshot, nonce)
    Write(expected_version, ...) -> shell does create (expected_version == ABSENT) or
                                    set(version=expected_version), then calls
                                    on_write_ok(new_version) | on_write_conflict() |
                                    on_write_uncertain()
    Done(results)                -> shell hands each result to its request
    Failed(error)                -> shell fails every request with the error

Any ZooKeeper call that cannot be made (no session) is fed back as on_unavailable().

Safety argument, in three lines:
1. A block leaves only in `Done`, which is reached only from a write whose CAS
   succeeded (`on_write_ok`) or whose outcome was uncertain and a later read shows
   this attempt's own nonce at exactly the version the write would have produced.
2. Every write is a CAS on the version of the content it was planned from, and plans
   start after that content's last id; so successful writes issue increasing,
   disjoint ranges, whatever the interleaving, whichever allocator.
3. Each attempt has a fresh nonce and only the attempt being resolved is compared, so
   a write that was lost, delayed, or applied after another allocator's write is never
   mistaken for ours: at worst its ids are never issued (a gap, not a duplicate).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Sequence

from services.errors import AtomlogError

# Producer ids are int64 (signed, as in Kafka's record format); 0 means "no producer"
# in a batch header, so the first id ever issued is 1.
MIN_PRODUCER_ID = 1
MAX_PRODUCER_ID = 2**63 - 1
# Format of the znode content; a reader refuses any other (fail closed).
RECORD_FORMAT = 1
# The znode version a write expects when the znode does not exist yet (a create).
ABSENT = -1
# ZooKeeper's znode version is a signed 32-bit integer that wraps on overflow.
_INT32_MAX = 2**31 - 1
# Bounds on what is written with a block (operators read it; nothing decides by it).
MAX_REQUESTER_BYTES = 128
MAX_NAMES_RECORDED = 8
MAX_NONCE_CHARS = 64


def next_znode_version(version: int) -> int:
    """The version a successful write at `version` produces (0 after a create)."""
    if version == ABSENT:
        return 0
    return -(2**31) if version == _INT32_MAX else version + 1


def backoff_bound_ms(attempt: int, initial_ms: int, max_ms: int) -> float:
    """Upper bound of the full-jitter backoff before retry `attempt` (1, 2, ...)."""
    if attempt <= 0:
        return 0.0
    return float(min(max_ms, initial_ms * 2 ** min(attempt - 1, 30)))


def resolve_count(requested: int, default_block_size: int, max_block_size: int) -> int:
    """The block size for a request's count (0 means the default); INVALID_ARGUMENT if
    it is negative or above the maximum."""
    if requested == 0:
        return default_block_size
    if requested < 0 or requested > max_block_size:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"count={requested} is outside 1..{max_block_size} "
                           "(0 asks for the default block size)",
                           {"field": "count", "max_block_size": max_block_size})
    return requested


def validate_requester(requester: str) -> str:
    size = len(requester.encode("utf-8"))
    if size > MAX_REQUESTER_BYTES:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"requester is {size} bytes of UTF-8; at most {MAX_REQUESTER_BYTES}",
                           {"field": "requester"})
    return requester


@dataclass(frozen=True, order=True)
class Block:
    """The producer ids [first, last], inclusive."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not (isinstance(self.first, int) and isinstance(self.last, int)):
            raise ValueError(f"block bounds must be integers, got {self.first!r}, {self.last!r}")
        if not MIN_PRODUCER_ID <= self.first <= self.last <= MAX_PRODUCER_ID:
            raise ValueError(f"invalid block [{self.first}, {self.last}]: need "
                             f"{MIN_PRODUCER_ID} <= first <= last <= {MAX_PRODUCER_ID}")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def overlaps(self, other: "Block") -> bool:
        return self.first <= other.last and other.first <= self.last


def corrupt(message: str) -> AtomlogError:
    return AtomlogError("PRODUCER_ID_BLOCK_CORRUPT", message)


@dataclass(frozen=True)
class BlockRecord:
    """The znode's content: the last block (range) issued, by whom, with which nonce."""

    last_block: Block
    blocks: int
    owner: str
    requester: str
    nonce: str

    def to_bytes(self) -> bytes:
        return json.dumps({
            "version": RECORD_FORMAT,
            "last_block": {"first": self.last_block.first, "last": self.last_block.last},
            "blocks": self.blocks, "owner": self.owner, "requester": self.requester,
            "nonce": self.nonce,
        }, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "BlockRecord":
        """Parse strictly; anything unexpected raises PRODUCER_ID_BLOCK_CORRUPT."""
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise corrupt(f"the znode holds {len(data)} bytes that are not JSON") from None
        if not isinstance(raw, dict) or raw.get("version") != RECORD_FORMAT:
            raise corrupt(f"the znode's record format is not {RECORD_FORMAT}: {str(raw)[:200]}")
        block = raw.get("last_block")
        strings = [raw.get(k) for k in ("owner", "requester", "nonce")]
        if (not isinstance(block, dict) or not all(isinstance(s, str) for s in strings)
                or type(raw.get("blocks")) is not int or raw["blocks"] < 1
                or any(type(block.get(k)) is not int for k in ("first", "last"))):
            raise corrupt(f"the znode's record is malformed: {str(raw)[:200]}")
        try:
            last_block = Block(block["first"], block["last"])
        except ValueError as error:
            raise corrupt(f"the znode's last block is invalid: {error}") from None
        return cls(last_block, raw["blocks"], *strings)


@dataclass(frozen=True)
class Snapshot:
    """What a read of the znode saw: its record (None if absent) and version."""

    record: BlockRecord | None
    version: int

    def __post_init__(self) -> None:
        if (self.record is None) != (self.version == ABSENT):
            raise ValueError("a snapshot has a record exactly when the znode exists")

    @classmethod
    def parse(cls, data: bytes | None, version: int) -> "Snapshot":
        if data is None:
            return cls(None, ABSENT)
        return cls(BlockRecord.from_bytes(data), version)

    @property
    def last_issued(self) -> int:
        """The last id ever issued (0 when none was)."""
        return self.record.last_block.last if self.record else MIN_PRODUCER_ID - 1


@dataclass(frozen=True)
class Request:
    """One caller's wish: `count` ids (already resolved, >= 1), for `requester`."""

    count: int
    requester: str = ""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a request needs count >= 1, got {self.count}")


# ------------------------------------------------------------------ actions (out)
@dataclass(frozen=True)
class Read:
    sync: bool  # sync the server with the leader first (resolving an uncertain write)
    backoff_attempt: int  # 0: read at once; n: sleep up to backoff_bound_ms(n) first


@dataclass(frozen=True)
class Write:
    expected_version: int  # ABSENT: create the znode; otherwise set(version=...)
    record: BlockRecord
    data: bytes
    # Per request, the block it gets if the write succeeds, or the error it gets.
    results: tuple[Block | AtomlogError, ...]


@dataclass(frozen=True)
class Done:
    results: tuple[Block | AtomlogError, ...]
    snapshot: Snapshot  # the znode as this write left it
    resolved_uncertain: bool  # True if proven ours after a lost reply


@dataclass(frozen=True)
class Failed:
    error: AtomlogError


Action = Read | Write | Done | Failed


class State(enum.Enum):
    READING = "reading"
    WRITING = "writing"
    RESOLVING = "resolving"  # re-reading after a write whose reply was lost
    DONE = "done"
    FAILED = "failed"


class Input(enum.Enum):
    READ = "read"
    WRITE_OK = "write_ok"
    WRITE_CONFLICT = "write_conflict"
    WRITE_UNCERTAIN = "write_uncertain"
    UNAVAILABLE = "unavailable"


# Which inputs each state accepts (and the states they may lead to). Anything else is
# a bug in the shell: it raises ProtocolError and leaves the machine unchanged.
TRANSITIONS: dict[State, dict[Input, tuple[State, ...]]] = {
    State.READING: {Input.READ: (State.WRITING, State.FAILED),
                    Input.UNAVAILABLE: (State.FAILED,)},
    State.WRITING: {Input.WRITE_OK: (State.DONE,),
                    Input.WRITE_CONFLICT: (State.READING, State.FAILED),
                    Input.WRITE_UNCERTAIN: (State.RESOLVING,),
                    Input.UNAVAILABLE: (State.FAILED,)},
    State.RESOLVING: {Input.READ: (State.DONE, State.WRITING, State.FAILED),
                      Input.UNAVAILABLE: (State.FAILED,)},
    State.DONE: {},
    State.FAILED: {},
}


class ProtocolError(Exception):
    """The shell fed an input the current state does not accept (a bug)."""


def _names(requests: Sequence[Request]) -> str:
    unique = list(dict.fromkeys(r.requester for r in requests if r.requester))
    shown = ",".join(unique[:MAX_NAMES_RECORDED])
    return shown + (f",+{len(unique) - MAX_NAMES_RECORDED} more"
                    if len(unique) > MAX_NAMES_RECORDED else "")


def plan(snapshot: Snapshot, requests: Sequence[Request], owner: str,
         nonce: str) -> Write | Failed:
    """The write that issues the next blocks after `snapshot`, in request order.

    Requests that no longer fit in the 64-bit space get PRODUCER_ID_SPACE_EXHAUSTED;
    if none fits, nothing is written."""
    results: list[Block | AtomlogError] = []
    next_first = snapshot.last_issued + 1
    for request in requests:
        if next_first > MAX_PRODUCER_ID or request.count > MAX_PRODUCER_ID - next_first + 1:
            results.append(AtomlogError(
                "PRODUCER_ID_SPACE_EXHAUSTED",
                f"no room for {request.count} producer ids after {next_first - 1}; "
                f"the largest producer id is {MAX_PRODUCER_ID}",
                {"last_issued": snapshot.last_issued, "count": request.count}))
            continue
        block = Block(next_first, next_first + request.count - 1)
        results.append(block)
        next_first = block.last + 1
    issued = [b for b in results if isinstance(b, Block)]
    if not issued:
        return Failed(next(e for e in results if isinstance(e, AtomlogError)))
    union = Block(issued[0].first, issued[-1].last)
    # Pair assertion: what we write starts after what we read, and the blocks tile it.
    assert union.first == snapshot.last_issued + 1
    assert sum(b.size for b in issued) == union.size
    record = BlockRecord(union, len(issued), owner, _names(requests), nonce)
    return Write(snapshot.version, record, record.to_bytes(), tuple(results))


@dataclass
class Allocation:
    """One round of issuing blocks for `requests`: read, CAS, retry or resolve.

    `floor` is the highest id this allocator process has seen in the znode; a read
    below it means the znode went backwards (deleted or restored by hand), and the
    allocation fails closed rather than issue ids again."""

    requests: tuple[Request, ...]
    owner: str
    cas_max_attempts: int
    floor: int = 0
    state: State = State.READING
    attempts: int = 0  # writes tried so far (each one counts, whatever its outcome)
    conflicts: int = 0
    uncertain: int = 0
    pending: Write | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("an allocation needs at least one request")
        if self.cas_max_attempts < 1:
            raise ValueError("cas_max_attempts must be at least 1")

    def start(self) -> Read:
        return Read(sync=False, backoff_attempt=0)

    # -------------------------------------------------------------- inputs
    def on_read(self, snapshot: Snapshot | AtomlogError, nonce: str) -> Action:
        """A read's result (or PRODUCER_ID_BLOCK_CORRUPT if it did not parse)."""
        self._accept(Input.READ)
        if isinstance(snapshot, AtomlogError):
            return self._fail(snapshot)
        if snapshot.last_issued < self.floor:
            return self._fail(corrupt(
                f"the znode went backwards: it says the last id issued is "
                f"{snapshot.last_issued}, but this allocator saw {self.floor} issued; "
                "refusing to issue ids again"))
        self.floor = snapshot.last_issued
        if self.state is State.RESOLVING:
            assert self.pending is not None
            if self._proves_ours(snapshot):
                return self._done(self.pending, resolved_uncertain=True)
            # Not provably ours: whatever happened to that write, its ids are never issued.
            self.pending = None
        return self._attempt(snapshot, nonce)

    def on_write_ok(self, new_version: int) -> Action:
        self._accept(Input.WRITE_OK)
        assert self.pending is not None
        if new_version != next_znode_version(self.pending.expected_version):
            raise ProtocolError(f"a write at version {self.pending.expected_version} cannot "
                                f"produce version {new_version}")
        return self._done(self.pending, resolved_uncertain=False)

    def on_write_conflict(self) -> Action:
        """The CAS failed: the version changed (or the znode appeared or vanished)."""
        self._accept(Input.WRITE_CONFLICT)
        self.conflicts += 1
        self.pending = None
        if self.attempts >= self.cas_max_attempts:
            return self._fail(AtomlogError(
                "ID_ALLOCATION_CONFLICT",
                f"lost the compare-and-set {self.conflicts} times in {self.attempts} attempts; "
                "no block was issued", {"attempts": self.attempts}))
        self.state = State.READING
        return Read(sync=False, backoff_attempt=self.conflicts)

    def on_write_uncertain(self) -> Action:
        """The write's reply was lost (connection loss, session expiry, timeout)."""
        self._accept(Input.WRITE_UNCERTAIN)
        self.uncertain += 1
        self.state = State.RESOLVING
        return Read(sync=True, backoff_attempt=0)

    def on_unavailable(self, message: str) -> Action:
        self._accept(Input.UNAVAILABLE)
        self.pending = None
        return self._fail(AtomlogError("ZOOKEEPER_UNAVAILABLE", message))

    # -------------------------------------------------------------- helpers
    def _accept(self, given: Input) -> None:
        if given not in TRANSITIONS[self.state]:
            raise ProtocolError(f"input {given.value} is not accepted in state {self.state.value}")

    def _proves_ours(self, snapshot: Snapshot) -> bool:
        pending = self.pending
        assert pending is not None
        return (snapshot.record is not None
                and snapshot.record.nonce == pending.record.nonce
                and snapshot.record == pending.record
                and snapshot.version == next_znode_version(pending.expected_version))

    def _attempt(self, snapshot: Snapshot, nonce: str) -> Action:
        if not nonce or len(nonce) > MAX_NONCE_CHARS:
            raise ValueError(f"a nonce must have 1..{MAX_NONCE_CHARS} characters")
        if self.attempts >= self.cas_max_attempts:
            return self._fail(AtomlogError(
                "ID_ALLOCATION_CONFLICT",
                f"{self.attempts} write attempts without a provable success "
                f"({self.conflicts} conflicts, {self.uncertain} lost replies); no block was issued",
                {"attempts": self.attempts}))
        planned = plan(snapshot, self.requests, self.owner, nonce)
        if isinstance(planned, Failed):
            return self._fail(planned.error)
        self.attempts += 1
        self.pending = planned
        self.state = State.WRITING
        return planned

    def _done(self, write: Write, resolved_uncertain: bool) -> Done:
        self.state = State.DONE
        self.pending = None
        snapshot = Snapshot(write.record, next_znode_version(write.expected_version))
        self.floor = snapshot.last_issued
        return Done(write.results, snapshot, resolved_uncertain)

    def _fail(self, error: AtomlogError) -> Failed:
        self.state = State.FAILED
        self.pending = None
        return Failed(error)
