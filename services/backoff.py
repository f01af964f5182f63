"""Retry timing shared by servers and the SDK: exponential backoff with full jitter, bounded."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.02
    maximum_s: float = 1.0
    multiplier: float = 2.0

    def delay(self, attempt: int) -> float:
        """Delay before retry number `attempt` (1-based)."""
        ceiling = min(self.maximum_s, self.initial_s * self.multiplier ** max(0, attempt - 1))
        return random.uniform(ceiling / 2, ceiling)
