"""services/fastmetrics.py: the same exposition as prometheus_client's counters and
histograms for the same updates, no update lost across threads, the same refusals.

Every test runs twice: with the native core's metric cells (as servers run) and with the
Python children, the reference."""

from __future__ import annotations

import random
import threading

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from partition_server import native
from services import fastmetrics


@pytest.fixture(autouse=True, params=["native", "python"])
def cells(request, monkeypatch):
    """Metrics made in the test get the native core's cells, or the Python children."""
    if request.param == "native":
        if native.core is None:
            pytest.skip(native.status())
    else:
        monkeypatch.setattr(fastmetrics, "_cells", lambda: None)
    return request.param

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _pair(kind: str, *args, **kwargs):
    """The same metric from prometheus_client and from fastmetrics, each in a registry of
    its own."""
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    return (theirs, getattr(prometheus_client, kind)(*args, registry=theirs, **kwargs),
            ours, getattr(fastmetrics, kind)(*args, registry=ours, **kwargs))


def _exposition(registry) -> str:
    # prometheus_client's own metrics carry `_created` series unless disabled
    # (services/metrics.py disables them process-wide); ours never do.
    return "\n".join(line for line in generate_latest(registry).decode().splitlines()
                     if "_created" not in line)


def test_counters_expose_as_prometheus_client():
    random.seed(7)
    for name in ("atomlog_test_things_total", "atomlog_test_things"):
        theirs_registry, theirs, ours_registry, ours = _pair("Counter", name, "Things.")
        assert _exposition(ours_registry) == _exposition(theirs_registry)  # 0 before any
        for _ in range(100):
            amount = random.choice((1, 2, 0.5, 0))
            theirs.inc(amount)
            ours.inc(amount)
        assert _exposition(ours_registry) == _exposition(theirs_registry)

    theirs_registry, theirs, ours_registry, ours = _pair(
        "Counter", "atomlog_test_calls_total", "Calls.", ["method", "code"])
    assert _exposition(ours_registry) == _exposition(theirs_registry)  # no series yet
    for _ in range(200):
        values = (random.choice(("Produce", "Fetch")), random.choice(("OK", 14)))
        amount = random.randint(0, 3)
        theirs.labels(*values).inc(amount)
        ours.labels(*values).inc(amount)
    assert _exposition(ours_registry) == _exposition(theirs_registry)
    # Given as 14 or as "14", the label value is one series.
    assert ours.labels("Fetch", 14) is ours.labels("Fetch", "14")


def test_histograms_expose_as_prometheus_client():
    random.seed(11)
    for kwargs in ({}, {"buckets": BUCKETS}, {"buckets": (1, 2, 4, float("inf"))}):
        theirs_registry, theirs, ours_registry, ours = _pair(
            "Histogram", "atomlog_test_seconds", "Durations.", **kwargs)
        assert _exposition(ours_registry) == _exposition(theirs_registry)
        for _ in range(500):
            # On the bounds too: a value equal to a bound counts in that bucket.
            value = random.choice((random.uniform(0, 20), random.choice(BUCKETS), 0, 4))
            theirs.observe(value)
            ours.observe(value)
        assert _exposition(ours_registry) == _exposition(theirs_registry)

    theirs_registry, theirs, ours_registry, ours = _pair(
        "Histogram", "atomlog_test_call_seconds", "Calls.", ["method"], buckets=BUCKETS)
    for _ in range(300):
        method, value = random.choice(("a", "b", "c")), random.expovariate(10)
        theirs.labels(method).observe(value)
        ours.labels(method).observe(value)
    assert _exposition(ours_registry) == _exposition(theirs_registry)
    assert ours_registry.get_sample_value("atomlog_test_call_seconds_count",
                                          {"method": "a"}) == \
        theirs_registry.get_sample_value("atomlog_test_call_seconds_count", {"method": "a"})


def test_no_update_is_lost_across_threads():
    registry = CollectorRegistry()
    counter = fastmetrics.Counter("atomlog_test_hits_total", "Hits.", ["kind"],
                                  registry=registry)
    plain = fastmetrics.Counter("atomlog_test_plain_total", "Plain.", registry=registry)
    histogram = fastmetrics.Histogram("atomlog_test_h_seconds", "H.", buckets=BUCKETS,
                                      registry=registry)
    threads, per_thread = 8, 20_000
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        child = counter.labels("x")
        for i in range(per_thread):
            child.inc()
            plain.inc(2)
            histogram.observe(0.005 if i % 2 else 5.0)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    total = threads * per_thread
    assert registry.get_sample_value("atomlog_test_hits_total", {"kind": "x"}) == total
    assert registry.get_sample_value("atomlog_test_plain_total") == 2 * total
    assert registry.get_sample_value("atomlog_test_h_seconds_count") == total
    assert registry.get_sample_value("atomlog_test_h_seconds_bucket", {"le": "0.01"}) == \
        total / 2
    assert registry.get_sample_value("atomlog_test_h_seconds_sum") == \
        pytest.approx(total / 2 * 5.005)


def test_refusals_as_prometheus_client():
    registry = CollectorRegistry()
    counter = fastmetrics.Counter("atomlog_test_a_total", "A.", registry=registry)
    with pytest.raises(ValueError):
        counter.inc(-1)
    labelled = fastmetrics.Counter("atomlog_test_b_total", "B.", ["topic"], registry=registry)
    with pytest.raises(ValueError):
        labelled.inc()  # no labels given
    with pytest.raises(ValueError):
        labelled.labels("a", "b")
    with pytest.raises(ValueError):
        counter.labels("a")
    with pytest.raises(ValueError):  # the name is taken in this registry
        fastmetrics.Counter("atomlog_test_a_total", "Again.", registry=registry)
    with pytest.raises(ValueError):
        fastmetrics.Histogram("atomlog_test_c_seconds", "C.", ["le"], registry=registry)
    with pytest.raises(ValueError):
        fastmetrics.Histogram("atomlog_test_d_seconds", "D.", buckets=(2, 1),
                              registry=registry)
    with pytest.raises(ValueError):
        fastmetrics.Counter("atomlog_test_e_total", "E.", ["__reserved"], registry=registry)
    assert registry.get_sample_value("atomlog_test_a_total") == 0
