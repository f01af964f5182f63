"""`atomlog` — one entry point for running, operating and using an atomlog cluster."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import NoReturn

import click
import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services import __version__
from services.config import (SERVE_ROLES, ConfigError, check_cluster_settings, describe,
                             load_config, parse_assignments)

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


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


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
@click.option("--combined", is_flag=True,
              help="One process hosting every role (the single-node server) instead of "
                   "one process per role; the counts above are then ignored. A new one is "
                   "created with 1 TC partition, as the combined server creates a "
                   "cluster, unless --set cluster.tc_partitions=N.")
@click.option("--set", "assignments", multiple=True, metavar="NAME=VALUE",
              help="A server setting for every process (kept in cluster.json); repeatable.")
@click.option("--timeout", default=90.0, show_default=True, help="Seconds to wait for SERVING.")
@click.option("--tls", "use_tls", is_flag=True,
              help="Create the cluster with mutual TLS on every gRPC port: a local CA and one "
                   "certificate per process (and a client certificate) under DIR/tls, made "
                   "with the `cryptography` package; cluster.json records the client's files "
                   "and the CLI uses them. Chosen when the cluster is created.")
@click.option("--prometheus", is_flag=True,
              help="Also run Prometheus (Debian package `prometheus`) on loopback: it scrapes "
                   "every process every 2 s, evaluates deploy/prometheus/rules, and its URL "
                   "is printed. Later `up`s keep it running; `down` stops it.")
@output_option
def up(data_dir: Path, partition_servers: int, coordinators: int, id_allocators: int,
       combined: bool, assignments: tuple[str, ...], timeout: float, use_tls: bool,
       prometheus: bool, output: str) -> None:
    """Start the local cluster, or the processes of it that are not running.

    ZooKeeper, id allocators, coordinators and partition servers run as separate
    processes on loopback; `up` waits until every health check is SERVING and
    writes DIR/cluster.json. Counts apply when a cluster is created (larger counts
    later add processes). A process that ends its start on a ZooKeeper error, or
    whose port was taken meanwhile, is started again (up to 3 times each).

    Example: `atomlog up --prometheus`, then open the printed URL and query
    `role:atomlog_rpc_handled:rate5m`, or point Grafana at it (deploy/grafana).
    """
    from services import launcher

    try:
        settings = parse_assignments(assignments)
        existing = launcher.ClusterFile.load(data_dir.resolve()) if data_dir.exists() else None
        # fail here, not in every child
        check_cluster_settings(settings, tls=use_tls or bool(existing and existing.tls))
    except ConfigError as error:
        fail(str(error), 2)
    if not combined and existing is not None and any(
            p.role == "combined" for p in existing.processes):
        context = click.get_current_context()
        if all(context.get_parameter_source(name) is click.core.ParameterSource.DEFAULT
               for name in ("partition_servers", "coordinators", "id_allocators")):
            combined = True  # (a combined cluster started again: no counts were asked for)
    counts = ({"combined": 1} if combined else
              {"partition_server": partition_servers, "coordinator": coordinators,
               "id_allocator": id_allocators})
    quiet = output == "json"
    try:
        with console.status("starting atomlog", spinner="dots") if not quiet else nullcontext():
            report = launcher.up(data_dir, counts, settings, timeout,
                                 progress=(lambda m: None) if quiet else (lambda m: console.log(m)),
                                 prometheus=prometheus, tls=use_tls)
    except (launcher.LaunchError, launcher.localzk.ZooKeeperMissing) as error:
        fail(str(error))
    summary = {"seconds": round(report.seconds, 2), "started": report.started,
               "already_running": report.already_running, **report.cluster.to_json()}
    prometheus_url = (f"http://{report.cluster.prometheus.grpc_address}"
                      if report.cluster.prometheus else None)
    if prometheus_url:
        summary["prometheus_url"] = prometheus_url
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
    if report.cluster.tls:
        tls = report.cluster.tls
        console.print(f"TLS ({tls.get('client_auth', 'require')} client certificates): "
                      f"CA {tls['ca_file']}, client certificate {tls['cert_file']}, "
                      f"key {tls['key_file']}", highlight=False)
    if prometheus_url:
        console.print(f"prometheus: [bold]{prometheus_url}[/]")
    console.print(f"all SERVING in [bold]{report.seconds:.1f} s[/] "
                  f"(started {len(report.started)}, already running {len(report.already_running)})")


@cli.command()
@data_dir_option
@output_option
@click.option("--token-file", envvar="ATOMLOG_TOKEN_FILE", metavar="FILE",
              help="Bearer token file, for a cluster with auth.mode=token (listing each "
                   "partition server's offline partitions needs it).")
def status(data_dir: Path, output: str, token_file: str | None) -> None:
    """Each process of the local cluster: pid, addresses and health (a partition
    server's ", catching up" while its replicas are not yet back in their ISRs: the
    health service atomlog.caught_up, Kubernetes' readiness probe).

    Exits 0 when everything is SERVING, 1 otherwise (the Prometheus of `up
    --prometheus` is shown but does not count).
    """
    from services import launcher

    _TLS_FLAGS["token_file"] = token_file
    try:
        report = launcher.status(data_dir, token=_token())
    except launcher.LaunchError as error:
        fail(str(error))
    rows = report.processes
    replication = _replication_summary(data_dir, [r.grpc_address for r in rows
                                                  if r.health == "SERVING"
                                                  and r.role != "zookeeper"])
    healthy = all(r.health == "SERVING" and not r.offline_partitions for r in rows) and \
        not (replication and replication["offline"])
    prometheus = launcher.prometheus_status(data_dir)  # shown, not part of `healthy`
    cluster = launcher.ClusterFile.load(data_dir.resolve())
    tls = {k: v for k, v in cluster.tls.items() if k != "dir"} if cluster and cluster.tls else {}
    if output == "json":
        click.echo(json.dumps({"healthy": healthy, "processes": [asdict(r) for r in rows],
                               "tc_partitions": report.tc_partitions,
                               **({"replication": replication} if replication else {}),
                               **({"prometheus": prometheus} if prometheus else {}),
                               **({"tls": tls} if tls else {})}, indent=2))
    else:
        table = Table(title=f"atomlog cluster in {data_dir.resolve()}")
        for column in ("name", "role", "pid", "grpc", "metrics", "health", "TC partitions"):
            table.add_column(column)
        for r in rows:
            color = "green" if r.health == "SERVING" and not r.offline_partitions else "red"
            health = r.health + (f", {len(r.offline_partitions)} partition(s) offline"
                                 if r.offline_partitions else "")
            if r.caught_up is False:  # its replicas not all back in their ISRs yet
                color, health = ("yellow" if color == "green" else color), health + \
                    ", catching up"
            table.add_row(r.name, r.role, str(r.pid or "-"), r.grpc_address,
                          r.metrics_address or "-", f"[{color}]{health}[/]",
                          str(len(r.tc_partitions)) if r.role in ("coordinator", "combined") else "")
        console.print(table)
        owned = sum(len(r.tc_partitions) for r in rows)
        total = report.tc_partitions  # 0: no server answered, and cluster.json does not say
        if owned < total:
            console.print(f"[yellow]{owned} of {total} TC partitions leased; the others are "
                          "moving between coordinators (seconds) or no coordinator is up[/]")
        if tls:
            console.print(f"TLS ({tls.get('client_auth', 'require')} client certificates): "
                          f"CA {tls['ca_file']}, client certificate {tls.get('cert_file')}, "
                          f"key {tls.get('key_file')}", highlight=False)
        if prometheus:
            color = "green" if prometheus["health"] == "SERVING" else "yellow"
            console.print(f"prometheus: {prometheus['url']} [{color}]{prometheus['health']}[/]")
        for r in rows:
            for partition in r.offline_partitions:
                console.print(f"[red]{r.name}: partition {partition} refuses to serve (DATA_LOSS); "
                              "an operator must recover it[/]", highlight=False)
        if replication and replication["replicated_partitions"]:
            under, offline = replication["under_replicated"], replication["offline"]
            color = "red" if offline else "yellow" if under else "green"
            console.print(f"[{color}]replicated partitions: "
                          f"{replication['replicated_partitions']}, under-replicated: "
                          f"{len(under)}, offline (no leader): {len(offline)}[/]"
                          + "".join(f"\n  [red]{p}: offline[/]" for p in offline)
                          + "".join(f"\n  [yellow]{p}: in sync {isr} of {replicas}[/]"
                                    for p, isr, replicas in under), highlight=False)
    sys.exit(0 if healthy else 1)


def _replication_summary(data_dir: Path, addresses: list[str]) -> dict | None:
    """Replicated partitions, from the first serving server's metadata: how many, which are
    short of in-sync replicas and which have no leader (None when no server answers)."""
    from atomlog.v1 import metadata_pb2

    if not addresses:
        return None
    _bootstrap(None, data_dir)  # the TLS the local cluster needs
    for address in addresses:
        try:
            reply = _call(address, "GetMetadata", metadata_pb2.GetMetadataRequest())
            break
        except SystemExit:
            continue
    else:
        return None
    rows = [(f"{t.name}-{p.partition}", p) for t in reply.topics for p in t.partitions
            if len(p.replicas) > 1]
    return {"replicated_partitions": len(rows),
            "under_replicated": [(name, ",".join(p.isr), ",".join(p.replicas))
                                 for name, p in rows
                                 if p.server_name and len(p.isr) < len(p.replicas)],
            "offline": [name for name, p in rows if not p.server_name]}


@cli.command()
@data_dir_option
@click.option("--timeout", default=20.0, show_default=True,
              help="Seconds each process may take to stop before SIGKILL.")
def down(data_dir: Path, timeout: float) -> None:
    """Stop the local cluster cleanly (SIGTERM, drain, then ZooKeeper), and its
    Prometheus if `up --prometheus` started one."""
    from services import launcher

    try:
        stopped, killed = launcher.down(data_dir, timeout)
    except launcher.LaunchError as error:
        fail(str(error))
    console.print(f"stopped {len(stopped)} process(es)"
                  + (f"; killed after {timeout:.0f} s: {', '.join(killed)}" if killed else ""))


# ---------------------------------------------------------------- one server
@cli.command()
@click.argument("role", type=click.Choice([r.replace("_", "-") for r in SERVE_ROLES]))
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
    """Run one server of ROLE until SIGTERM. `combined` hosts every role in one process
    (partition server, coordinator and id allocator; calls between them are function
    calls): the single-node server.

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
# TLS of the cluster a command calls: --tls-ca/--tls-cert/--tls-key (or ATOMLOG_TLS_CA,
# ATOMLOG_TLS_CERT, ATOMLOG_TLS_KEY), else the local cluster's (cluster.json of --data-dir,
# `atomlog up --tls`) when the command calls it. Set by _bootstrap(); None: plaintext.
_TLS_FLAGS: dict[str, str | None] = {}
_TLS = None


def _bootstrap(bootstrap: str | None, data_dir: Path) -> str:
    """The address to call, and (in _TLS) the TLS it needs."""
    global _TLS
    from services.launcher import ClusterFile
    from services.tls import TlsConfig, TlsFileError

    ca, cert, key = (_TLS_FLAGS.get(n) for n in ("tls_ca", "tls_cert", "tls_key"))
    cluster = ClusterFile.load(data_dir.resolve()) if data_dir.exists() else None
    if not bootstrap:
        if cluster is None or not cluster.bootstrap:
            fail(f"no --bootstrap given and no local cluster in {data_dir}")
        bootstrap = cluster.running_bootstrap
    if ca or cert or key:
        if not ca:
            fail("--tls-cert and --tls-key need --tls-ca (the CA that signed the servers)", 2)
        _TLS = TlsConfig(ca, cert or "", key or "",
                         server_name=_TLS_FLAGS.get("tls_server_name") or "")
        try:
            _TLS.check()
        except TlsFileError as error:
            fail(f"TLS: {error}", 2)
    elif cluster is not None and bootstrap in {p.grpc_address for p in cluster.processes}:
        _TLS = cluster.client_tls()
    return bootstrap


def _token():
    """The bearer token of --token-file (ATOMLOG_TOKEN_FILE), or None."""
    from services.auth import AuthFileError, TokenSource

    token_file = _TLS_FLAGS.get("token_file")
    if not token_file:
        return None
    try:
        return TokenSource(token_file=token_file)
    except AuthFileError as error:
        fail(f"--token-file: {error}", 2)


def _client(bootstrap: str, **options):
    """An SDK Client of `bootstrap`, over TLS when the cluster needs it (_bootstrap), with
    the bearer token of --token-file."""
    from spark_client import Client

    token = _token()
    return Client(bootstrap, tls=_TLS, token_file=token and _TLS_FLAGS["token_file"], **options)


def _remember_tls(_ctx, param, value):
    _TLS_FLAGS[param.name] = value
    return value


_CLUSTER_OPTIONS = (
    click.option("--bootstrap", "-b", envvar="ATOMLOG_BOOTSTRAP",
                 help="Any server's host:port (default: the local cluster's)."),
    click.option("--tls-ca", envvar="ATOMLOG_TLS_CA", expose_value=False,
                 callback=_remember_tls, metavar="FILE",
                 help="CA certificate (PEM) of a cluster serving TLS (default: the local "
                      "cluster's, for a cluster started with `up --tls`)."),
    click.option("--tls-cert", envvar="ATOMLOG_TLS_CERT", expose_value=False,
                 callback=_remember_tls, metavar="FILE",
                 help="Client certificate (PEM), for a cluster requiring one (mTLS)."),
    click.option("--tls-key", envvar="ATOMLOG_TLS_KEY", expose_value=False,
                 callback=_remember_tls, metavar="FILE", help="Key of --tls-cert (PEM)."),
    click.option("--tls-server-name", envvar="ATOMLOG_TLS_SERVER_NAME", expose_value=False,
                 callback=_remember_tls, metavar="NAME",
                 help="The name the servers' certificates are checked against, instead of "
                      "the host dialed (a cluster whose servers share one certificate, as "
                      "the Kubernetes production overlay's `atomlog-server`; in its pods "
                      "ATOMLOG_TLS_SERVER_NAME is set already)."),
    click.option("--token-file", envvar="ATOMLOG_TOKEN_FILE", expose_value=False,
                 callback=_remember_tls, metavar="FILE",
                 help="File holding a bearer token (a JWT or a static token) for a cluster "
                      "with auth.mode=token or mtls_or_token; sent on every call."),
)


def bootstrap_option(command):
    """--bootstrap and the TLS options of every command that calls the cluster."""
    for option in reversed(_CLUSTER_OPTIONS):
        command = option(command)
    return command


def _call(bootstrap: str, method: str, request):
    from atomlog.v1 import metadata_pb2_grpc
    from services.errors import from_rpc_error
    from services.tls import ChannelTls, channel

    from services.auth import bearer_channel

    with channel(bootstrap, ChannelTls(_TLS) if _TLS else None) as opened:
        stub = metadata_pb2_grpc.MetadataServiceStub(bearer_channel(opened, _token()))
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
                   "cleanup.policy=delete, min.insync.replicas, unclean.leader.election.enable); "
                   "repeatable.")
@click.option("--replication-factor", "-r", type=click.IntRange(0, 7), default=0,
              help="Copies of each partition (docs/replication.md); 0: the cluster's "
                   "topics.default_replication_factor (by default 3 with at least 3 "
                   "partition servers, else their number).")
@bootstrap_option
@data_dir_option
@output_option
def topic_create(name: str, partitions: int, settings: tuple[str, ...], replication_factor: int,
                 bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Create topic NAME with its partitions (and their replicas) spread evenly over the
    partition servers."""
    from atomlog.v1 import metadata_pb2

    try:
        config = parse_assignments(settings)
    except ConfigError as error:
        fail(str(error), 2)
    if partitions < 0:
        fail("--partitions must be positive", 2)
    reply = _call(_bootstrap(bootstrap, data_dir), "CreateTopic",
                  metadata_pb2.CreateTopicRequest(name=name, partitions=partitions, config=config,
                                                  replication_factor=replication_factor))
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


@topic.command("alter")
@click.argument("name")
@click.option("--set", "-c", "settings", multiple=True, metavar="KEY=VALUE",
              help="A setting to add or replace (the keys `topic create --config` takes); "
                   "repeatable.")
@click.option("--delete", "deleted", multiple=True, metavar="KEY",
              help="A setting to remove (back to the servers' default); repeatable.")
@click.option("--validate-only", is_flag=True,
              help="Check the change and print the settings it would give; write nothing.")
@bootstrap_option
@data_dir_option
@output_option
def topic_alter(name: str, settings: tuple[str, ...], deleted: tuple[str, ...],
                validate_only: bool, bootstrap: str | None, data_dir: Path,
                output: str) -> None:
    """Change the settings of topic NAME; the partition servers apply them without a
    restart. The whole change is checked before anything is written: an unknown key or a
    bad value, min.insync.replicas above the topic's copies, or a replication setting on a
    topic of one copy is refused and changes nothing.

    \b
    Examples:
      atomlog topic alter orders --set retention.ms=86400000
      atomlog topic alter orders --set unclean.leader.election.enable=true
      atomlog topic alter orders --delete retention.bytes
    """
    from atomlog.v1 import metadata_pb2

    try:
        config = parse_assignments(settings)
    except ConfigError as error:
        fail(str(error), 2)
    if not config and not deleted:
        fail("nothing to change: give --set KEY=VALUE or --delete KEY", 2)
    reply = _call(_bootstrap(bootstrap, data_dir), "AlterTopicConfig",
                  metadata_pb2.AlterTopicConfigRequest(topic=name, set=config,
                                                       delete=list(deleted),
                                                       validate_only=validate_only))
    settled = dict(sorted(reply.topic.config.items()))
    if output == "json":
        click.echo(json.dumps({"topic": name, "changed": reply.changed,
                               "validate_only": validate_only, "config": settled}))
        return
    verb = ("would be" if validate_only else "are now") if reply.changed else "were already"
    shown = ", ".join(f"{k}={v}" for k, v in settled.items()) or "(the servers' defaults)"
    click.echo(f"{name}: settings {verb} {shown}")


def _print_topics(topics, output: str) -> None:
    from google.protobuf.json_format import MessageToDict

    if output == "json":
        click.echo(json.dumps([MessageToDict(t, preserving_proto_field_name=True,
                                             always_print_fields_with_no_presence=True)
                               for t in topics], indent=2))
        return
    table = Table()
    moving = any(p.reassigning_to for t in topics for p in t.partitions)
    for column in ("topic", "partition", "leader", "address", "available", "replicas", "isr",
                   "epoch", *(("reassigning to",) if moving else ())):
        table.add_column(column)
    for t in topics:
        for p in t.partitions:
            under = len(p.isr) < len(p.replicas)
            table.add_row(t.name, str(p.partition), p.server_name or "[red]offline[/]",
                          p.server_address or "-", "yes" if p.available else "[red]no[/]",
                          ",".join(p.replicas),
                          ("[yellow]" if under else "") + ",".join(p.isr) + ("[/]" if under else ""),
                          str(p.leader_epoch),
                          *((_reassigning(p),) if moving else ()))
    console.print(table)
    for t in topics:
        if t.config:
            console.print(f"{t.name} settings: " + ", ".join(
                f"{k}={v}" for k, v in sorted(t.config.items())))


def _reassigning(p) -> str:
    """A partition's running reassignment for a table: its target, and its throttle."""
    if not p.reassigning_to:
        return "-"
    rate = p.reassignment_throttle_bytes_per_s
    return ",".join(p.reassigning_to) + (f" (throttled {rate / 1e6:g} MB/s)" if rate else "")


# ---------------------------------------------------------------- partitions
@cli.group()
def partition() -> None:
    """Inspect and repair partitions."""


def _call_owner(bootstrap: str, topic_name: str, number: int, method: str, request,
                timeout: float = 10):
    """Call a PartitionService method on the partition's owner; exit 1 on any error."""
    from spark_client.errors import AtomlogClientError, from_grpc

    with _client(bootstrap) as client:
        try:
            route = client.metadata.route(topic_name, number)
            if not route.address:
                fail(f"the owner of {topic_name}-{number} ({route.server_name}) is down")
            stub = client.channels.partition(route.address)
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
    """State, positions, producers, open transactions and subscriptions of one partition.

    Asks the partition's owner (DescribePartition). Text output shows the state, the
    positions (max read position = where read_committed readers stop), whether the
    transaction buffer is ready, each open transaction (id, first offset, age), the
    size of the aborted index, the coordinator epochs seen per TC partition and each
    subscription's cursor and backlog. `-o json` prints the whole response.

    \b
    Example:
      atomlog partition describe orders 0
      atomlog partition describe orders 0 -o json | jq .open_transactions
    """
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

    state = partition_pb2.PartitionState.Name(reply.state).removeprefix("PARTITION_STATE_")
    lines = [f"{reply.topic_partition.topic}-{reply.topic_partition.partition}: {state}"]
    if reply.data_loss.file:
        lines.append(f"  DATA_LOSS in {reply.data_loss.file} at offset {reply.data_loss.offset}: "
                     f"{reply.data_loss.detail}")
    lines.append(f"  log start {reply.log_start_offset}, high watermark {reply.high_watermark}, "
                 f"max read position {reply.max_read_position}, last data offset "
                 f"{reply.last_data_offset}")
    lines.append(f"  {reply.segment_count} segment(s), {reply.size_bytes} bytes, "
                 f"{reply.producer_count} producer(s)")
    for p in reply.producers:
        current = (f", in transaction {format_txn_id(p.current_txn_id)}"
                   if p.HasField("current_txn_id") else "")
        lines.append(f"    producer {p.producer_id} epoch {p.producer_epoch}: last sequence "
                     f"{p.last_sequence} at offset {p.last_offset}{current}")
    if reply.HasField("replication"):
        lines.extend(_replication_lines(reply.replication))
    if reply.state == partition_pb2.PARTITION_STATE_ONLINE:
        lines.extend(_transaction_lines(reply))
    lines.extend(f"  withheld (ACLs): {part}" for part in reply.withheld)
    return "\n".join(lines)


def _replication_lines(status) -> list[str]:
    """The replicas part of `partition describe` (asked of the leader)."""
    lines = [f"  replicas {','.join(status.replicas)}, in sync {','.join(status.isr)}, leader "
             f"epoch {status.leader_epoch}, replicated up to {status.replicated_high_watermark}"]
    if status.reassigning_to:
        rate = status.reassignment_throttle_bytes_per_s
        lines.append(f"  reassigning to {','.join(status.reassigning_to)}"
                     + (f", new replicas throttled to {rate / 1e6:g} MB/s" if rate else ""))
    for f in status.followers:
        lines.append(f"    follower {f.replica}: {'in sync' if f.in_sync else 'NOT in sync'}, "
                     f"holds up to {f.durable_end_offset}, {f.lag_offsets} behind, caught up "
                     f"{_duration(f.caught_up_ms_ago)} ago")
    return lines


def _transaction_lines(reply) -> list[str]:
    """The transaction buffer and subscriptions part of `partition describe`."""
    lines = ["  transaction buffer: " + (
        "ready" if reply.transaction_buffer_ready else
        "not ready (read_committed fetches wait with PARTITION_LOADING)")]
    lines.append(f"  {len(reply.open_transactions)} open transaction(s), "
                 f"{reply.aborted_transaction_count} aborted transaction(s) in the aborted index")
    for t in reply.open_transactions:
        lines.append(f"    {format_txn_id(t.txn_id)}: offsets {t.first_offset}..{t.last_offset}, "
                     f"producer {t.producer_id} epoch {t.producer_epoch}, "
                     f"age {_duration(t.age_ms)}")
    epochs = ", ".join(f"TC {k}: {v}" for k, v in sorted(reply.coordinator_epochs.items()))
    lines.append(f"  coordinator epochs seen: {epochs or 'none'}")
    # A snapshot covering offset 0 holds nothing, and 0 is also what a server that does
    # not report snapshots sends: both read as "none".
    snapshots = [f"{what} up to offset {offset}" for what, offset in (
        ("producer state", reply.producer_snapshot_offset),
        ("transaction buffer", reply.transaction_buffer_snapshot_offset)) if offset > 0]
    lines.append(f"  snapshots: {', '.join(snapshots) or 'none'}")
    lines.append(f"  {len(reply.subscriptions)} subscription(s)")
    for cursor in reply.subscriptions:
        name = cursor.subscription_partition.subscription
        if cursor.error.reason:
            lines.append(f"    {name}: {cursor.error.reason}: {cursor.error.message}")
            continue
        lines.append(f"    {name}: cursor {cursor.cumulative_end_offset}, backlog "
                     f"{cursor.backlog_records}, {len(cursor.individual_ranges)} individual "
                     f"ack range(s), {len(cursor.pending_acks)} transaction(s) with pending "
                     f"acks, {cursor.delivered_unacknowledged_count} delivered unacknowledged, "
                     f"{cursor.redelivery_backlog_count} awaiting redelivery")
    return lines


@partition.command("delete-records")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("number", metavar="PARTITION", type=click.IntRange(0))
@click.option("--before", "before_offset", required=True, type=click.IntRange(0),
              metavar="OFFSET", help="Delete the records below this offset (at most the "
                                     "high watermark).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 3600), default=30,
              show_default=True, help="Seconds to keep trying (a moved leader, in-sync "
                                      "followers still deleting).")
@bootstrap_option
@data_dir_option
@output_option
def partition_delete_records(topic_name: str, number: int, before_offset: int,
                             timeout_s: float, bootstrap: str | None, data_dir: Path,
                             output: str) -> None:
    """Delete the records of partition PARTITION of TOPIC below an offset (DeleteRecords).

    Every whole segment that ends at or below OFFSET goes, so the new log start is the
    base of the segment holding it: the active segment and the data of open
    transactions stay. On a replicated topic it returns once every in-sync replica has
    deleted too, so a failover does not show the records again. Prints the new log
    start offset. Exits 1 on an error (OFFSET_OUT_OF_RANGE past the high watermark) or
    when --timeout runs out (what the leader deleted stays deleted; run it again).

    \b
    Example:
      atomlog partition delete-records orders 0 --before 120000
    """
    from spark_client.errors import AtomlogClientError

    with _client(_bootstrap(bootstrap, data_dir)) as client:
        try:
            start = client.delete_records(topic_name, {number: before_offset},
                                          timeout_s=timeout_s)[number]
        except AtomlogClientError as error:
            fail(str(error))
    if output == "json":
        click.echo(json.dumps({"topic": topic_name, "partition": number,
                               "log_start_offset": start}))
    else:
        click.echo(f"{topic_name}-{number}: log start offset {start}")


@partition.command("reassign")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("number", metavar="PARTITION", type=int)
@click.option("--replicas", required=True, metavar="SERVER,...",
              help="The new replica list, preferred leader first (partition server names, "
                   "as `atomlog status` lists them).")
@click.option("--wait", "wait_s", type=click.FloatRange(0, 3600), default=0, show_default=True,
              help="Seconds to wait for the reassignment to complete (0: return once it "
                   "is recorded).")
@click.option("--throttle", "throttle_mb_s", type=click.FloatRange(0, 10_000), default=0,
              show_default=True,
              help="MB/s the leader sends each new replica while it catches up (0: "
                   "unthrottled). Keep it above the partition's write rate, or the new "
                   "replica never catches up and the reassignment never completes.")
@bootstrap_option
@data_dir_option
@output_option
def partition_reassign(topic_name: str, number: int, replicas: str, wait_s: float,
                       throttle_mb_s: float, bootstrap: str | None, data_dir: Path,
                       output: str) -> None:
    """Move partition PARTITION of TOPIC to a new list of replicas.

    The new replicas copy the partition from its leader while it goes on serving; once
    all of them are in sync, the leader makes the list final in one ZooKeeper write
    (handing leadership to the first new replica when it is not in the list itself) and
    the replicas left out delete their copy. Nothing acknowledged is lost: the old
    replicas leave only after the new ones hold everything. A new target replaces a
    running reassignment (and its throttle); `topic describe` shows progress ("reassigning
    to"), `partition describe` each follower's lag. Exits 1 if --wait runs out first (the
    reassignment goes on).

    \b
    Example:
      atomlog partition reassign orders 0 --replicas ps-3,ps-1,ps-2 --wait 120
      atomlog partition reassign orders 0 --replicas ps-3,ps-1,ps-2 --throttle 50
    """
    from atomlog.v1 import metadata_pb2

    target = [r.strip() for r in replicas.split(",") if r.strip()]
    address = _bootstrap(bootstrap, data_dir)
    reply = _call(address, "ReassignPartition", metadata_pb2.ReassignPartitionRequest(
        topic=topic_name, partition=number, replicas=target,
        throttle_bytes_per_s=round(throttle_mb_s * 1e6)))
    partition = reply.partition
    deadline = time.monotonic() + wait_s
    while partition.reassigning_to and time.monotonic() < deadline:
        time.sleep(0.5)
        topics = _call(address, "GetMetadata",
                       metadata_pb2.GetMetadataRequest(topics=[topic_name])).topics
        partition = topics[0].partitions[number]
    done = not partition.reassigning_to
    if output == "json":
        click.echo(json.dumps({"topic": topic_name, "partition": number,
                               "started": reply.started, "completed": done,
                               "replicas": list(partition.replicas), "isr": list(partition.isr),
                               "leader": partition.server_name,
                               "reassigning_to": list(partition.reassigning_to),
                               "throttle_bytes_per_s":
                                   partition.reassignment_throttle_bytes_per_s}))
    elif not reply.started:
        click.echo(f"{topic_name}-{number} has replicas {','.join(partition.replicas)} already")
    elif done:
        click.echo(f"{topic_name}-{number} reassigned: replicas {','.join(partition.replicas)}, "
                   f"leader {partition.server_name or 'none'}")
    else:
        click.echo(f"{topic_name}-{number}: reassignment to {_reassigning(partition)} "
                   f"running (replicas {','.join(partition.replicas)}, in sync "
                   f"{','.join(partition.isr)})")
    if wait_s and not done:
        sys.exit(1)


@partition.command("copies")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("number", metavar="PARTITION", type=int)
@bootstrap_option
@data_dir_option
@output_option
def partition_copies(topic_name: str, number: int, bootstrap: str | None, data_dir: Path,
                     output: str) -> None:
    """What each replica of partition PARTITION of TOPIC holds on its disk.

    Asks every replica's server (DescribeCopy), which reads its copy's files without
    opening it, so it answers for an offline partition too: where its log ends (after its
    last whole batch), the leader epoch that began last in it, its log start, its role.
    The copy that holds the most comes first: the latest epoch, then the longest log (as
    Kafka's unclean recovery chooses). For an offline partition it prints the `partition
    elect` that would make that copy lead.

    \b
    Example:
      atomlog partition copies orders 0
    """
    from atomlog.v1 import common_pb2, metadata_pb2, partition_pb2
    from spark_client.errors import AtomlogClientError, from_grpc

    with _client(_bootstrap(bootstrap, data_dir)) as client:
        try:
            reply = client.metadata.call("GetMetadata",
                                         metadata_pb2.GetMetadataRequest(topics=[topic_name]))
        except AtomlogClientError as error:
            fail(str(error))
        meta = reply.topics[0]
        if not 0 <= number < len(meta.partitions):
            fail(f"UNKNOWN_TOPIC_OR_PARTITION: topic {topic_name!r} has "
                 f"{len(meta.partitions)} partitions")
        part = meta.partitions[number]
        addresses = {s.name: s.grpc_address for s in reply.servers}
        rows = []
        for replica in part.replicas:
            row = {"replica": replica, "in_isr": replica in part.isr,
                   "leader": replica == part.server_name}
            if replica not in addresses:
                row["error"] = "down (not registered)"
                rows.append(row)
                continue
            try:
                copy = client.channels.partition(addresses[replica]).DescribeCopy(
                    partition_pb2.DescribeCopyRequest(topic_partition=common_pb2.TopicPartition(
                        topic=topic_name, partition=number)), timeout=30)
            except grpc.RpcError as rpc_error:
                row["error"] = str(from_grpc(rpc_error))
            else:
                row.update(role=copy.role, present=copy.present,
                           log_start_offset=copy.log_start_offset,
                           log_end_offset=copy.log_end_offset,
                           latest_leader_epoch=copy.latest_leader_epoch,
                           latest_epoch_start_offset=copy.latest_epoch_start_offset,
                           segment_count=copy.segment_count, size_bytes=copy.size_bytes,
                           tail_detail=copy.tail_detail,
                           data_loss_detail=copy.data_loss_detail)
            rows.append(row)
    rows.sort(key=_copy_rank)
    best = rows[0] if rows and _holds(rows[0]) else None
    if output == "json":
        click.echo(json.dumps({"topic": topic_name, "partition": number,
                               "leader": part.server_name, "isr": list(part.isr),
                               "most": best["replica"] if best else None, "copies": rows},
                              indent=2))
        return
    table = Table()
    for column in ("replica", "role", "in ISR", "log end", "latest epoch (from offset)",
                   "log start", "segments", "bytes", "note"):
        table.add_column(column)
    for row in rows:
        if "error" in row:
            table.add_row(row["replica"], "-", "yes" if row["in_isr"] else "no", "-", "-", "-",
                          "-", "-", f"[red]{row['error']}[/]")
            continue
        note = ("[red]no copy[/]" if not row["present"] else
                f"[red]DATA_LOSS: {row['data_loss_detail']}[/]" if row["data_loss_detail"]
                else f"tail not counted: {row['tail_detail']}" if row["tail_detail"] else "")
        if row is best:
            note = ("[green]holds the most[/]" + (f"; {note}" if note else ""))
        table.add_row(row["replica"], row["role"], "yes" if row["in_isr"] else "no",
                      str(row["log_end_offset"]),
                      f"{row['latest_leader_epoch']} ({row['latest_epoch_start_offset']})",
                      str(row["log_start_offset"]), str(row["segment_count"]),
                      str(row["size_bytes"]), note)
    console.print(table)
    if not part.server_name and best is not None:
        unclean = "" if best["in_isr"] else " --accept-data-loss"
        click.echo(f"offline: atomlog partition elect {topic_name} {number} --replica "
                   f"{best['replica']}{unclean}")


def _holds(row: dict) -> bool:
    """Whether a replica answered with a copy that may lead (one there, not in DATA_LOSS)."""
    return "error" not in row and row["present"] and not row["data_loss_detail"]


def _copy_rank(row: dict) -> tuple:
    """The copy that holds the most first: one that may lead, then the latest leader
    epoch, then the longest log; ties by name."""
    if not _holds(row):
        return (1, 0, 0, row["replica"])
    return (0, -row["latest_leader_epoch"], -row["log_end_offset"], row["replica"])


@partition.command("elect")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("number", metavar="PARTITION", type=int)
@click.option("--replica", required=True, metavar="SERVER",
              help="The partition server to lead (one of the partition's replicas, "
                   "running).")
@click.option("--accept-data-loss", is_flag=True,
              help="Required for a replica outside the ISR: the acknowledged records it "
                   "lacks are lost.")
@bootstrap_option
@data_dir_option
@output_option
def partition_elect(topic_name: str, number: int, replica: str, accept_data_loss: bool,
                    bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Make the --replica server the leader of offline partition PARTITION of TOPIC.

    A partition goes offline when none of its in-sync replicas is running, or when its
    last in-sync replica came back without its copy (a wiped or replaced disk, an empty
    volume: it leaves the ISR rather than lead from nothing). Start the servers in its
    ISR (`topic describe`) if you can: the first back leads by itself. Otherwise elect
    the replica whose copy holds the most: `atomlog partition copies TOPIC PARTITION`
    reads every replica's copy and prints this command for it. The other replicas follow
    it and cut what it lacks. Refused while the partition has a leader.

    \b
    Example:
      atomlog partition elect orders 0 --replica ps-1 --accept-data-loss
    """
    from atomlog.v1 import metadata_pb2

    reply = _call(_bootstrap(bootstrap, data_dir), "ElectLeader",
                  metadata_pb2.ElectLeaderRequest(topic=topic_name, partition=number,
                                                  replica=replica,
                                                  accept_data_loss=accept_data_loss))
    partition = reply.partition
    if output == "json":
        click.echo(json.dumps({"topic": topic_name, "partition": number,
                               "leader": partition.server_name,
                               "leader_epoch": partition.leader_epoch,
                               "isr": list(partition.isr), "replicas": list(partition.replicas)}))
    else:
        click.echo(f"{topic_name}-{number}: {partition.server_name or replica} leads in epoch "
                   f"{partition.leader_epoch} (in sync: {','.join(partition.isr)})")


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
    """Bring a partition in DATA_LOSS back online by truncating at the corruption.

    Repeat the file and offset DATA_LOSS reported (`atomlog partition describe`, `atomlog
    status`). A partition of one copy whose directory was missing when its server started
    reports data-loss.json at offset 0: recovering it accepts that every record it held is
    lost, and it serves again, empty, from offset 0 (restore the volume instead, if you can,
    and restart its server).

    \b
    Example:
      atomlog partition recover orders 3 --file data-loss.json --offset 0 --accept-data-loss
    """
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


@partition.command("recover-lost")
@click.argument("server_name", metavar="SERVER")
@click.option("--accept-data-loss", is_flag=True, default=False,
              help="Confirm: every record the lost copies held is gone for good.")
@click.option("--include-internal", is_flag=True,
              help="Recover lost __txn_log partitions too (their coordinators' decisions are "
                   "gone with them: transactions decided there may end up half applied). "
                   "Without it they are listed and left in DATA_LOSS.")
@click.option("--dry-run", is_flag=True, help="List what would be recovered; change nothing.")
@bootstrap_option
@data_dir_option
def partition_recover_lost(server_name: str, accept_data_loss: bool, include_internal: bool,
                           dry_run: bool, bootstrap: str | None, data_dir: Path) -> None:
    """Accept the loss of every lost one-copy partition on a server at once.

    A server started without the directories of partitions it held the only copy of (a
    replaced disk, an empty volume) opens each of them in DATA_LOSS at offset 0, with
    data-loss.json as its file (docs/operations.md, AtomlogPartitionDataLoss). This
    recovers every such partition of SERVER, as `atomlog partition recover` would one by
    one: each then serves again, empty, from offset 0. Partitions in DATA_LOSS for any
    other reason (damage found in a segment) are listed and left alone: recover those
    one at a time. Restore the volume instead, if you can, and restart the server. Exits
    1 if any recovery failed.

    \b
    Examples:
      atomlog partition recover-lost ps-2 --dry-run
      atomlog partition recover-lost ps-2 --accept-data-loss
    """
    from atomlog.v1 import common_pb2, metadata_pb2, partition_pb2
    from partition_server.log import DATA_LOSS_FILE
    from services.topics import INTERNAL_PREFIX
    from spark_client.errors import from_grpc

    if not (accept_data_loss or dry_run):
        fail("give --accept-data-loss (every record of the lost copies is gone) or --dry-run")
    address = _bootstrap(bootstrap, data_dir)
    reply = _call(address, "GetMetadata", metadata_pb2.GetMetadataRequest())
    servers = {s.name: s.grpc_address for s in reply.servers}
    if server_name not in servers:
        fail(f"no partition server {server_name} is registered")
    if not servers[server_name]:
        fail(f"partition server {server_name} is down")
    with _client(address) as client:
        stub = client.channels.partition(servers[server_name])
        try:
            listed = stub.ListPartitions(
                partition_pb2.ListPartitionsRequest(include_internal=True), timeout=30)
        except grpc.RpcError as rpc_error:
            fail(str(from_grpc(rpc_error)))
        lost, internal, other = [], [], []
        for summary in listed.partitions:
            if summary.state != partition_pb2.PARTITION_STATE_DATA_LOSS:
                continue
            name = f"{summary.topic_partition.topic}-{summary.topic_partition.partition}"
            if summary.data_loss.offset != 0 or \
                    PurePosixPath(summary.data_loss.file).name != DATA_LOSS_FILE:
                other.append((name, summary))
            elif summary.topic_partition.topic.startswith(INTERNAL_PREFIX) \
                    and not include_internal:
                internal.append((name, summary))
            else:
                lost.append((name, summary))
        for name, summary in other:
            console.print(f"{name}: left alone, in DATA_LOSS for damage at offset "
                          f"{summary.data_loss.offset} in {summary.data_loss.file} (recover it "
                          "with `atomlog partition recover`)", highlight=False, soft_wrap=True)
        for name, _ in internal:
            console.print(f"{name}: left alone, a lost copy of an internal partition (give "
                          "--include-internal)", highlight=False, soft_wrap=True)
        if not lost:
            console.print(f"{server_name} has no lost copy to recover", highlight=False)
            return
        failed = 0
        for name, summary in lost:
            if dry_run:
                console.print(f"{name}: would be recovered, empty from offset 0",
                              highlight=False)
                continue
            try:
                stub.RecoverPartition(partition_pb2.RecoverPartitionRequest(
                    topic_partition=common_pb2.TopicPartition(
                        topic=summary.topic_partition.topic,
                        partition=summary.topic_partition.partition),
                    expected_file=summary.data_loss.file, expected_offset=0,
                    accept_data_loss=True), timeout=60)
                console.print(f"{name}: recovered, empty from offset 0", highlight=False)
            except grpc.RpcError as rpc_error:
                failed += 1
                console.print(f"{name}: [red]not recovered[/]: "
                              f"{escape(str(from_grpc(rpc_error)))}", highlight=False,
                              soft_wrap=True)
    if failed:
        sys.exit(1)


@partition.command("kept-frames")
@click.argument("server", metavar="SERVER")
@data_dir_option
@output_option
def partition_kept_frames(server: str, data_dir: Path, output: str) -> None:
    """What a partition server keeps aside of its write-ahead file, read offline.

    A start that found partitions' directories missing (a disk swapped, directories
    moved) or their copies in DATA_LOSS keeps the write-ahead file's segments aside
    (wal/kept-<ms>/) instead of deleting them: acknowledged writes that a lost directory
    held only in the page cache are there. SERVER is a partition server of the local
    cluster in --data-dir (its data is DATA_DIR/SERVER), or the path of a server's data
    directory (its server.data_dir). Lists, per kept directory and partition, the offsets
    the frames cover and what becomes of them: `pending` (replayed at the server's next
    start once the directory is back), `data-loss` (given up once the loss is accepted),
    `done`, or `no-manifest` (kept before 2026-12-05; never replayed, for an operator).
    Changes nothing; safe while the server runs. A kept directory the server no longer
    needs is deleted by its next start. A pending partition whose directory shows
    `data-loss` is the lost copy the server opened in its place: restore the directory
    and restart the server, or accept the loss (`atomlog partition recover`). Exits 1 if
    a kept directory could not be read.

    \b
    Examples:
      atomlog partition kept-frames ps-1
      atomlog partition kept-frames /var/lib/atomlog -o json
    """
    from partition_server.wal import describe_kept

    path = Path(server)
    root = path if ("/" in server or path.is_absolute()) else data_dir / server
    wal_dir = root / "wal"
    if not root.is_dir():
        fail(f"no server data directory {root}")
    rows = describe_kept(wal_dir, root / "partitions") if wal_dir.is_dir() else []
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        console.print(f"{root}: nothing kept aside", highlight=False)
    else:
        table = Table(title=f"write-ahead frames kept aside in {wal_dir}")
        for column in ("kept", "partition", "status", "offsets", "batches", "directory",
                       "detail"):
            table.add_column(column)
        for row in rows:
            offsets = (f"[{row['first_offset']}, {row['end_offset']})" if "first_offset" in row
                       else "")
            table.add_row(row["kept"], row["partition"] or "", row["status"], offsets,
                          str(row.get("batches", "")), row.get("directory", ""),
                          escape(row["detail"]))
        console.print(table)
    if any(row["status"] == "unreadable" for row in rows):
        sys.exit(1)


@partition.command("scrub")
@click.argument("topic_name", metavar="[TOPIC", required=False)
@click.argument("number", metavar="[PARTITION]]", type=int, required=False)
@click.option("--server", "server_name", metavar="NAME",
              help="Only the copies this partition server holds (with no TOPIC: every one).")
@bootstrap_option
@data_dir_option
@output_option
def partition_scrub(topic_name: str | None, number: int | None, server_name: str | None,
                    bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Read copies of partitions back from disk now and check every batch.

    Asks each server holding a copy (ScrubPartition), one copy after the other, as the
    background scrubber would (docs/operations.md, "Scrubbing"), not paced: one
    partition's copies, a topic's, or with --server every copy one server holds (after
    a disk incident on it). A damaged copy is acted on as the scrubber's finding is: a
    leader's enters DATA_LOSS and is handed to an in-sync replica, a follower's is cut
    at the damage and fetched again. Exits 1 if any copy is damaged or could not be
    read.

    \b
    Examples:
      atomlog partition scrub orders 0
      atomlog partition scrub orders
      atomlog partition scrub --server ps-1
    """
    from google.protobuf.json_format import MessageToDict

    from atomlog.v1 import common_pb2, metadata_pb2, partition_pb2
    from spark_client.errors import from_grpc

    if topic_name is None and server_name is None:
        fail("name a TOPIC (and PARTITION), or a --server")
    address = _bootstrap(bootstrap, data_dir)
    reply = _call(address, "GetMetadata", metadata_pb2.GetMetadataRequest(
        topics=[topic_name] if topic_name is not None else []))
    servers = {s.name: s.grpc_address for s in reply.servers}
    if server_name is not None and server_name not in servers:
        fail(f"no partition server {server_name} is registered")
    copies = []  # (topic, partition, server)
    for found in reply.topics:
        if topic_name is not None and found.name != topic_name:
            continue
        for p, part in enumerate(found.partitions):
            if number is not None and p != number:
                continue
            for name in list(part.replicas) or [part.server_name]:
                if server_name is None or name == server_name:
                    copies.append((found.name, p, name))
    if not copies:
        what = (f"{topic_name}-{number}" if number is not None else topic_name or "any topic")
        fail(f"no partition {what}" + (f" with a copy on {server_name}" if server_name else ""))
    results, bad = [], False
    with _client(address) as client:
        for topic, p, name in copies:
            result = {"topic": topic, "partition": p, "server": name}
            request = partition_pb2.ScrubPartitionRequest(
                topic_partition=common_pb2.TopicPartition(topic=topic, partition=p))
            try:
                if not servers.get(name):
                    raise RuntimeError("the server is down")
                answer = client.channels.partition(servers[name]).ScrubPartition(
                    request, timeout=600)
                result.update(MessageToDict(answer, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=True))
                bad |= answer.HasField("damage")
            except grpc.RpcError as rpc_error:
                result["error"] = str(from_grpc(rpc_error))
                bad = True
            except RuntimeError as error:
                result["error"] = str(error)
                bad = True
            results.append(result)
    if output == "json":
        click.echo(json.dumps(results, indent=2))
    else:
        for result in results:
            copy = f"{result['topic']}-{result['partition']} on {result['server']}"
            if "error" in result:
                console.print(f"{copy}: [red]not read[/]: {escape(result['error'])}",
                              highlight=False, soft_wrap=True)
                continue
            line = (f"{copy} ({result['role']} copy): {result['segments_checked']} "
                    f"segment(s), {int(result['bytes_checked'])} bytes checked")
            damage = result.get("damage")
            if damage:
                line += (f", [red]DAMAGED[/] at offset {damage['offset']} in {damage['file']} "
                         f"(position {damage['position']}): {escape(damage['detail'])}"
                         + ("; acted on" if damage.get("acted_on") else
                            "; the copy moved on meanwhile, not acted on"))
            else:
                line += ", whole"
            console.print(line, highlight=False, soft_wrap=True)
    if bad:
        sys.exit(1)


# ---------------------------------------------------------------- subscriptions
@cli.group()
def subscription() -> None:
    """Move subscription cursors."""


@subscription.command("reset")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("name", metavar="SUBSCRIPTION")
@click.option("--to", "to", type=click.Choice(["earliest", "latest", "offset", "timestamp"]),
              required=True, help="earliest: all that is stored; latest: only new messages; "
              "offset: --offset (clamped to what is stored); timestamp: the first message at "
              "or after --timestamp-ms.")
@click.option("--offset", type=int, default=None, help="With --to offset.")
@click.option("--timestamp-ms", type=int, default=None, help="With --to timestamp (Unix ms).")
@click.option("--partition", "-p", "partitions", type=int, multiple=True,
              help="Only this partition (repeatable; default: every partition).")
@bootstrap_option
@data_dir_option
@output_option
def subscription_reset(topic_name: str, name: str, to: str, offset: int | None,
                       timestamp_ms: int | None, partitions: tuple[int, ...],
                       bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Move SUBSCRIPTION of TOPIC (a seek, e.g. to replay after a bug fix): everything
    below the new position counts as acknowledged, everything from it on as not, and
    messages out to consumers are forgotten. Refused (TRANSACTION_CONFLICT) on partitions
    where the subscription has acks pending in an open transaction; the subscription must
    exist (UNKNOWN_SUBSCRIPTION). Exits 1 if any partition was not moved."""
    from atomlog.v1 import common_pb2, partition_pb2
    from spark_client.errors import AtomlogClientError, from_grpc
    from spark_client.subscriber import subscription_position

    try:
        position = subscription_position(to, offset, timestamp_ms, what="--to",
                                         offset_name="--offset",
                                         timestamp_name="--timestamp-ms")
    except ValueError as error:
        fail(str(error), 2)
    outcomes: dict[int, tuple[int | None, str | None]] = {}  # partition -> (position, error)
    try:
        with _client(_bootstrap(bootstrap, data_dir)) as client:
            count = client.partitions_for(topic_name)
            numbers = sorted(set(partitions)) if partitions else list(range(count))
            if any(not 0 <= n < count for n in numbers):
                fail(f"topic {topic_name} has partitions 0-{count - 1}", 2)
            by_owner: dict[str, list[int]] = {}
            for number in numbers:
                owner = client.metadata.route(topic_name, number).address
                if owner:
                    by_owner.setdefault(owner, []).append(number)
                else:
                    outcomes[number] = (None, "SERVER_UNAVAILABLE: the partition's owner is down")
            for owner, group in by_owner.items():  # one call per partition server
                try:
                    reply = client.channels.partition(owner).ResetSubscription(
                        partition_pb2.ResetSubscriptionRequest(
                            subscription_partitions=[common_pb2.SubscriptionPartition(
                                topic=topic_name, partition=n, subscription=name)
                                for n in group],
                            position=position, offset=offset or 0,
                            timestamp_unix_ms=timestamp_ms or 0), timeout=10)
                except grpc.RpcError as rpc_error:
                    error = str(from_grpc(rpc_error))
                    outcomes.update((n, (None, error)) for n in group)
                    continue
                for n, result in zip(group, reply.results, strict=True):
                    outcomes[n] = ((None, f"{result.error.reason}: {result.error.message}")
                                   if result.error.reason else (result.cumulative_end_offset, None))
    except AtomlogClientError as error:
        fail(str(error))
    rows = [{"partition": n, "error": outcomes[n][1], "position": outcomes[n][0]}
            for n in numbers]
    failed = sum(row["error"] is not None for row in rows)
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
    else:
        table = Table()
        for column in ("partition", "new position", "error"):
            table.add_column(column)
        for row in rows:
            table.add_row(str(row["partition"]), "-" if row["position"] is None
                          else str(row["position"]), row["error"] or "")
        console.print(table)
    if failed:
        fail(f"{failed} of {len(rows)} partitions not moved")


# ---------------------------------------------------------------- transactions
# The string form of a transaction id is "<tc partition>:<sequence>", e.g. "3:17": what
# coordinator.records.TxnId.__str__ and the SDK's Transaction.id print. These two functions
# are its one parser and formatter for protos (common_pb2.TxnId).
_TXN_ID_FORM = re.compile(r"([0-9]+):([0-9]+)")
_TC_PARTITION_MAX = (1 << 32) - 1  # TxnId.tc_partition is a uint32
_TXN_SEQUENCE_MAX = (1 << 64) - 1  # TxnId.sequence is a uint64; 0 is never issued
TXN_STATES = ("OPEN", "PREPARED", "COMMITTING", "ABORTING", "COMMITTED", "ABORTED")
# How long a call about one transaction follows NOT_COORDINATOR and COORDINATOR_LOADING:
# a TC partition moves to another coordinator within a few seconds (leases in ZooKeeper).
COORDINATOR_CALL_TIMEOUT_S = 15.0
# Calls to one server (ListTransactions, ListPartitions, DescribePartition).
SERVER_CALL_TIMEOUT_S = 10.0
# Threads asking servers at once (coordinators, partition servers, transactions).
MAX_PARALLEL_CALLS = 8
# The coordinator's default transaction.max_timeout_ms: no OPEN transaction's timeout is
# longer, so one open on a partition for longer is late (find-hanging's default) — unless
# it is PREPARED (prepared timeouts are longer) or NewTxn with its idempotency key
# restarted its timeout (a long Spark streaming parent); hence LATE, not HANGING.
DEFAULT_LATE_AFTER_S = 900.0
# find-hanging asks the coordinators about at most this many transactions (oldest first).
MAX_HANGING_CHECKS = 10_000


def format_txn_id(txn_id) -> str:
    """"<tc partition>:<sequence>" of a common_pb2.TxnId."""
    return f"{txn_id.tc_partition}:{txn_id.sequence}"


def parse_txn_id(text: str):
    """The common_pb2.TxnId written as "<tc partition>:<sequence>"; ValueError says why not."""
    from atomlog.v1 import common_pb2

    match = _TXN_ID_FORM.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a transaction id: expected <tc partition>:<sequence>, "
                         "e.g. 3:17 (as `atomlog txn list` prints them)")
    tc_partition, sequence = int(match[1]), int(match[2])
    if tc_partition > _TC_PARTITION_MAX:
        raise ValueError(f"{text!r}: TC partition {tc_partition} is out of range")
    if not 1 <= sequence <= _TXN_SEQUENCE_MAX:
        raise ValueError(f"{text!r}: the sequence must be between 1 and {_TXN_SEQUENCE_MAX}")
    return common_pb2.TxnId(tc_partition=tc_partition, sequence=sequence)


class TxnIdParameter(click.ParamType):
    name = "ID"

    def convert(self, value, param, ctx):
        try:
            return parse_txn_id(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


def _enum_name(enum, value: int, prefix: str) -> str:
    """OPEN for TXN_STATE_OPEN; a value newer than this CLI reads as e.g. "UNKNOWN(9)"."""
    try:
        return enum.Name(value).removeprefix(prefix)
    except ValueError:
        return f"UNKNOWN({value})"


def _state_name(value: int) -> str:
    from atomlog.v1 import coordinator_pb2

    return _enum_name(coordinator_pb2.TxnState, value, "TXN_STATE_")


def _end_cause_name(value: int) -> str:
    from atomlog.v1 import coordinator_pb2

    return _enum_name(coordinator_pb2.TxnEndCause, value, "TXN_END_CAUSE_")


def _duration(ms: int) -> str:
    seconds = max(0, ms) / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, whole = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{whole:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _when(unix_ms: int) -> str:
    moment = datetime.fromtimestamp(unix_ms / 1000, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _summary_json(s) -> dict:
    return {"txn_id": format_txn_id(s.txn_id), "state": _state_name(s.state),
            "end_cause": _end_cause_name(s.end_cause) if s.end_cause else None,
            "parent_txn_id": format_txn_id(s.parent_txn_id) if s.HasField("parent_txn_id")
            else None,
            "transactional_id": s.transactional_id, "producer_id": s.producer_id,
            "producer_epoch": s.producer_epoch, "start_unix_ms": s.start_unix_ms,
            "age_ms": s.age_ms, "timeout_ms": s.timeout_ms,
            "topic_partition_count": s.topic_partition_count,
            "subscription_partition_count": s.subscription_partition_count,
            "child_count": s.child_count}


def _tp_text(tp) -> str:
    return f"{tp.topic}/{tp.partition}"


def _sp_text(sp) -> str:
    return f"{sp.topic}/{sp.partition}@{sp.subscription}"


# Reason -> what the operator should know, for the errors of txn describe/abort.
_TXN_HINTS = {
    "TRANSACTION_PREPARED": "it is PREPARED: a two-phase participant waiting for its parent's "
                            "(or Spark driver's) decision. Aborting it breaks that promise; "
                            "re-run with --allow-prepared to abort it anyway",
    "TRANSACTION_ALREADY_COMMITTED": "it is committed or committing: a commit decision is final "
                                     "and cannot be aborted",
    "NOT_COORDINATOR": "no coordinator took over its TC partition in time; see `atomlog status`",
    "COORDINATOR_LOADING": "its TC partition is still loading its log; try again in a few "
                           "seconds",
    "SERVER_UNAVAILABLE": "the coordinator could not be reached; see `atomlog status`",
}


def _txn_fail(txn_id, error) -> NoReturn:
    hint = _TXN_HINTS.get(error.reason)
    fail(f"transaction {format_txn_id(txn_id)}: {error.reason}: {error.message}"
         + (f"\n  {hint}" if hint else ""))


@contextmanager
def _sdk_client(bootstrap: str):
    """An SDK client whose connection errors end the command (exit 1)."""
    from spark_client.errors import AtomlogClientError

    try:
        with _client(bootstrap, request_timeout_s=SERVER_CALL_TIMEOUT_S) as client:
            client.metadata.refresh()
            yield client
    except AtomlogClientError as error:
        fail(f"{bootstrap}: {error}")


def _ask_txn_owner(client, txn_id, method: str, request,
                   timeout_s: float = COORDINATOR_CALL_TIMEOUT_S):
    """`method` at the coordinator owning txn_id's TC partition (the SDK's routing: follows
    NOT_COORDINATOR and waits out COORDINATOR_LOADING); raises AtomlogClientError."""
    from spark_client.transactions import Coordinators

    return Coordinators(client).call(txn_id.tc_partition, method, request,
                                     time.monotonic() + timeout_s)


def _check_tc_partition(client, txn_id) -> None:
    count = client.metadata.tc_partition_count
    if txn_id.tc_partition >= count:
        fail(f"transaction {format_txn_id(txn_id)} names TC partition {txn_id.tc_partition}, "
             f"but this cluster has TC partitions 0..{count - 1}", 2)


TXN_ID = TxnIdParameter()


@cli.group()
def txn() -> None:
    """List, inspect and abort transactions; find hanging ones.

    A transaction id is written <tc partition>:<sequence>, e.g. 3:17 (the TC partition
    that owns it and its sequence there), as `atomlog txn list` prints it and as the
    SDK's `Transaction.id` returns it.
    """


@txn.command("list")
@click.option("--state", "states", multiple=True, metavar="STATE",
              type=click.Choice(TXN_STATES, case_sensitive=False),
              help="Only transactions in STATE: OPEN, PREPARED, COMMITTING, ABORTING, "
                   "COMMITTED or ABORTED; repeatable (default: every state).")
@click.option("--older-than", type=click.FloatRange(min=0), default=0, show_default=True,
              metavar="SECONDS", help="Only transactions started at least this long ago.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=1_000, show_default=True,
              help="At most this many transactions, oldest first.")
@bootstrap_option
@data_dir_option
@output_option
def txn_list(states: tuple[str, ...], older_than: float, limit: int, bootstrap: str | None,
             data_dir: Path, output: str) -> None:
    """Transactions of every TC partition, oldest first.

    Asks every coordinator (ListTransactions) for the TC partitions it owns, according
    to the cluster metadata. Coordinators remember finished transactions for a while,
    so COMMITTED and ABORTED ones are listed too unless --state says otherwise. TC
    partitions that no coordinator owns or that could not be asked are named in a
    warning on stderr; the exit status is 1 only when no TC partition could be asked.

    \b
    Example:
      atomlog txn list --state OPEN --state PREPARED --older-than 300
      atomlog txn list -o json | jq -r '.transactions[].txn_id'
    """
    from atomlog.v1 import coordinator_pb2

    request = coordinator_pb2.ListTransactionsRequest(
        states=[coordinator_pb2.TxnState.Value(f"TXN_STATE_{s.upper()}") for s in states],
        min_age_ms=int(older_than * 1000), limit=limit)
    with _sdk_client(_bootstrap(bootstrap, data_dir)) as client:
        listing = list_transactions_everywhere(client, request)
    if not listing.searched:
        fail(f"no TC partition could be asked; {_reasons_text(listing.missing)}")
    if listing.missing:
        warn(f"{len(listing.missing)} of {listing.count} TC partitions not searched; "
             f"{_reasons_text(listing.missing)}")
    found = listing.transactions[:limit]
    truncated = listing.truncated or len(listing.transactions) > limit
    if output == "json":
        click.echo(json.dumps({
            "transactions": [_summary_json(s) for s in found], "truncated": truncated,
            "tc_partitions_searched": sorted(listing.searched),
            "tc_partitions_not_searched": [{"tc_partition": k, "reason": why}
                                           for k, why in sorted(listing.missing.items())]},
            indent=2))
        return
    table = Table()
    for column in ("transaction", "state", "age", "timeout", "partitions", "subscriptions",
                   "children", "parent", "transactional id", "ended by"):
        table.add_column(column)
    for s in found:
        table.add_row(format_txn_id(s.txn_id), _state_name(s.state), _duration(s.age_ms),
                      _duration(s.timeout_ms), str(s.topic_partition_count),
                      str(s.subscription_partition_count), str(s.child_count),
                      format_txn_id(s.parent_txn_id) if s.HasField("parent_txn_id") else "-",
                      escape(s.transactional_id) or "-",
                      _end_cause_name(s.end_cause) if s.end_cause else "-")
    console.print(table)
    console.print(f"{len(found)} transaction(s) from {len(listing.searched)} of {listing.count} "
                  "TC partitions" + (f"; more matched: raise --limit (now {limit})"
                                     if truncated else ""), highlight=False)


def _reasons_text(missing: dict[int, str]) -> str:
    """"TC partitions 0, 1: why; TC partition 5: why" — grouped by reason."""
    by_reason: dict[str, list[int]] = {}
    for k, why in sorted(missing.items()):
        by_reason.setdefault(why, []).append(k)
    return "; ".join(f"TC partition{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}: {why}"
                     for why, ks in by_reason.items())


@dataclass
class TxnListing:
    count: int  # TC partitions of the cluster
    searched: set[int] = field(default_factory=set)
    missing: dict[int, str] = field(default_factory=dict)  # TC partition -> why not searched
    transactions: list = field(default_factory=list)
    truncated: bool = False


def list_transactions_everywhere(client, request, rounds: int = 3) -> TxnListing:
    """ListTransactions at the owner of every TC partition; a partition whose owner moved,
    was loading or did not answer is asked again after a metadata refresh (`rounds` times
    in all)."""
    from atomlog.v1 import coordinator_pb2
    from spark_client.errors import from_grpc

    def ask(address: str, tc_partitions: list[int]):
        stub = client.channels.coordinator(address)
        partial = coordinator_pb2.ListTransactionsRequest()
        partial.CopyFrom(request)
        partial.tc_partitions.extend(tc_partitions)
        try:
            return stub.ListTransactions(partial, timeout=SERVER_CALL_TIMEOUT_S)
        except grpc.RpcError as rpc_error:
            return from_grpc(rpc_error)

    metadata = client.metadata
    listing = TxnListing(metadata.tc_partition_count)
    for attempt in range(rounds):
        if attempt:
            time.sleep(0.5)
            metadata.refresh()
        by_owner: dict[str, list[int]] = {}
        for k in range(listing.count):
            if k in listing.searched:
                continue
            address = metadata.tc_routes.get(k, "")
            if address:
                by_owner.setdefault(address, []).append(k)
            else:
                listing.missing[k] = "no coordinator owns it"
        with ThreadPoolExecutor(max_workers=MAX_PARALLEL_CALLS) as pool:
            answers = list(pool.map(lambda item: (item, ask(*item)), by_owner.items()))
        for (address, ks), reply in answers:
            if isinstance(reply, Exception):
                for k in ks:
                    listing.missing[k] = f"{address}: {reply}"
                continue
            for k in reply.tc_partitions:
                listing.searched.add(k)
                listing.missing.pop(k, None)
            for k in reply.not_owned_tc_partitions:
                listing.missing[k] = f"{address} does not own it (moved or loading)"
            listing.transactions.extend(reply.transactions)
            listing.truncated |= reply.truncated
        if not listing.missing:
            break
    listing.transactions.sort(key=lambda s: (s.start_unix_ms, s.txn_id.tc_partition,
                                             s.txn_id.sequence))
    return listing


@txn.command("describe")
@click.argument("txn_id", metavar="ID", type=TXN_ID)
@bootstrap_option
@data_dir_option
@output_option
def txn_describe(txn_id, bootstrap: str | None, data_dir: Path, output: str) -> None:
    """Everything the coordinator knows about transaction ID.

    Asks the coordinator owning ID's TC partition (DescribeTransaction): state, end
    cause, parent, session, times and timeouts, registered partitions and
    subscriptions, children, and — while COMMITTING or ABORTING — the partitions whose
    marker is not confirmed yet.

    \b
    Example:
      atomlog txn describe 3:17
      atomlog txn describe 3:17 -o json | jq .marker_pending_topic_partitions
    """
    from atomlog.v1 import coordinator_pb2
    from spark_client.errors import AtomlogClientError

    with _sdk_client(_bootstrap(bootstrap, data_dir)) as client:
        _check_tc_partition(client, txn_id)
        try:
            reply = _ask_txn_owner(client, txn_id, "DescribeTransaction",
                                   coordinator_pb2.DescribeTransactionRequest(txn_id=txn_id))
        except AtomlogClientError as error:
            _txn_fail(txn_id, error)
    if output == "json":
        click.echo(json.dumps(_description_json(reply), indent=2))
    else:
        click.echo(_description_text(reply))


def _description_json(reply) -> dict:
    def tps(items) -> list[dict]:
        return [{"topic": t.topic, "partition": t.partition} for t in items]

    def sps(items) -> list[dict]:
        return [{"topic": s.topic, "partition": s.partition, "subscription": s.subscription}
                for s in items]

    return {"summary": _summary_json(reply.summary),
            "topic_partitions": tps(reply.topic_partitions),
            "subscription_partitions": sps(reply.subscription_partitions),
            "children": [_summary_json(c) for c in reply.children],
            "marker_pending_topic_partitions": tps(reply.marker_pending_topic_partitions),
            "marker_pending_subscription_partitions":
                sps(reply.marker_pending_subscription_partitions),
            "marker_retry_count": reply.marker_retry_count,
            "prepared_timeout_ms": reply.prepared_timeout_ms,
            "prepared_unix_ms": reply.prepared_unix_ms,
            "decided_unix_ms": reply.decided_unix_ms,
            "completed_unix_ms": reply.completed_unix_ms,
            "idempotency_key": reply.idempotency_key,
            "coordinator_epoch": reply.coordinator_epoch}


def _description_text(reply) -> str:
    s = reply.summary
    state = _state_name(s.state)
    lines = [f"transaction {format_txn_id(s.txn_id)}: {state}"
             + (f" (ended by {_end_cause_name(s.end_cause)})" if s.end_cause else "")]
    lines.append(f"  started    {_when(s.start_unix_ms)} ({_duration(s.age_ms)} ago), "
                 f"timeout {_duration(s.timeout_ms)}")
    if reply.prepared_unix_ms:
        lines.append(f"  prepared   {_when(reply.prepared_unix_ms)}, prepared timeout "
                     f"{_duration(reply.prepared_timeout_ms)}")
    if reply.decided_unix_ms:
        lines.append(f"  decided    {_when(reply.decided_unix_ms)}")
    if reply.completed_unix_ms:
        lines.append(f"  completed  {_when(reply.completed_unix_ms)}")
    if s.HasField("parent_txn_id"):
        lines.append(f"  parent     {format_txn_id(s.parent_txn_id)}")
    if s.transactional_id:
        lines.append(f"  session    transactional id {s.transactional_id!r}, producer "
                     f"{s.producer_id} epoch {s.producer_epoch}")
    if reply.idempotency_key:
        lines.append(f"  key        {reply.idempotency_key}")
    lines.append(f"  coordinator epoch {reply.coordinator_epoch} of TC partition "
                 f"{s.txn_id.tc_partition}")
    lines.append(f"  partitions ({s.topic_partition_count}): "
                 + (", ".join(_tp_text(t) for t in reply.topic_partitions) or "-"))
    if s.topic_partition_count and not reply.topic_partitions:
        lines.append("    (a finished transaction keeps only the counts)")
    lines.append(f"  subscriptions ({s.subscription_partition_count}): "
                 + (", ".join(_sp_text(t) for t in reply.subscription_partitions) or "-"))
    pending = ([_tp_text(t) for t in reply.marker_pending_topic_partitions]
               + [_sp_text(t) for t in reply.marker_pending_subscription_partitions])
    if state in ("COMMITTING", "ABORTING") or pending:
        lines.append(f"  markers pending ({len(pending)}): {', '.join(pending) or '-'}; "
                     f"{reply.marker_retry_count} re-send(s) so far")
    lines.append(f"  children ({s.child_count})" + (":" if reply.children else ""))
    for c in reply.children:
        lines.append(f"    {format_txn_id(c.txn_id)}: {_state_name(c.state)}"
                     + (f" (ended by {_end_cause_name(c.end_cause)})" if c.end_cause else "")
                     + f", {c.topic_partition_count} partition(s), age {_duration(c.age_ms)}")
    return "\n".join(lines)


@txn.command("abort")
@click.argument("txn_id", metavar="ID", type=TXN_ID)
@click.option("--reason", default="", help="Why; written to the coordinator's log "
                                           "(at most 1024 bytes).")
@click.option("--allow-prepared", is_flag=True,
              help="Also abort a PREPARED transaction (breaks its two-phase promise to its "
                   "parent or Spark driver).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@bootstrap_option
@data_dir_option
@output_option
def txn_abort(txn_id, reason: str, allow_prepared: bool, yes: bool, bootstrap: str | None,
              data_dir: Path, output: str) -> None:
    """Abort transaction ID through its coordinator.

    The coordinator logs the abort decision (end cause OPERATOR), then delivers ABORT
    markers to every registered partition and subscription; children of a parent are
    aborted with it. The command returns once the decision is durable (state ABORTING,
    or ABORTED when every marker is confirmed). Aborting an aborted transaction changes
    nothing and exits 0; a committed one cannot be aborted (exit 1). Asks for
    confirmation before aborting an OPEN or PREPARED transaction unless --yes is given
    (required when standard input is not a terminal).

    \b
    Example:
      atomlog txn abort 3:17 --reason "stuck Spark job 42" --yes
    """
    from atomlog.v1 import coordinator_pb2
    from spark_client.errors import AtomlogClientError

    if len(reason.encode()) > 1024:
        fail("--reason is longer than 1024 bytes", 2)
    text = format_txn_id(txn_id)
    with _sdk_client(_bootstrap(bootstrap, data_dir)) as client:
        _check_tc_partition(client, txn_id)
        try:
            described = _ask_txn_owner(client, txn_id, "DescribeTransaction",
                                       coordinator_pb2.DescribeTransactionRequest(txn_id=txn_id))
            state = _state_name(described.summary.state)
            if not yes and (state == "OPEN" or (state == "PREPARED" and allow_prepared)):
                _confirm_abort(text, described.summary)
            reply = _ask_txn_owner(client, txn_id, "AbortTransaction",
                                   coordinator_pb2.AbortTransactionRequest(
                                       txn_id=txn_id, reason=reason or "atomlog txn abort",
                                       allow_prepared=allow_prepared))
        except AtomlogClientError as error:
            _txn_fail(txn_id, error)
    state = _state_name(reply.state)
    children = [format_txn_id(c) for c in reply.aborted_child_txn_ids]
    if output == "json":
        click.echo(json.dumps({"txn_id": text, "state": state,
                               "already_ended": reply.already_ended,
                               "aborted_child_txn_ids": children}, indent=2))
        return
    if reply.already_ended:
        click.echo(f"transaction {text} was already aborted ({state}); nothing changed")
        return
    click.echo(f"transaction {text}: {state}" + (
        " (every marker confirmed)" if state == "ABORTED" else
        f" (the abort is decided and durable; markers are being delivered: "
        f"`atomlog txn describe {text}` shows progress)"))
    if children:
        click.echo(f"  children aborted with it: {', '.join(children)}")


def _confirm_abort(text: str, summary) -> None:
    if not sys.stdin.isatty():
        fail(f"not aborting transaction {text} without confirmation: standard input is not a "
             "terminal; pass --yes", 2)
    question = (f"Abort transaction {text} ({_state_name(summary.state)}, age "
                f"{_duration(summary.age_ms)}, {summary.topic_partition_count} partition(s), "
                f"{summary.child_count} child(ren))?")
    if not click.confirm(question, default=False, err=True):
        fail("not aborted", 1)


# ---------------------------------------------------------------- hanging transactions
@dataclass(frozen=True)
class CoordinatorView:
    """What the coordinator said about a transaction that a partition holds open.

    state: OPEN, PREPARED, COMMITTING, ABORTING, COMMITTED, ABORTED, or UNKNOWN (it
    answered UNKNOWN_TRANSACTION). registered: the partition is one of the transaction's
    partitions (the coordinator lists them while the transaction is unfinished).
    marker_pending: COMMITTING/ABORTING and this partition's marker is not confirmed yet.
    """

    state: str
    registered: bool = False
    marker_pending: bool = False


@dataclass(frozen=True)
class Finding:
    verdict: str  # "OK" | "LATE" | "HANGING"
    explanation: str
    remedy: str


_NO_MARKER_REMEDY = (
    "no marker will come: read_committed readers of the partition stop at its first offset "
    "and retention cannot pass it. atomlog cannot write a marker to a partition by hand yet; "
    "keep the partition server's log and report it (a lost marker is a bug or a lost disk)")


def classify_open_transaction(age_ms: int, view: CoordinatorView, late_after_ms: int,
                              txn_text: str = "ID") -> Finding:
    """Judge a transaction that a partition holds open (has data of and no marker for),
    given its coordinator's view. Pure: no I/O, no clock.

    HANGING — the coordinator will never send this partition a marker: it does not know
    the transaction, finished it, decided it without this partition's marker outstanding,
    or does not list this partition in it.
    LATE — the coordinator still considers it OPEN or PREPARED (or is still re-sending its
    marker here) but it has been open on the partition for at least late_after_ms.
    OK — anything else: a young transaction, or a marker on its way.
    """
    state = view.state
    if state == "UNKNOWN":
        return Finding("HANGING", "its coordinator does not know it (never existed there, or "
                       "finished and forgotten)", _NO_MARKER_REMEDY)
    if state in ("COMMITTED", "ABORTED"):
        return Finding("HANGING", f"its coordinator says {state}: every marker was confirmed, "
                       "but this partition never applied one", _NO_MARKER_REMEDY)
    if state in ("COMMITTING", "ABORTING"):
        if not view.marker_pending:
            return Finding("HANGING", f"its coordinator says {state} and does not wait for this "
                           "partition's marker", _NO_MARKER_REMEDY)
        if age_ms >= late_after_ms:
            return Finding("LATE", f"its coordinator says {state} and keeps re-sending this "
                           "partition's marker", f"`atomlog txn describe {txn_text}` shows the "
                           "re-sends; the partition server's log says why it refuses the marker")
        return Finding("OK", f"{state}: the marker is on its way", "")
    if state in ("OPEN", "PREPARED"):
        if not view.registered:
            return Finding("HANGING", f"its coordinator says {state} but does not list this "
                           "partition, so its decision will send no marker here",
                           "aborting it will not reach this partition either; "
                           + _NO_MARKER_REMEDY)
        if age_ms >= late_after_ms:
            remedy = f"`atomlog txn abort {txn_text}`, once you know its writer is gone"
            if state == "PREPARED":
                remedy = (f"`atomlog txn abort {txn_text} --allow-prepared`, once you know its "
                          "parent or Spark driver is gone (a PREPARED transaction waits for "
                          "their decision)")
            return Finding("LATE", f"open here for longer than {_duration(late_after_ms)}; its "
                           f"coordinator still says {state}", remedy)
        return Finding("OK", f"{state} and young", "")
    raise ValueError(f"unknown coordinator state {state!r}")


@dataclass(frozen=True)
class _OpenHere:
    """One open transaction on one partition, as its partition server reported it."""

    address: str
    topic: str
    partition: int
    txn: object  # partition_pb2.OpenTransaction


@txn.command("find-hanging")
@click.option("--older-than", type=click.FloatRange(min=0), default=0, show_default=True,
              metavar="SECONDS", help="Only check transactions open on a partition for at "
                                      "least this long (0: all).")
@click.option("--late-after", type=click.FloatRange(min=0), default=DEFAULT_LATE_AFTER_S,
              show_default="900, the coordinator's default transaction.max_timeout_ms",
              metavar="SECONDS",
              help="Report a transaction open on a partition for this long as LATE even if "
                   "its coordinator still has it OPEN or PREPARED.")
@bootstrap_option
@data_dir_option
@output_option
def txn_find_hanging(older_than: float, late_after: float, bootstrap: str | None, data_dir: Path,
                     output: str) -> None:
    """Open transactions on partitions that their coordinator will not end.

    Asks every partition server for its partitions (internal topics included), describes
    those with open transactions, and asks each transaction's coordinator about it
    (DescribeTransaction). Reports:

    \b
      HANGING  the coordinator ended it, does not know it, or does not list the
               partition: no marker will ever come (read_committed readers of the
               partition are stuck at its first offset).
      LATE     the coordinator still has it OPEN or PREPARED (or keeps re-sending
               its marker), but it has been open on the partition for --late-after
               seconds or more: `atomlog txn abort` it once you know its writer is gone.

    A HANGING candidate is confirmed by describing its partition again, so a marker that
    arrived meanwhile is not reported. Exit status: 3 when a HANGING or LATE transaction
    was found; else 1 when some partition server, partition or coordinator could not be
    checked (warnings on stderr say which); else 0.

    \b
    Example:
      atomlog txn find-hanging
      atomlog txn find-hanging --older-than 60 --late-after 600 -o json
    """
    with _sdk_client(_bootstrap(bootstrap, data_dir)) as client:
        problems: list[str] = []
        opened, partitions = _open_transactions(client, problems)
        candidates = sorted((o for o in opened if o.txn.age_ms >= older_than * 1000),
                            key=lambda o: -o.txn.age_ms)
        if len(candidates) > MAX_HANGING_CHECKS:
            problems.append(f"{len(candidates)} open transactions; checked the oldest "
                            f"{MAX_HANGING_CHECKS}")
            candidates = candidates[:MAX_HANGING_CHECKS]
        answers = _coordinator_answers(client, candidates, problems)
        findings = []
        for o in candidates:
            answer = answers.get(_txn_key(o.txn.txn_id))
            if answer is None:
                continue  # its coordinator could not be asked (a problem says so)
            view = _view_for(answer, o)
            try:
                finding = classify_open_transaction(o.txn.age_ms, view, int(late_after * 1000),
                                                    format_txn_id(o.txn.txn_id))
            except ValueError as error:  # a state newer than this CLI
                problems.append(f"transaction {format_txn_id(o.txn.txn_id)}: {error}")
                continue
            if finding.verdict != "OK":
                findings.append((o, view, finding))
        findings = _still_open(client, findings, problems)
    for problem in problems:
        warn(problem)
    _print_findings(findings, len(candidates), partitions, output, complete=not problems)
    sys.exit(3 if findings else 1 if problems else 0)


def _txn_key(txn_id) -> tuple[int, int]:
    return txn_id.tc_partition, txn_id.sequence


def _partition_servers(client) -> list[tuple[str, str]]:
    from atomlog.v1 import common_pb2, metadata_pb2

    reply = client.metadata.call("GetMetadata", metadata_pb2.GetMetadataRequest())
    return [(s.name, s.grpc_address) for s in reply.servers
            if s.role == common_pb2.SERVER_ROLE_PARTITION_SERVER]


def _open_transactions(client, problems: list[str]) -> tuple[list[_OpenHere], int]:
    """Every open transaction on every partition of every partition server, and the number
    of partitions listed."""
    servers = _partition_servers(client)
    if not servers:
        problems.append("no partition server is registered")
    with ThreadPoolExecutor(max_workers=MAX_PARALLEL_CALLS) as pool:
        results = list(pool.map(lambda server: _open_on_server(client, *server), servers))
    opened: list[_OpenHere] = []
    partitions = 0
    for found, listed, server_problems in results:
        opened.extend(found)
        partitions += listed
        problems.extend(server_problems)
    return opened, partitions


def _open_on_server(client, name: str, address: str) -> tuple[list[_OpenHere], int, list[str]]:
    from atomlog.v1 import partition_pb2
    from spark_client.errors import from_grpc

    stub = client.channels.partition(address)
    problems: list[str] = []
    try:
        # Internal topics too: __txn_log never holds transactions, and a partition without
        # open transactions costs nothing more than its line in this answer.
        listed = stub.ListPartitions(partition_pb2.ListPartitionsRequest(include_internal=True),
                                     timeout=SERVER_CALL_TIMEOUT_S).partitions
    except grpc.RpcError as rpc_error:
        return [], 0, [f"partition server {name} ({address}): {from_grpc(rpc_error)}"]
    found: list[_OpenHere] = []
    for summary in listed:
        tp = summary.topic_partition
        if summary.state != partition_pb2.PARTITION_STATE_ONLINE:
            state = _enum_name(partition_pb2.PartitionState, summary.state, "PARTITION_STATE_")
            problems.append(f"{tp.topic}-{tp.partition} on {name} is {state}: its open "
                            "transactions are not known")
            continue
        if summary.open_transaction_count == 0:
            continue
        try:
            described = stub.DescribePartition(partition_pb2.DescribePartitionRequest(
                topic_partition=tp, max_producers=1), timeout=SERVER_CALL_TIMEOUT_S)
        except grpc.RpcError as rpc_error:
            problems.append(f"{tp.topic}-{tp.partition} on {name}: {from_grpc(rpc_error)}")
            continue
        if not described.transaction_buffer_ready:
            problems.append(f"{tp.topic}-{tp.partition} on {name}: transaction buffer still "
                            "loading; its open transactions are not known yet")
            continue
        found.extend(_OpenHere(address, tp.topic, tp.partition, t)
                     for t in described.open_transactions)
    return found, len(listed), problems


def _coordinator_answers(client, opened: list[_OpenHere], problems: list[str]) -> dict:
    """{txn key: DescribeTransactionResponse, or "UNKNOWN" for UNKNOWN_TRANSACTION}, one
    call per transaction; a transaction whose coordinator could not be asked is left out
    (and named in problems)."""
    from atomlog.v1 import coordinator_pb2
    from spark_client.errors import AtomlogClientError

    unique = {_txn_key(o.txn.txn_id): o.txn.txn_id for o in opened}
    count = client.metadata.tc_partition_count

    def ask(txn_id):
        if txn_id.tc_partition >= count:
            return ValueError(f"it names TC partition {txn_id.tc_partition}; the cluster has "
                              f"{count}")
        try:
            return _ask_txn_owner(client, txn_id, "DescribeTransaction",
                                  coordinator_pb2.DescribeTransactionRequest(txn_id=txn_id),
                                  timeout_s=5.0)
        except AtomlogClientError as error:
            return "UNKNOWN" if error.reason == "UNKNOWN_TRANSACTION" else error

    with ThreadPoolExecutor(max_workers=MAX_PARALLEL_CALLS) as pool:
        answers = dict(zip(unique, pool.map(ask, unique.values())))
    for key, answer in list(answers.items()):
        if isinstance(answer, Exception):
            problems.append(f"transaction {key[0]}:{key[1]}: its coordinator could not be "
                            f"asked: {answer}")
            del answers[key]
    return answers


def _view_for(answer, o: _OpenHere) -> CoordinatorView:
    if isinstance(answer, str):  # "UNKNOWN"
        return CoordinatorView("UNKNOWN")
    here = (o.topic, o.partition)
    return CoordinatorView(
        _state_name(answer.summary.state),
        registered=here in {(t.topic, t.partition) for t in answer.topic_partitions},
        marker_pending=here in {(t.topic, t.partition)
                                for t in answer.marker_pending_topic_partitions})


def _still_open(client, findings: list, problems: list[str]) -> list:
    """Keep the HANGING findings whose transaction the partition still holds open when
    described again (after the coordinator answered): a marker may have landed meanwhile."""
    from atomlog.v1 import common_pb2, partition_pb2
    from spark_client.errors import from_grpc

    kept, open_now = [], {}
    for o, view, finding in findings:
        if finding.verdict != "HANGING":
            kept.append((o, view, finding))
            continue
        where = (o.address, o.topic, o.partition)
        if where not in open_now:
            stub = client.channels.partition(o.address)
            try:
                described = stub.DescribePartition(partition_pb2.DescribePartitionRequest(
                    topic_partition=common_pb2.TopicPartition(topic=o.topic, partition=o.partition),
                    max_producers=1), timeout=SERVER_CALL_TIMEOUT_S)
                open_now[where] = {_txn_key(t.txn_id) for t in described.open_transactions}
            except grpc.RpcError as rpc_error:
                problems.append(f"{o.topic}-{o.partition}: not described again to confirm "
                                f"a hanging transaction: {from_grpc(rpc_error)}")
                open_now[where] = None
        still = open_now[where]
        if still is None or _txn_key(o.txn.txn_id) in still:
            kept.append((o, view, finding))
    return kept


def _print_findings(findings: list, checked: int, partitions: int, output: str,
                    complete: bool = True) -> None:
    if output == "json":
        click.echo(json.dumps({"findings": [{
            "verdict": finding.verdict, "txn_id": format_txn_id(o.txn.txn_id),
            "topic": o.topic, "partition": o.partition, "first_offset": o.txn.first_offset,
            "last_offset": o.txn.last_offset, "producer_id": o.txn.producer_id,
            "age_ms": o.txn.age_ms, "coordinator_state": view.state,
            "explanation": finding.explanation, "remedy": finding.remedy}
            for o, view, finding in findings],
            "checked_transactions": checked, "listed_partitions": partitions,
            "complete": complete}, indent=2))
        return
    summary = (f"checked {checked} open transaction(s) on {partitions} partition(s)"
               + ("" if complete else "; not everything could be checked: see the warnings"))
    if not findings:
        console.print(f"no hanging or late transactions ({summary})", highlight=False)
        return
    table = Table()
    for column in ("verdict", "transaction", "partition", "first offset", "age here",
                   "coordinator says"):
        table.add_column(column)
    for o, view, finding in findings:
        color = "red" if finding.verdict == "HANGING" else "yellow"
        table.add_row(f"[{color}]{finding.verdict}[/]", format_txn_id(o.txn.txn_id),
                      f"{o.topic}/{o.partition}", str(o.txn.first_offset),
                      _duration(o.txn.age_ms), view.state)
    console.print(table)
    for o, view, finding in findings:
        console.print(f"{format_txn_id(o.txn.txn_id)} on {o.topic}/{o.partition}: "
                      f"{escape(finding.explanation)}. What to do: {escape(finding.remedy)}.",
                      highlight=False)
    hanging = sum(1 for _, _, f in findings if f.verdict == "HANGING")
    console.print(f"{hanging} hanging, {len(findings) - hanging} late ({summary})",
                  highlight=False)


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
    from spark_client.errors import AtomlogClientError

    futures = []
    try:
        with _client(_bootstrap(bootstrap, data_dir)) as client, client.producer() as producer:
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
    from spark_client.errors import AtomlogClientError

    count = 0
    try:
        with _client(_bootstrap(bootstrap, data_dir)) as client, \
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


# ---------------------------------------------------------------- access control lists
def _acl_store(zookeeper: str | None, chroot: str | None, digest_file: str | None,
               data_dir: Path):
    """An AclStore on the cluster's ZooKeeper: the flags, else the local cluster's
    (cluster.json: its ZooKeeper, chroot and, for `up --tls` clusters, digest file)."""
    from services.acl import AclStore
    from services.launcher import ClusterFile
    from services.zk import DigestFileError, kazoo_client

    cluster = ClusterFile.load(data_dir.resolve()) if data_dir.exists() else None
    if not zookeeper:
        if cluster is None:
            fail(f"no --zookeeper given and no local cluster in {data_dir}", 2)
        zookeeper = cluster.zookeeper
        chroot = chroot or cluster.chroot
        digest_file = digest_file or (cluster.tls or {}).get("zookeeper_digest_file") or None
    try:
        client = kazoo_client(zookeeper + (chroot or "/atomlog"), digest_file or "", timeout=10)
        client.start(timeout=10)
    except DigestFileError as error:
        fail(f"--zookeeper-digest-file: {error}", 2)
    except Exception as error:  # noqa: BLE001 — kazoo's timeout and connection errors
        fail(f"cannot reach ZooKeeper at {zookeeper}: {error}")
    return AclStore(client)


_ACL_CONNECTION = (
    click.option("--zookeeper", envvar="ATOMLOG_ZOOKEEPER", metavar="HOST:PORT,...",
                 help="The cluster's ZooKeeper (default: the local cluster's). ACLs live in "
                      "the znode /acls under the chroot; every server watches it."),
    click.option("--chroot", envvar="ATOMLOG_ZOOKEEPER_CHROOT", metavar="PATH",
                 help="zookeeper.chroot of the cluster (default /atomlog)."),
    click.option("--zookeeper-digest-file", "digest_file",
                 envvar="ATOMLOG_ZOOKEEPER_DIGEST_FILE", metavar="FILE",
                 help="The servers' zookeeper.digest_file (`user:password`): changing ACLs "
                      "needs it when the cluster protects its znodes (default: the local "
                      "cluster's). Listing does not."),
)


def _acl_entry_options(command):
    options = (
        click.option("--principal", "-p", required=True,
                     help="The principal (a certificate's CN, a token's subject) or * for "
                          "everyone."),
        click.option("--resource-type", "-t", required=True,
                     type=click.Choice(["topic", "subscription", "transactional_id",
                                        "cluster", "transaction_admin"])),
        click.option("--name", "-n", default="*", show_default=True,
                     help="The resource's name (* matches every name; cluster and "
                          "transaction_admin have the one name 'atomlog')."),
        click.option("--prefix", is_flag=True,
                     help="--name is a prefix: every resource whose name starts with it."),
        click.option("--operation", "operations", multiple=True, required=True,
                     type=click.Choice(["read", "write", "create", "describe", "alter", "abort"]),
                     help="Repeatable."),
        click.option("--deny", is_flag=True, help="A deny entry (deny wins over allow)."),
    )
    for option in reversed((*options, *_ACL_CONNECTION, data_dir_option)):
        command = option(command)
    return command


def _entries(principal, resource_type, name, prefix, operations, deny):
    from services.acl import Acl, AclError

    try:
        return [Acl(principal, resource_type, name, operation, "deny" if deny else "allow",
                    "prefix" if prefix else "literal") for operation in operations]
    except AclError as error:
        fail(str(error), 2)


def _print_acls(acls, output: str) -> None:
    if output == "json":
        click.echo(json.dumps([acl.to_json() for acl in acls], indent=2))
        return
    table = Table()
    for column in ("permission", "principal", "operation", "resource type", "name", "pattern"):
        table.add_column(column)
    for acl in acls:
        table.add_row(acl.permission, acl.principal, acl.operation, acl.resource_type,
                      acl.name, acl.pattern)
    console.print(table)


@cli.group()
def acl() -> None:
    """Access control lists (with auth.authorizer=acl; docs/security.md).

    An entry allows or denies a principal (or * for everyone) one operation (read,
    write, create, describe, alter, abort) on resources of one type (topic,
    subscription, transactional_id, cluster, transaction_admin) named NAME, or whose
    name starts with NAME (--prefix). Deny wins; what no entry allows is denied.
    Entries live in ZooKeeper (/acls under the chroot); every server watches them, so a
    change applies within about a second. Example: let alice produce to every topic
    starting with orders- and commit as transactional id etl-1:

      atomlog acl add -p alice -t topic -n orders- --prefix --operation write

      atomlog acl add -p alice -t transactional_id -n etl-1 --operation write
    """


@acl.command("add")
@_acl_entry_options
@output_option
def acl_add(principal, resource_type, name, prefix, operations, deny, zookeeper, chroot,
            digest_file, data_dir: Path, output: str) -> None:
    """Add ACL entries (one per --operation); adding an existing entry changes nothing."""
    entries = _entries(principal, resource_type, name, prefix, operations, deny)
    _change_acls(_acl_store(zookeeper, chroot, digest_file, data_dir),
                 lambda acls: acls.added(entries))
    _print_acls(entries, output)


@acl.command("remove")
@_acl_entry_options
@output_option
def acl_remove(principal, resource_type, name, prefix, operations, deny, zookeeper, chroot,
               digest_file, data_dir: Path, output: str) -> None:
    """Remove the ACL entries that equal the ones described (exits 1 when none is there)."""
    entries = _entries(principal, resource_type, name, prefix, operations, deny)
    store = _acl_store(zookeeper, chroot, digest_file, data_dir)
    present: list = []

    def remove(acls):
        present[:] = [e for e in entries if e in set(acls.acls)]
        if not present:
            fail("no such ACL entry (see `atomlog acl list`)")
        return acls.removed(entries)

    _change_acls(store, remove)
    _print_acls(present, output)


def _change_acls(store, change) -> None:
    """Apply `change` to the stored ACLs (compare-and-set), with the CLI's refusals."""
    from kazoo.exceptions import NoAuthError

    from services.acl import AclError

    try:
        store.change(change)
    except NoAuthError:
        fail("ZooKeeper refused the change (NoAuth): give the servers' credential with "
             "--zookeeper-digest-file")
    except AclError as error:
        fail(str(error))
    finally:
        store.client.stop()


@acl.command("list")
@click.option("--principal", "-p", help="Only entries of this principal.")
@click.option("--resource-type", "-t", help="Only entries on this resource type.")
@click.option("--name", "-n", help="Only entries with this name.")
@_ACL_CONNECTION[0]
@_ACL_CONNECTION[1]
@_ACL_CONNECTION[2]
@data_dir_option
@output_option
def acl_list(principal, resource_type, name, zookeeper, chroot, digest_file, data_dir: Path,
             output: str) -> None:
    """The ACL entries in force (every server's, from ZooKeeper)."""
    from services.acl import AclError

    store = _acl_store(zookeeper, chroot, digest_file, data_dir)
    try:
        acls = store.read()[0].acls
    except AclError as error:
        fail(str(error))
    finally:
        store.client.stop()
    _print_acls([a for a in acls if (principal is None or a.principal == principal)
                 and (resource_type is None or a.resource_type == resource_type)
                 and (name is None or a.name == name)], output)


def main() -> None:
    cli(prog_name="atomlog")


if __name__ == "__main__":
    main()
