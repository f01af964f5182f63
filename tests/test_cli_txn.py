"""`atomlog txn ...` and `atomlog partition describe`: the CLI as a separate process
against the real session cluster, plus the pure parts (transaction-id form, the
find-hanging classification and its report) without one."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from atomlog.v1 import partition_pb2
from coordinator.records import TxnId
from services.cli import (CoordinatorView, _OpenHere, _print_findings, classify_open_transaction,
                          format_txn_id, parse_txn_id)
from spark_client import Client, errors
from tests.conftest import REPO_ROOT, atomlog, wait_until

TOPIC = "cli-txn"
LATE_MS = 900_000


# ------------------------------------------------------------------ pure parts
def test_transaction_id_form_round_trips_and_matches_the_coordinator_and_sdk():
    parsed = parse_txn_id(" 3:17 ")
    assert (parsed.tc_partition, parsed.sequence) == (3, 17)
    assert format_txn_id(parsed) == "3:17" == str(TxnId(3, 17))
    biggest = f"{(1 << 32) - 1}:{(1 << 64) - 1}"
    assert format_txn_id(parse_txn_id(biggest)) == biggest
    for bad in ("", "3", "3:", ":17", "3:17:1", "a:1", "-1:5", "3:-5", "3.0:1", "3:0",
                f"{1 << 32}:1", f"1:{1 << 64}"):
        with pytest.raises(ValueError):
            parse_txn_id(bad)


@pytest.mark.parametrize(("age_ms", "view", "verdict"), [
    # The coordinator will never send this partition a marker.
    (10, CoordinatorView("UNKNOWN"), "HANGING"),
    (10, CoordinatorView("COMMITTED"), "HANGING"),
    (10, CoordinatorView("ABORTED"), "HANGING"),
    (10, CoordinatorView("ABORTING", registered=True, marker_pending=False), "HANGING"),
    (10, CoordinatorView("COMMITTING", registered=True, marker_pending=False), "HANGING"),
    (10, CoordinatorView("OPEN", registered=False), "HANGING"),
    (LATE_MS * 2, CoordinatorView("PREPARED", registered=False), "HANGING"),
    # Still undecided, or the marker still on its way, but for too long.
    (LATE_MS, CoordinatorView("OPEN", registered=True), "LATE"),
    (LATE_MS * 3, CoordinatorView("PREPARED", registered=True), "LATE"),
    (LATE_MS, CoordinatorView("COMMITTING", registered=True, marker_pending=True), "LATE"),
    # Normal life.
    (LATE_MS - 1, CoordinatorView("OPEN", registered=True), "OK"),
    (0, CoordinatorView("PREPARED", registered=True), "OK"),
    (10, CoordinatorView("ABORTING", registered=True, marker_pending=True), "OK"),
])
def test_classify_open_transaction(age_ms, view, verdict):
    finding = classify_open_transaction(age_ms, view, LATE_MS, "3:17")
    assert finding.verdict == verdict
    assert finding.explanation
    assert bool(finding.remedy) == (verdict != "OK")


def test_late_remedies_name_the_abort_command():
    late_open = classify_open_transaction(LATE_MS, CoordinatorView("OPEN", True), LATE_MS, "3:17")
    assert "atomlog txn abort 3:17" in late_open.remedy
    assert "--allow-prepared" not in late_open.remedy
    late_prepared = classify_open_transaction(LATE_MS, CoordinatorView("PREPARED", True),
                                              LATE_MS, "3:17")
    assert "atomlog txn abort 3:17 --allow-prepared" in late_prepared.remedy
    with pytest.raises(ValueError):
        classify_open_transaction(0, CoordinatorView("UNSPECIFIED"), LATE_MS)


def test_find_hanging_report_of_findings(capsys):
    """The report of a HANGING finding, fed by hand: on a healthy cluster verification and
    durable markers leave no transaction that its coordinator will not end, so the real
    cluster produces LATE findings only (see the end-to-end test below)."""
    open_here = _OpenHere("127.0.0.1:1", "orders", 2, partition_pb2.OpenTransaction(
        txn_id={"tc_partition": 3, "sequence": 17}, first_offset=40, last_offset=44,
        producer_id=9, age_ms=1_000_000))
    view = CoordinatorView("ABORTED")
    findings = [(open_here, view, classify_open_transaction(1_000_000, view, LATE_MS, "3:17"))]
    _print_findings(findings, 1, 5, "json")
    report = json.loads(capsys.readouterr().out)
    assert report["findings"][0] | {"explanation": None, "remedy": None} == {
        "verdict": "HANGING", "txn_id": "3:17", "topic": "orders", "partition": 2,
        "first_offset": 40, "last_offset": 44, "producer_id": 9, "age_ms": 1_000_000,
        "coordinator_state": "ABORTED", "explanation": None, "remedy": None}
    _print_findings(findings, 1, 5, "table")
    text = capsys.readouterr().out
    assert "HANGING" in text and "3:17 on orders/2" in text and "1 hanging, 0 late" in text


# ------------------------------------------------------------------ against the cluster
@pytest.fixture(scope="module")
def client(cluster):
    client = Client(cluster.info["bootstrap"])
    try:
        client.create_topic(TOPIC, partitions=2)
    except errors.TopicAlreadyExists:
        pass
    yield client
    client.close()


def run_json(cluster, *args: str):
    return json.loads(cluster.run(*args, "--output", "json").stdout)


def listed_ids(cluster, *args: str) -> dict[str, str]:
    return {t["txn_id"]: t["state"] for t in run_json(cluster, "txn", "list", *args)["transactions"]}


def test_list_describe_and_abort_an_open_transaction(cluster, client):
    txn = client.begin_transaction(timeout_s=120)
    txn.register_partitions([(TOPIC, 0), (TOPIC, 1)])

    assert listed_ids(cluster)[txn.id] == "OPEN"
    assert txn.id in listed_ids(cluster, "--state", "OPEN", "--state", "prepared")
    assert txn.id not in listed_ids(cluster, "--state", "COMMITTED")
    assert txn.id not in listed_ids(cluster, "--older-than", "3600")
    listing = run_json(cluster, "txn", "list", "--limit", "1")
    assert len(listing["transactions"]) == 1
    not_searched = [item["tc_partition"] for item in listing["tc_partitions_not_searched"]]
    assert sorted(listing["tc_partitions_searched"] + not_searched) == list(range(16))
    table = cluster.run("txn", "list", "--state", "OPEN").stdout
    assert txn.id in table and "OPEN" in table and "of 16 TC partitions" in table

    described = run_json(cluster, "txn", "describe", txn.id)
    assert described["summary"]["txn_id"] == txn.id
    assert described["summary"]["state"] == "OPEN"
    assert described["summary"]["end_cause"] is None
    assert described["topic_partitions"] == [{"topic": TOPIC, "partition": 0},
                                             {"topic": TOPIC, "partition": 1}]
    text = cluster.run("txn", "describe", txn.id).stdout
    assert f"transaction {txn.id}: OPEN" in text
    assert f"{TOPIC}/0, {TOPIC}/1" in text

    # No confirmation without a terminal: nothing happens.
    refused = subprocess.run([sys.executable, "-m", "services", "txn", "abort", txn.id,
                              "--data-dir", str(cluster.data_dir)], cwd=REPO_ROOT,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                             check=False)
    assert refused.returncode != 0 and "--yes" in refused.stderr
    assert txn.state() == "OPEN"

    aborted = run_json(cluster, "txn", "abort", txn.id, "--yes", "--reason", "test_cli_txn")
    assert aborted["state"] in ("ABORTING", "ABORTED") and not aborted["already_ended"]
    again = cluster.run("txn", "abort", txn.id, "--yes")
    assert "already aborted" in again.stdout
    assert txn.state() in ("ABORTING", "ABORTED")
    after = run_json(cluster, "txn", "describe", txn.id)["summary"]
    assert after["end_cause"] == "OPERATOR"
    assert listed_ids(cluster, "--state", "ABORTING", "--state", "ABORTED")[txn.id] in (
        "ABORTING", "ABORTED")


def test_abort_refusals_say_why(cluster, client):
    prepared = client.begin_transaction(timeout_s=120)
    prepared.register_partitions([(TOPIC, 1)])
    prepared.prepare()
    refused = cluster.run("txn", "abort", prepared.id, "--yes", check=False)
    assert refused.returncode == 1
    assert "TRANSACTION_PREPARED" in refused.stderr and "--allow-prepared" in refused.stderr
    assert prepared.state() == "PREPARED"
    assert cluster.run("txn", "abort", prepared.id, "--yes", "--allow-prepared").returncode == 0
    assert prepared.state() in ("ABORTING", "ABORTED")

    committed = client.begin_transaction(timeout_s=120)
    committed.register_partitions([(TOPIC, 0)])
    committed.commit()
    refused = cluster.run("txn", "abort", committed.id, "--yes", check=False)
    assert refused.returncode == 1 and "TRANSACTION_ALREADY_COMMITTED" in refused.stderr


@pytest.mark.parametrize(("text", "code", "says"), [
    ("abc", 2, "<tc partition>:<sequence>"),
    ("3:0", 2, "sequence"),
    ("99:1", 2, "TC partitions 0..15"),
    ("5:987654321", 1, "UNKNOWN_TRANSACTION"),
])
def test_bad_transaction_ids(cluster, text, code, says):
    result = cluster.run("txn", "describe", text, check=False)
    assert result.returncode == code, result
    assert says in result.stderr and result.stdout == ""


def test_find_hanging_on_a_cluster_without_open_transactions(cluster, client):
    report = run_json(cluster, "txn", "find-hanging")
    assert report["findings"] == [] and report["complete"]
    assert report["listed_partitions"] >= 16 + 2  # __txn_log included
    text = cluster.run("txn", "find-hanging", "--older-than", "0", "--late-after", "1").stdout
    assert "no hanging or late transactions" in text


def test_find_hanging_lists_a_late_transaction_and_abort_keeps_its_data_invisible(
        cluster, client):
    """End to end: transactional data sits on a partition while its writer is gone (it
    neither commits nor aborts). Once it has been open there for longer than
    --late-after, find-hanging lists it as LATE — its coordinator still says OPEN — and
    names the remedy; `atomlog txn abort` it, and read_committed never shows its data
    (while a write after it becomes readable: the partition is not stuck behind it)."""
    partition = 1
    txn = client.begin_transaction(timeout_s=120)  # the writer "goes away" after the sends
    with client.producer() as producer:
        for i in range(5):
            producer.send(TOPIC, f"late-{txn.id}-{i}", partition=partition, txn=txn)
        producer.flush()
    time.sleep(1.2)  # open on the partition for longer than --late-after 1

    found = cluster.run("txn", "find-hanging", "--late-after", "1", "--output", "json",
                        check=False)
    assert found.returncode == 3, found  # 3: a HANGING or LATE transaction was found
    mine = [f for f in json.loads(found.stdout)["findings"] if f["txn_id"] == txn.id]
    assert len(mine) == 1, found.stdout
    finding = mine[0]
    assert (finding["verdict"], finding["topic"], finding["partition"],
            finding["coordinator_state"]) == ("LATE", TOPIC, partition, "OPEN")
    assert finding["age_ms"] >= 1000 and finding["last_offset"] >= finding["first_offset"]
    assert f"atomlog txn abort {txn.id}" in finding["remedy"]
    table = cluster.run("txn", "find-hanging", "--late-after", "1", check=False)
    assert table.returncode == 3 and "LATE" in table.stdout
    assert f"{txn.id} on {TOPIC}/{partition}" in table.stdout
    # Younger than the default --late-after (15 minutes): nothing to report about it.
    quiet = cluster.run("txn", "find-hanging", "--output", "json", check=False)
    assert txn.id not in {f["txn_id"] for f in json.loads(quiet.stdout)["findings"]}

    aborted = run_json(cluster, "txn", "abort", txn.id, "--yes", "--reason", "late in a test")
    assert aborted["state"] in ("ABORTING", "ABORTED")

    def marker_applied() -> bool:
        described = run_json(cluster, "partition", "describe", TOPIC, str(partition))
        return txn.key not in {(t["txn_id"]["tc_partition"], int(t["txn_id"]["sequence"]))
                               for t in described["open_transactions"]}

    wait_until(marker_applied, 20, "the ABORT marker on the partition")
    after = run_json(cluster, "txn", "find-hanging", "--late-after", "1")["findings"]
    assert txn.id not in {f["txn_id"] for f in after}
    with client.producer() as producer:
        producer.send(TOPIC, f"after-{txn.id}", partition=partition).result(10)
    prefix = f"late-{txn.id}-".encode()
    with client.consumer(TOPIC, isolation="read_committed") as reader:
        seen, deadline = [], time.monotonic() + 20
        while f"after-{txn.id}".encode() not in seen and time.monotonic() < deadline:
            seen.extend(m.value for m in reader.poll(timeout_s=0.2, max_records=10_000))
    assert f"after-{txn.id}".encode() in seen
    assert not [v for v in seen if v.startswith(prefix)]
    with client.consumer(TOPIC, isolation="read_uncommitted") as reader:
        raw, deadline = [], time.monotonic() + 20
        while f"after-{txn.id}".encode() not in raw and time.monotonic() < deadline:
            raw.extend(m.value for m in reader.poll(timeout_s=0.2, max_records=10_000))
    assert len([v for v in raw if v.startswith(prefix)]) == 5  # written, then aborted


def test_partition_describe_shows_transaction_state(cluster, client):
    text = cluster.run("partition", "describe", TOPIC, "0").stdout
    assert text.startswith(f"{TOPIC}-0: ONLINE")
    for part in ("max read position", "transaction buffer:", "open transaction(s)",
                 "aborted transaction(s)", "coordinator epochs seen:", "subscription(s)"):
        assert part in text
    described = run_json(cluster, "partition", "describe", TOPIC, "0")
    assert described["topic_partition"] == {"topic": TOPIC, "partition": 0}
    for key in ("open_transactions", "transaction_buffer_ready", "coordinator_epochs",
                "subscriptions", "aborted_transaction_count"):
        assert key in described


@pytest.mark.parametrize("command", [("txn", "list"), ("txn", "describe"), ("txn", "abort"),
                                     ("txn", "find-hanging"), ("partition", "describe")])
def test_every_command_has_help_with_an_example(command):
    assert "Example:" in atomlog(*command, "--help").stdout
