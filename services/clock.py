"""A process's steady clock in milliseconds: the wall clock at the process's start plus
the monotonic time since. It reads like the wall clock and never steps: for deadlines
and ages that live in this process's memory only (subscription deliveries' ack
timeouts, followers' lag), where a wall clock stepped back (an NTP step, a resumed VM)
held them for as long as the step and one stepped forward fired them all at once.
Values written to disk or sent to another process stay wall-clock times."""

from __future__ import annotations

import time

_WALL_MS = time.time_ns() // 1_000_000
_MONOTONIC_NS = time.monotonic_ns()


def steady_ms() -> int:
    return _WALL_MS + (time.monotonic_ns() - _MONOTONIC_NS) // 1_000_000
