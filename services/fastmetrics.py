"""Counters and histograms for the hot paths, exposed exactly as prometheus_client's.

prometheus_client's Counter.inc and Histogram.observe take a lock per value they touch
(a histogram: its sum and one bucket), check the metric is observable, and walk the
buckets one by one; `labels()` validates and locks too. A one-call transaction on the
combined server made about 40 counter increments, 29 observations and 12 `labels()`
calls (cProfile, 2026-11-30): with prometheus_client that was 7% of the event loop's
time. These classes keep the same names, label rules, buckets and exposition (the
registry renders them through `collect()`, as any collector), with no lock:

- every child keeps one shard of values per thread that updates it (a dict keyed by
  `threading.get_ident()`), and only that thread writes its shard, so no update is ever
  lost, whatever the threads (the event loop, executor threads, the durability
  barrier's thread);
- a scrape sums the shards (a thread writing meanwhile may or may not be in the sum, as
  with any concurrent scrape);
- a child holds at most one shard per thread that ever updated it: the servers update
  metrics from their event loop, their executors' bounded pools and a few long-lived
  threads, never from a thread per request;
- `labels()` caches its children by the tuple of values given;
- a histogram finds its bucket by bisection.

With the native core (partition_server/native.py) a child is a cell of it instead
(`CounterCell`, `HistogramCell`: one value per child, updated under the GIL, so nothing
is lost either; an update costs one call into it). The classes below stay the reference
and serve without it; tests/test_fastmetrics.py runs on both.

The API is the subset this project uses: `Counter(name, documentation, labelnames)`,
`Histogram(name, documentation, labelnames, buckets=)`, `.labels(*values)`,
`.inc(amount)`, `.observe(amount)`. Gauges stay prometheus_client's.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from threading import get_ident

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics import Histogram as _PrometheusHistogram
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

__all__ = ["Counter", "Histogram"]

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class _Metric(Collector):
    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = REGISTRY):
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        for label in self._labelnames:
            if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r}")
        self._children: dict[tuple, _Child] = {}
        if not self._labelnames:
            only = self._children[()] = self._child()
            self._bind(only)  # inc()/observe() straight on the one child, no hop
        if registry is not None:
            registry.register(self)

    def _child(self) -> "_Child":
        raise NotImplementedError

    def _bind(self, only: "_Child") -> None:
        raise NotImplementedError

    def labels(self, *values) -> "_Child":
        """The child for these label values (made at the first call)."""
        child = self._children.get(values)
        if child is not None:
            return child
        if not self._labelnames:
            raise ValueError(f"{self._name} has no labels")
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes {len(self._labelnames)} label values, "
                             f"got {len(values)}")
        # Keyed by the values as given (the fast path) and by their strings (the series).
        child = self._children.setdefault(tuple(str(v) for v in values), self._child())
        self._children[values] = child
        return child

    def _labelled(self, *_args) -> None:
        raise ValueError(f"{self._name} has labels {self._labelnames}: call labels() first")

    def _series(self) -> list[tuple[tuple[str, ...], "_Child"]]:
        """Each child once, with its label values as strings."""
        return [(values, child) for values, child in list(self._children.items())
                if all(isinstance(v, str) for v in values)]

    def describe(self):
        return [self._family()]


class _Child:
    __slots__ = ("_shards", "_width")

    def __init__(self, width: int):
        self._shards: dict[int, list[float]] = {}
        self._width = width

    def _shard(self) -> list[float]:
        """This thread's shard (written by this thread only)."""
        shard = self._shards[get_ident()] = [0.0] * self._width
        return shard

    def _sum(self) -> list[float]:
        totals = [0.0] * self._width
        for shard in list(self._shards.values()):
            for i, value in enumerate(shard):
                totals[i] += value
        return totals


class _CounterChild(_Child):
    __slots__ = ()

    def __init__(self):
        super().__init__(1)

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        shard = self._shards.get(get_ident()) or self._shard()
        shard[0] += amount

    def get(self) -> float:
        return self._sum()[0]


def _cells():
    """The native core's metric cells, or None (ATOMLOG_NATIVE=off, not built)."""
    from partition_server import native
    return native.core


class Counter(_Metric):
    """A counter (see the module doc); its exposed name ends in `_total`."""

    def _child(self) -> _CounterChild:
        cells = _cells()
        return _CounterChild() if cells is None else cells.CounterCell()

    def _bind(self, only: _CounterChild) -> None:
        self.inc = only.inc

    inc = _Metric._labelled  # (an unlabelled counter's is its child's: _bind)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self):
        family = self._family()
        for values, child in self._series():
            family.add_metric(values, child.get())
        yield family


class _HistogramChild(_Child):
    __slots__ = ("_bounds",)

    def __init__(self, bounds: tuple[float, ...]):
        super().__init__(1 + len(bounds))  # the sum, then a count per bucket
        self._bounds = bounds

    def observe(self, amount: float) -> None:
        shard = self._shards.get(get_ident()) or self._shard()
        shard[0] += amount
        shard[1 + bisect_left(self._bounds, amount)] += 1


class Histogram(_Metric):
    """A histogram (see the module doc): `buckets` as prometheus_client's (+Inf added)."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = REGISTRY,
                 buckets: Sequence[float] = _PrometheusHistogram.DEFAULT_BUCKETS):
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2:
            raise ValueError("a histogram needs at least one bucket besides +Inf")
        if bounds != sorted(bounds):
            raise ValueError("histogram buckets must be in order")
        if "le" in labelnames:
            raise ValueError("a histogram cannot have the label le")
        self._bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> _HistogramChild:
        cells = _cells()
        return _HistogramChild(self._bounds) if cells is None else \
            cells.HistogramCell(list(self._bounds))

    def _bind(self, only: _HistogramChild) -> None:
        self.observe = only.observe

    observe = _Metric._labelled  # (an unlabelled histogram's is its child's: _bind)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation,
                                     labels=self._labelnames)

    def collect(self):
        family = self._family()
        for values, child in self._series():
            totals = child._sum()
            cumulative, buckets = 0.0, []
            for bound, count in zip(self._bounds, totals[1:]):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(values, buckets, totals[0])
        yield family
