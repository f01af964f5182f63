"""Benchmark (issue 24): what security costs, TLS + mTLS + authentication + ACLs on
against everything off, on the same machine in the same run.

Three local clusters, one after the other, each of three partition servers, one
coordinator and one id allocator, every partition in --replication-factor copies: a
plaintext one (`atomlog up`), a secured one (`atomlog up --tls`: a local CA, mutual TLS on
every gRPC port and on the servers' links, server to server included,
auth.mode=mtls, auth.authorizer=acl with the client certificate's principal atomlog-admin
a super user, and the ZooKeeper digest), and the secured one with replication.link=false
and coordinator.client_link=false (followers' copies, the coordinator's calls and the
client's commits over gRPC, as under TLS before the links spoke it). On each it
measures:

- produce: wire producers (bench/produce.py's wire_producer: separate processes sending
  pre-encoded idempotent batches of 256 KiB of 1 KiB records, 5 in flight per partition)
  to a topic of 3 partitions, one led by each server, for --seconds. On the secured
  cluster the same producer runs with its channels secured by the admin certificate.
- small transactions: one SDK client, one-call transactions of one 100-byte record each
  to a rotating partition, back to back, for --seconds: transactions/s and commit p50/p99.

Every request on the secured cluster is authenticated and authorized (the super user
short-cuts the ACL lookup, so this is the floor of the authorizer's cost, not that of a
principal with many ACLs). Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/tls.py [--seconds 8] [--replication-factor 3] [--no-docs]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

import common  # noqa: E402
import produce  # noqa: E402
import replication  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/tls.py: begin -->", "<!-- bench/tls.py: end -->"
PARTITIONS = replication.PARTITIONS
PRODUCERS = replication.PRODUCERS
BATCH_KIB = replication.BATCH_KIB


# (name, `atomlog up` flags): the plaintext cluster, the secured one, and the secured one
# without links (their TLS, since 2026-11-29; before, a server with TLS opened none:
# every coordinator call and follower copy went over gRPC; the coordinators' links for
# the clients' commits came on 2026-11-30).
CLUSTERS = (("plain", ()), ("secured", ("--tls",)),
            ("secured_no_link", ("--tls", "--set", "replication.link=false",
                                 "--set", "coordinator.client_link=false")))


def start_cluster(data_dir: Path, flags: tuple, factor: int) -> dict:
    return replication.start_cluster(
        data_dir, "--set", f"topics.default_replication_factor={factor}", *flags)


def client_tls(info: dict):
    """The SDK's TlsConfig of a secured cluster (its admin client certificate), or None."""
    from spark_client import TlsConfig

    tls = info.get("tls")
    return TlsConfig(tls["ca_file"], tls["cert_file"], tls["key_file"]) if tls else None


def secured_wire_producer(tls_files: dict, *args) -> None:
    """bench/produce.py's wire_producer with every channel it opens secured by the admin
    certificate (this is a process of its own: replacing its grpc.aio.insecure_channel
    and its SDK Client touches nothing else)."""
    import grpc

    import spark_client
    from services.tls import ChannelTls, TlsConfig

    config = TlsConfig(tls_files["ca_file"], tls_files["cert_file"], tls_files["key_file"])
    channel_tls = ChannelTls(config)
    grpc.aio.insecure_channel = lambda address, options=None, **_: channel_tls.aio_channel(
        address, options)
    spark_client.Client = functools.partial(spark_client.Client, tls=config)
    produce.wire_producer(*args)


def wait_ready(client, topic: str, partitions: int, timeout_s: float = 30.0) -> None:
    """Until every partition answers end offsets through the SDK (TLS or not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with client.consumer(topic, isolation="read_uncommitted") as reader:
                ends = reader.end_offsets()
            if len(ends) == partitions:
                return
        except Exception:  # noqa: BLE001 — not yet loaded
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def run(seconds: float, factor: int) -> dict:
    from spark_client import Client

    results: dict = {"machine": common.machine(os.getloadavg()[0]), "factor": factor}
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-tls-") as tmp:
        for name, flags in CLUSTERS:
            data_dir = Path(tmp) / name
            tls = "--tls" in flags
            try:
                info = start_cluster(data_dir, flags, factor)
                with Client(info["bootstrap"], tls=client_tls(info)) as client:
                    client.create_topic("bench-produce", partitions=PARTITIONS)
                    client.create_topic("bench-txn", partitions=PARTITIONS)
                    wait_ready(client, "bench-produce", PARTITIONS)
                    wait_ready(client, "bench-txn", PARTITIONS)
                    if factor > 1:
                        replication.wait_in_sync(client, "bench-produce")
                        replication.wait_in_sync(client, "bench-txn")
                    cell = replication.measure_cell(
                        client, info, seconds,
                        functools.partial(secured_wire_producer, info["tls"]) if tls
                        else produce.wire_producer)
                    results[name] = cell
                print(f"{name}: {cell}", flush=True)
            finally:
                replication.stop_cluster(data_dir)
    return results


def table(results: dict) -> str:
    off, on, unlinked = results["plain"], results["secured"], results["secured_no_link"]

    def row(what: str, key: str, digits: int = 1, ratios: bool = True) -> tuple:
        values = [f"{cell[key]:.{digits}f}" for cell in (off, on, unlinked)]
        return (what, *values, f"{on[key] / off[key]:.2f}" if ratios else "",
                f"{on[key] / unlinked[key]:.2f}" if ratios else "")

    def latency(what: str, p50: str, p99: str) -> tuple:
        return (what, *[f"{cell[p50]:.1f} / {cell[p99]:.1f}" for cell in (off, on, unlinked)],
                "", "")

    rows = [
        row("produce MB/s (2 wire producers, 3 partitions, 256 KiB batches)", "mb_s"),
        latency("produce ack p50 / p99 ms", "ack_p50_ms", "ack_p99_ms"),
        row("partition servers' CPU per MB acknowledged (ms)", "server_cpu_ms_per_mb"),
        row("wire producers' CPU per MB (ms)", "client_cpu_ms_per_mb"),
        row("small transactions/s (one client, one-call, back to back)", "txn_s", 0),
        latency("commit p50 / p99 ms", "p50_ms", "p99_ms"),
        row("partition servers' CPU per transaction (ms)", "server_cpu_ms_per_txn"),
        row("all servers' CPU per transaction (ms; the coordinator too)",
            "all_servers_cpu_ms_per_txn"),
    ]
    lines = ["| measure | plaintext | TLS + mTLS + ACLs | the same, links off | "
             "secured / plaintext | secured: links on / off |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def write_docs(text: str, results: dict, seconds: float) -> None:
    off, on, unlinked = results["plain"], results["secured"], results["secured_no_link"]
    factor = results["factor"]
    section = "\n".join([
        BEGIN,
        f"### Security: TLS + mTLS + ACLs on against off (issue 24), {time.strftime('%Y-%m-%d')}",
        "",
        f"`.venv/bin/python bench/tls.py --seconds {seconds:g} --replication-factor {factor}`: "
        "three clusters one after the other on this 2-core machine, each of three partition "
        f"servers, one coordinator and one id allocator, replication factor {factor}. The "
        "secured ones are made by `atomlog up --tls` (mutual TLS on every gRPC port and on "
        "the servers' links, server to server too, auth.mode=mtls, "
        "auth.authorizer=acl with the client as super user, ZooKeeper digest); the third "
        "also has `replication.link=false` and `coordinator.client_link=false`, so "
        "followers copy, the coordinator stages, appends to its TC log and sends markers, "
        "and the client commits over gRPC, as every secured cluster did before the links "
        "spoke TLS. Errors seen by the wire producers: plaintext "
        f"{off['errors'] or 'none'}, secured {on['errors'] or 'none'}, links off "
        f"{unlinked['errors'] or 'none'}. Machine: {results['machine']}.",
        "",
        text,
        "",
        f"The cost, as secured / plaintext: produce throughput {on['mb_s'] / off['mb_s']:.2f}, "
        f"small transactions/s {on['txn_s'] / off['txn_s']:.2f} (a ratio of 1 means no "
        "cost; one run each, so a few percent either way is noise). Produce pays for "
        "encrypting and decrypting every byte on both ends (TLS record encryption in gRPC's "
        "BoringSSL, and OpenSSL's on the links) on the same two cores that run the servers "
        "and producers; a small transaction pays per call (the principal from the "
        "certificate, the authorizer's check) on its client-to-server and server-to-server "
        "calls. What the links' TLS gives a secured cluster, as links on / off: produce "
        f"{on['mb_s'] / unlinked['mb_s']:.2f}, small transactions/s "
        f"{on['txn_s'] / unlinked['txn_s']:.2f}, all servers' CPU per transaction "
        f"{on['all_servers_cpu_ms_per_txn'] / unlinked['all_servers_cpu_ms_per_txn']:.2f}.",
        END])
    common.write_docs_section(section, BEGIN, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--replication-factor", type=int, default=3,
                        help="copies of each partition (3: the product's default here)")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    results = run(args.seconds, args.replication_factor)
    text = table(results)
    print(text)
    if not args.no_docs:
        write_docs(text, results, args.seconds)


if __name__ == "__main__":
    main()
