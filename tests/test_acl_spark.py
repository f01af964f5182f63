"""The Spark data source under ACLs (issue 24, item 3): on an `atomlog up --tls` cluster
(auth.authorizer=acl; every role its own process), a principal with write and read on a
topic prefix writes exactly once through the parent/child two-phase commit (driver and
executors are the same principal: the driver's commit continues the executors'
children) and reads back; one without write is refused PERMISSION_DENIED and nothing is
written."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.acl import Acl
from spark_client import Client
from tests.conftest import Cluster, create_online, wait_until
from tests.test_acl import acls, store  # noqa: F401 — the module's ACL entries, removed after
from tests.test_acl import tls_of

pyspark = pytest.importorskip("pyspark")
pytestmark = pytest.mark.timeout(180)

TOPIC = "acl-spark"


@pytest.fixture(scope="module")
def acl_cluster(acl_secured):
    """The suite's secured cluster (conftest.acl_secured) with this module's topic."""
    with Client(acl_secured.info["bootstrap"], tls=tls_of(acl_secured, "admin")) as admin:
        create_online(admin, TOPIC, 2)
    return acl_secured


def options(cluster: Cluster, principal: str) -> dict[str, str]:
    tls = tls_of(cluster, principal)
    return {"bootstrap": cluster.info["bootstrap"], "topic": TOPIC, "tls.ca": tls.ca_file,
            "tls.cert": tls.cert_file, "tls.key": tls.key_file}


def committed(cluster: Cluster) -> list[bytes]:
    with Client(cluster.info["bootstrap"], tls=tls_of(cluster, "admin")) as admin:
        with admin.consumer(TOPIC) as consumer:
            return sorted(m.value for batch in consumer.read_until() for m in batch)


def test_spark_writes_and_reads_under_acls_and_is_refused_without(acl_cluster, acls, spark):
    acls(Acl("carol", "topic", "acl-", "write", pattern="prefix"),
         Acl("carol", "topic", "acl-", "read", pattern="prefix"))
    # The cluster is shared: judge only the lines its servers log during this test (the
    # refusal is logged where the first refused call lands: a partition server or a
    # coordinator).
    logs = {Path(p["log_file"]): Path(p["log_file"]).stat().st_size
            for p in acl_cluster.services()}
    rows = spark.range(0, 200, numPartitions=2).selectExpr(
        "concat('row-', cast(id as string)) as value")
    writer = rows.write.format("atomlog").mode("append")
    for key, value in options(acl_cluster, "carol").items():
        writer = writer.option(key, value)
    writer.save()
    assert len(committed(acl_cluster)) == 200
    reader = spark.read.format("atomlog")
    for key, value in options(acl_cluster, "carol").items():
        reader = reader.option(key, value)
    assert reader.load().count() == 200
    # Dave may do nothing: the write fails with the reason, and nothing is written.
    refused = rows.write.format("atomlog").mode("append")
    for key, value in options(acl_cluster, "dave").items():
        refused = refused.option(key, value)
    with pytest.raises(Exception) as caught:
        refused.save()
    assert "PERMISSION_DENIED" in str(caught.value)
    wait_until(lambda: len(committed(acl_cluster)) == 200, 5, "nothing more to be visible")
    log = ""
    for path, start in logs.items():
        with open(path, "rb") as log_file:
            log_file.seek(start)
            log += log_file.read().decode()
    assert '"principal":"dave"' in log.replace(" ", "")
