"""The coordinator's counters read from its TC partitions' cores at scrape time
(coordinator/metrics.py CoreCollector): they never go down when a TC partition moves
away or reloads into a new core."""

from __future__ import annotations

import dataclasses

from coordinator.core import CoreMetrics
from coordinator.metrics import CoreCollector

ZERO = CoreMetrics(**{field.name: 0 for field in dataclasses.fields(CoreMetrics)})


class Core:
    def __init__(self, **counters: int):
        self.metrics = dataclasses.replace(ZERO, **counters)


def counters(collector: CoreCollector) -> dict[str, float]:
    return {family.name: family.samples[0].value for family in collector.collect()
            if family.type == "counter"}


def test_counters_keep_what_cores_gone_counted():
    """A coordinator owning TC partitions for days summed their cores' counters; one
    partition moved away (or reloaded into a new core, starting at 0) and the sum fell.
    Prometheus reads a fall as a counter reset and counts the whole remaining value as
    new: false spikes on the dashboards, and the timeout alert fired with no timeouts."""
    a, b = Core(timeouts_total=100, marker_resends_total=7), Core(timeouts_total=100)
    cores = [a, b]
    collector = CoreCollector(lambda: cores, lambda: 0)
    first = counters(collector)
    assert first["atomlog_coordinator_core_timeouts"] == 200
    cores = [a]  # b's TC partition moved away
    assert counters(collector)["atomlog_coordinator_core_timeouts"] == 200
    cores = [a, Core(timeouts_total=3)]  # it came back: a new core, counting from 0
    assert counters(collector)["atomlog_coordinator_core_timeouts"] == 203
    a.metrics = dataclasses.replace(a.metrics, timeouts_total=150)
    again = counters(collector)
    assert again["atomlog_coordinator_core_timeouts"] == 253
    assert again["atomlog_coordinator_core_marker_resends"] == 7
    for name, value in again.items():
        assert value >= first[name], name


def test_no_metric_label_is_one_the_scrape_adds():
    """Prometheus's scrape configs (deploy/prometheus, and `atomlog up --prometheus`)
    add `role`, `instance_name`, `namespace`, `job` and `instance` to every series; a
    metric's own label of one of those names is renamed `exported_<name>` at the scrape,
    so queries grouping by it (the scrubber's panel grouped by `role`) got the target's
    value instead. atomlog_build_info's `role` is the process's role, the same value."""
    import importlib

    from prometheus_client import REGISTRY

    for module in ("partition_server.server", "coordinator.server", "id_allocator.server",
                   "services.runtime"):
        importlib.import_module(module)
    reserved = {"role", "instance_name", "namespace", "job", "instance"}
    clashes = {}
    for collector in list(REGISTRY._collector_to_names):
        names = REGISTRY._collector_to_names[collector]
        labels = set(getattr(collector, "_labelnames", ()) or ())
        if labels & reserved and not any(n.startswith("atomlog_build") for n in names):
            clashes[tuple(names)] = labels & reserved
    assert not clashes, clashes
