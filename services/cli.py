"""`atomlog` — one entry point for running, operating and using an atomlog cluster."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import click
import grpc
from rich.console import Console
from rich.table import Table

from services import __version__
from services.config import (ROLES, ConfigError, check_cluster_settings, describe, load_config,
                             parse_assignments)

DEFAULT_DATA_DIR = ".atomlog"
# Not a terminal (pipes, CI logs): wide enough that addresses are never cut.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)

output_option = click.option("--output", "-o", type=click.Choice(["table", "json"]),
                             default="table", show_default=True, help="Output format.")
data_dir_option = click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
                               default=DEFAULT_DATA_DIR, show_default=True,
                               envvar="ATOMLOG_DATA_DIR",
                               help="Local cluster directory (holds cluster.json).")


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="atomlog")
def cli() -> None:
    """atomlog: a transactional, exactly-once message log.

    Run a local cluster with `atomlog up`, inspect it with `atomlog status`, stop it
    with `atomlog down`. `atomlog serve ROLE` runs one server (what `up` and Kubernetes do).
    """


# ---------------------------------------------------------------- local cluster
@cli.command()
@data_dir_option
@click.option("--partition-servers", default=3, show_default=True, type=click.IntRange(1, 64))
@click.option("--coordinators", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--id-allocators", default=1, show_default=True, type=click.IntRange(1, 16))
@click.option("--set", "assignments", multiple=True, metavar="NAME=VALUE",
              help="A server setting for every process (kept in cluster.json); repeatable.")
@click.option("--timeout", default=90.0, show_default=True, help="Seconds to wait for SERVING.")
@output_option
def up(data_dir: Path, partition_servers: int, coordinators: int, id_allocators: int,
       assignments: tuple[str, ...], timeout: float, output: str) -> None:
    """Start the local cluster, or the processes of it that are not running.

    ZooKeeper, id allocators, coordinators and partition servers run as separate
    processes on loopback; `up` waits until every health check is SERVING and
    writes DIR/cluster.json. Counts apply when a cluster is created (larger counts
    later add processes).
    """
    from services import launcher

    try:
        settings = parse_assignments(assignments)
        check_cluster_settings(settings)  # fail here, not in every child
    except ConfigError as error:
        fail(str(error), 2)
    counts = {"partition_server": partition_servers, "coordinator": coordinators,
              "id_allocator": id_allocators}
    quiet = output == "json"
    try:
        with console.status("starting atomlog", spinner="dots") if not quiet else nullcontext():
            report = launcher.up(data_dir, counts, settings, timeout,
                                 progress=(lambda m: None) if quiet else (lambda m: console.log(m)))
    except (launcher.LaunchError, launcher.localzk.ZooKeeperMissing) as error:
        fail(str(error))
    summary = {"seconds": round(report.seconds, 2), "started": report.started,
               "already_running": report.already_running, **report.cluster.to_json()}
    if quiet:
        click.echo(json.dumps(summary, indent=2))
        return
    table = Table(title=f"atomlog cluster in {report.cluster.data_dir}")
    for column in ("name", "role", "pid", "grpc", "metrics"):
        table.add_column(column)
    for p in report.cluster.processes:
        table.add_row(p.name, p.role, str(p.pid), p.grpc_address, p.metrics_address or "-")
    console.print(table)
    console.print(f"bootstrap: [bold]{report.cluster.bootstrap}[/]   zookeeper: "
                  f"{report.cluster.zookeeper}{report.cluster.chroot}")
    console.print(f"all SERVING in [bold]{report.seconds:.1f} s[/] "
                  f"(started {len(report.started)}, already running {len(report.already_running)})")


@cli.command()
@data_dir_option
@output_option
def status(data_dir: Path, output: str) -> None:
    """Each process of the local cluster: pid, addresses and health.

    Exits 0 when everything is SERVING, 1 otherwise.
    """
    from services import launcher

    try:
        rows = launcher.status(data_dir)
    except launcher.LaunchError as error:
        fail(str(error))
    healthy = all(r.health == "SERVING" and not r.offline_partitions for r in rows)
    if output == "json":
        click.echo(json.dumps({"healthy": healthy, "processes": [asdict(r) for r in rows]},
                              indent=2))
    else:
        table = Table(title=f"atomlog cluster in {data_dir.resolve()}")
        for column in ("name", "role", "pid", "grpc", "metrics", "health", "TC partitions"):
            table.add_column(column)
        for r in rows:
            color = "green" if r.health == "SERVING" and not r.offline_partitions else "red"
            health = r.health + (f", {len(r.offline_partitions)} partition(s) offline"
                                 if r.offline_partitions else "")
            table.add_row(r.name, r.role, str(r.pid or "-"), r.grpc_address,
                          r.metrics_address or "-", f"[{color}]{health}[/]",
                          str(len(r.tc_partitions)) if r.role == "coordinator" else "")
        console.print(table)
        owned = sum(len(r.tc_partitions) for r in rows)
        total = launcher.tc_partition_count(data_dir)
        if owned < total:
            console.print(f"[yellow]{owned} of {total} TC partitions leased; the others are "
                          "moving between coordinators (seconds) or no coordinator is up[/]")
        for r in rows:
            for partition in r.offline_partitions:
                console.print(f"[red]{r.name}: partition {partition} refuses to serve (DATA_LOSS); "
                              "an operator must recover it[/]", highlight=False)
    sys.exit(0 if healthy else 1)


@cli.command()
@data_dir_option
@click.option("--timeout", default=20.0, show_default=True,
              help="Seconds each process may take to stop before SIGKILL.")
def down(data_dir: Path, timeout: float) -> None:
    """Stop the local cluster cleanly (SIGTERM, drain, then ZooKeeper)."""
    from services import launcher

    try:
        stopped, killed = launcher.down(data_dir, timeout)
    except launcher.LaunchError as error:
        fail(str(error))
    console.print(f"stopped {len(stopped)} process(es)"
                  + (f"; killed after {timeout:.0f} s: {', '.join(killed)}" if killed else ""))


# ---------------------------------------------------------------- one server
@cli.command()
@click.argument("role", type=click.Choice([r.replace("_", "-") for r in ROLES]))
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              help="TOML file of settings ([section] key = value).")
@click.option("--set", "assignments", multiple=True, metavar="NAME=VALUE",
              help="Override one setting; repeatable. See --help-config.")
@click.option("--name", help="server.name")
@click.option("--listen", help="server.listen (host:port)")
@click.option("--metrics-listen", help="server.metrics_listen (host:port)")
@click.option("--zookeeper", help="zookeeper.hosts (host:port,...)")
@click.option("--data-dir", "server_data_dir", help="server.data_dir")
@click.option("--help-config", is_flag=True, help="List every setting of ROLE and exit.")
def serve(role: str, config_file: str | None, assignments: tuple[str, ...], name: str | None,
          listen: str | None, metrics_listen: str | None, zookeeper: str | None,
          server_data_dir: str | None, help_config: bool) -> None:
    """Run one server of ROLE until SIGTERM.

    Settings come from defaults, then --config, then ATOMLOG_<NAME> environment
    variables (e.g. ATOMLOG_ZOOKEEPER_HOSTS), then flags. Invalid or inconsistent
    settings refuse to start with every problem listed.
    """
    role = role.replace("-", "_")
    if help_config:
        click.echo(describe(role))
        return
    try:
        overrides = parse_assignments(assignments)
        for key, value in (("server.name", name), ("server.listen", listen),
                           ("server.metrics_listen", metrics_listen),
                           ("zookeeper.hosts", zookeeper), ("server.data_dir", server_data_dir)):
            if value is not None:
                overrides[key] = value
        config = load_config(role, config_file, os.environ, overrides)
    except ConfigError as error:
        fail(str(error), 2)
    from services.runtime import serve as run

    sys.exit(asyncio.run(run(config)))


# ---------------------------------------------------------------- topics
def _bootstrap(bootstrap: str | None, data_dir: Path) -> str:
    if bootstrap:
        return bootstrap
    from services.launcher import ClusterFile

    cluster = ClusterFile.load(data_dir.resolve())
    if cluster is None or not cluster.bootstrap:
        fail(f"no --bootstrap given and no local cluster in {data_dir}")
    return cluster.bootstrap


bootstrap_option = click.option("--bootstrap", "-b", envvar="ATOMLOG_BOOTSTRAP",
                                help="Any server's host:port (default: the local cluster's).")


def _call(bootstrap: str, method: str, request):
    from atomlog.v1 import metadata_pb2_grpc
    from services.errors import from_rpc_error

    with grpc.insecure_channel(bootstrap) as channel:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        try:
            return getattr(stub, method)(request, timeout=10)
        except grpc.RpcError as rpc_error:
            error = from_rpc_error(rpc_error)
            fail(f"{error.reason}: {error.message}")


@cli.group()
def topic() -> None:
    """Create, list and describe topics."""


@topic.command("create")
@click.argument("name")
@click.option("--partitions", "-p", type=int, required=True)
@click.option("--config", "-c", "settings", multiple=True, metavar="KEY=VALUE",
              help="Topic setting (retention.ms, retention.bytes, segment.bytes, segment.ms, "
                   "cleanup.policy); repeatable.")
@bootstrap_option
@data_dir_option
@output_option
def topic_create(name: str, partitions: int, settings: tuple[str, ...], bootstrap: str | None,
                 data_dir: Path, output: str) -> None:
    """Create topic NAME with its partitions spread evenly over the partition servers."""
    from atomlog.v1 import metadata_pb2

    try:
        config = parse_assignments(settings)
    except ConfigError as error:
        fail(str(error), 2)
    if partitions < 0:
        fail("--partitions must be positive", 2)
    reply = _call(_bootstrap(bootstrap, data_dir), "CreateTopic",
                  metadata_pb2.CreateTopicRequest(name=name, partitions=partitions, config=config))
    _print_topics([reply.topic], output)


@topic.command("list")
@click.option("--internal", is_flag=True, help="Include internal topics.")
@bootstrap_option
@data_dir_option
@output_option
def topic_list(internal: bool, bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Names of all topics."""
    from atomlog.v1 import metadata_pb2

    reply = _call(_bootstrap(bootstrap, data_dir), "ListTopics",
                  metadata_pb2.ListTopicsRequest(include_internal=internal))
    if output == "json":
        click.echo(json.dumps(list(reply.names)))
    else:
        for name in reply.names:
            click.echo(name)


@topic.command("describe")
@click.argument("names", nargs=-1)
@bootstrap_option
@data_dir_option
@output_option
def topic_describe(names: tuple[str, ...], bootstrap: str | None, data_dir: Path,
                   output: str) -> None:
    """Partitions and owners of topics NAMES (all topics if none)."""
    from atomlog.v1 import metadata_pb2

    reply = _call(_bootstrap(bootstrap, data_dir), "GetMetadata",
                  metadata_pb2.GetMetadataRequest(topics=list(names)))
    _print_topics(list(reply.topics), output)


def _print_topics(topics, output: str) -> None:
    from google.protobuf.json_format import MessageToDict

    if output == "json":
        click.echo(json.dumps([MessageToDict(t, preserving_proto_field_name=True,
                                             always_print_fields_with_no_presence=True)
                               for t in topics], indent=2))
        return
    table = Table()
    for column in ("topic", "partition", "server", "address", "available"):
        table.add_column(column)
    for t in topics:
        for p in t.partitions:
            table.add_row(t.name, str(p.partition), p.server_name, p.server_address or "-",
                          "yes" if p.available else "[red]no[/]")
    console.print(table)


# ---------------------------------------------------------------- partitions
@cli.group()
def partition() -> None:
    """Inspect and repair partitions."""


def _call_owner(bootstrap: str, topic_name: str, number: int, method: str, request,
                timeout: float = 10):
    """Call a PartitionService method on the partition's owner; exit 1 on any error."""
    from atomlog.v1 import partition_pb2_grpc
    from spark_client import Client
    from spark_client.errors import AtomlogClientError, from_grpc

    with Client(bootstrap) as client:
        try:
            route = client.metadata.route(topic_name, number)
            if not route.address:
                fail(f"the owner of {topic_name}-{number} ({route.server_name}) is down")
            stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(route.address))
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as rpc_error:
            fail(str(from_grpc(rpc_error)))
        except AtomlogClientError as error:
            fail(str(error))


@partition.command("describe")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("number", metavar="PARTITION", type=int)
@bootstrap_option
@data_dir_option
@output_option
def partition_describe(topic_name: str, number: int, bootstrap: str | None, data_dir: Path,
                       output: str) -> None:
    """State, positions and producers of one partition."""
    from google.protobuf.json_format import MessageToDict

    from atomlog.v1 import common_pb2, partition_pb2

    reply = _call_owner(_bootstrap(bootstrap, data_dir), topic_name, number, "DescribePartition",
                        partition_pb2.DescribePartitionRequest(topic_partition=common_pb2.TopicPartition(
                            topic=topic_name, partition=number)))
    click.echo(json.dumps(MessageToDict(reply, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True), indent=2)
               if output == "json" else _describe_text(reply))


def _describe_text(reply) -> str:
    from atomlog.v1 import partition_pb2

    lines = [f"{reply.topic_partition.topic}-{reply.topic_partition.partition}: "
             f"{partition_pb2.PartitionState.Name(reply.state).removeprefix('PARTITION_STATE_')}"]
    if reply.data_loss.file:
        lines.append(f"  DATA_LOSS in {reply.data_loss.file} at offset {reply.data_loss.offset}: "
                     f"{reply.data_loss.detail}")
    lines.append(f"  log start {reply.log_start_offset}, high watermark {reply.high_watermark}, "
                 f"max read position {reply.max_read_position}, last data offset "
                 f"{reply.last_data_offset}")
    lines.append(f"  {reply.segment_count} segment(s), {reply.size_bytes} bytes, "
                 f"{reply.producer_count} producer(s)")
    for p in reply.producers:
        lines.append(f"    producer {p.producer_id} epoch {p.producer_epoch}: last sequence "
                     f"{p.last_sequence} at offset {p.last_offset}")
    return "\n".join(lines)


@partition.command("recover")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("number", metavar="PARTITION", type=int)
@click.option("--file", "file_name", required=True, help="The file DATA_LOSS reported.")
@click.option("--offset", type=int, required=True, help="The offset DATA_LOSS reported.")
@click.option("--accept-data-loss", is_flag=True, required=True,
              help="Confirm: everything from that offset on is deleted.")
@bootstrap_option
@data_dir_option
def partition_recover(topic_name: str, number: int, file_name: str, offset: int,
                      accept_data_loss: bool, bootstrap: str | None, data_dir: Path) -> None:
    """Bring a partition in DATA_LOSS back online by truncating at the corruption."""
    from atomlog.v1 import common_pb2, partition_pb2

    reply = _call_owner(_bootstrap(bootstrap, data_dir), topic_name, number, "RecoverPartition",
                        partition_pb2.RecoverPartitionRequest(
                            topic_partition=common_pb2.TopicPartition(topic=topic_name,
                                                                      partition=number),
                            expected_file=file_name, expected_offset=offset,
                            accept_data_loss=accept_data_loss), timeout=60)
    console.print(f"{topic_name}-{number} recovered: truncated at offset "
                  f"{reply.truncated_at_offset} ({reply.removed_bytes} bytes removed); "
                  f"high watermark {reply.high_watermark}")


# ---------------------------------------------------------------- produce / consume
@cli.command()
@click.argument("topic")
@click.option("--key-separator", default=None,
              help="Split each line at the first SEPARATOR into key and value.")
@click.option("--partition", "-p", type=int, default=None, help="Send every record here.")
@bootstrap_option
@data_dir_option
def produce(topic: str, key_separator: str | None, partition: int | None, bootstrap: str | None,
            data_dir: Path) -> None:
    """Send each line of standard input as one record to TOPIC (idempotent producer).

    Exits non-zero if any record could not be delivered.
    """
    from spark_client import Client
    from spark_client.errors import AtomlogClientError

    futures = []
    try:
        with Client(_bootstrap(bootstrap, data_dir)) as client, client.producer() as producer:
            for line in sys.stdin:
                line = line.rstrip("\n")
                key = None
                if key_separator is not None and key_separator in line:
                    key, line = line.split(key_separator, 1)
                futures.append(producer.send(topic, line, key=key, partition=partition))
            producer.flush()
        failures = [f.exception() for f in futures if f.exception() is not None]
    except AtomlogClientError as error:
        fail(str(error))
    if failures:
        fail(f"{len(failures)} of {len(futures)} records failed; first: {failures[0]}")
    err_console.print(f"sent {len(futures)} records to {topic}")


@cli.command()
@click.argument("topics", nargs=-1, required=True)
@click.option("--from", "start", type=click.Choice(["earliest", "latest"]), default="earliest",
              show_default=True)
@click.option("--isolation", type=click.Choice(["read_committed", "read_uncommitted"]),
              default="read_committed", show_default=True)
@click.option("--max-messages", "-n", type=int, default=None, help="Stop after N messages.")
@click.option("--idle-timeout", type=float, default=None,
              help="Stop when nothing arrives for this many seconds (default: run until ^C).")
@bootstrap_option
@data_dir_option
@output_option
def consume(topics: tuple[str, ...], start: str, isolation: str, max_messages: int | None,
            idle_timeout: float | None, bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Print the records of TOPICS to standard output (values as text, one per line;
    with -o json one JSON object per record)."""
    from spark_client import Client
    from spark_client.errors import AtomlogClientError

    count = 0
    try:
        with Client(_bootstrap(bootstrap, data_dir)) as client, \
                client.consumer(list(topics), isolation=isolation, start=start) as consumer:
            idle_since = time.monotonic()
            while max_messages is None or count < max_messages:
                batch = consumer.poll(timeout_s=0.5, max_records=500)
                if not batch:
                    if idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                        break
                    continue
                idle_since = time.monotonic()
                for message in batch[: None if max_messages is None else max_messages - count]:
                    click.echo(_render(message, output))
                    count += 1
    except AtomlogClientError as error:
        fail(str(error))
    except KeyboardInterrupt:
        pass


def _render(message, output: str) -> str:
    if output != "json":
        return (message.value or b"").decode(errors="replace")
    text = lambda b: None if b is None else b.decode(errors="replace")  # noqa: E731
    return json.dumps({"topic": message.topic, "partition": message.partition,
                       "offset": message.offset, "timestamp_ms": message.timestamp_ms,
                       "key": text(message.key), "value": text(message.value),
                       "headers": {k: text(v) for k, v in message.headers}})


def main() -> None:
    cli(prog_name="atomlog")


if __name__ == "__main__":
    main()
