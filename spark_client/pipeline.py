"""The exactly-once pipeline: a Spark Structured Streaming consume-transform-produce job
over atomlog, killed with SIGKILL in the middle and restarted from its checkpoint.

    python -m spark_client.pipeline demo [--bootstrap HOST:PORT]    # what scripts/main.sh runs
    python -m spark_client.pipeline run --bootstrap ... --input T --output U --checkpoint DIR

`demo` creates an input and an output topic (fresh names per run), seeds the input,
starts `run` as a separate process group (the Spark driver, its JVM and its Python
workers), watches committed output grow with a progress bar, kills the whole group with
SIGKILL once part of the output is committed, starts `run` again on the same checkpoint,
waits for it to finish and verifies that the output is exactly the transformed input:
nothing lost, nothing twice. It exits 0 only when that holds.

`run` is the job itself: readStream from the input topic (read_committed), the
transform, writeStream to the output topic (parent/child transactions, one parent per
micro-batch), Trigger.AvailableNow with maxRecordsPerTrigger so the input is processed
in many micro-batches, then it exits.

A cluster serving TLS (`atomlog up --tls`; scripts/main.sh with ATOMLOG_TLS=1): the
demo's client and the job's Spark options tls.ca/tls.cert/tls.key use the CA and the
client certificate (atomlog-admin, a super user) named by DATA_DIR/cluster.json, unless
--tls-ca/--tls-cert/--tls-key say otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

INPUT_PARTITIONS = 4
OUTPUT_PARTITIONS = 4


def transform_value(value: bytes) -> bytes:
    """What the job does to each value (the Spark job computes the same in SQL)."""
    return value.upper() + b"!"


def seed_value(i: int) -> bytes:
    return f"record-{i:08d}".encode()


# ---------------------------------------------------------------------------- run
def run(args) -> None:
    from spark_client.spark import local_session

    spark = local_session("atomlog-pipeline", master=args.master)
    tls = {name: value for name, value in (("tls.ca", args.tls_ca), ("tls.cert", args.tls_cert),
                                           ("tls.key", args.tls_key)) if value}
    source = (spark.readStream.format("atomlog").option("bootstrap", args.bootstrap)
              .options(**tls).option("topic", args.input)
              .option("maxRecordsPerTrigger", str(args.max_per_trigger)).load())
    transformed = source.selectExpr(
        "key", "concat(upper(cast(value as string)), '!') as value")
    query = (transformed.writeStream.format("atomlog").option("bootstrap", args.bootstrap)
             .options(**tls).option("topic", args.output)
             .option("transactionTimeoutMs", str(args.transaction_timeout_ms))
             .option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    seen = set()
    finished = False
    while not finished:
        finished = query.awaitTermination(1.0)
        for progress in query.recentProgress:
            if progress.batchId not in seen:
                seen.add(progress.batchId)
                print(f"micro-batch {progress.batchId}: {progress.numInputRows} rows in "
                      f"{progress.durationMs.get('triggerExecution', 0) / 1000:.1f} s",
                      flush=True)
    spark.stop()


# ---------------------------------------------------------------------------- demo
def _read(client, topic: str, isolation: str):
    """Every message readable now under `isolation`."""
    with client.consumer(topic, isolation=isolation) as consumer:
        for messages in consumer.read_until():
            yield from messages


def _in_flight(client, topic: str) -> bool:
    """Whether a micro-batch is being written now: some output partition holds data of
    an open transaction. Killing then leaves children for the restart to abort."""
    return any(client.describe_partition(topic, p).open_transactions
               for p in range(client.partitions_for(topic)))


def _start_job(args, input_topic: str, output_topic: str, checkpoint: Path, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "spark_client.pipeline", "run",
               "--bootstrap", args.bootstrap, "--input", input_topic, "--output", output_topic,
               "--checkpoint", str(checkpoint), "--max-per-trigger", str(args.max_per_trigger),
               "--transaction-timeout-ms", str(args.transaction_timeout_ms),
               "--master", args.master]
    for flag, value in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key)):
        if value:
            command += [flag, value]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _client_tls(args):
    """The SDK's TlsConfig from --tls-ca/--tls-cert/--tls-key, or None (plaintext)."""
    from spark_client import TlsConfig

    return TlsConfig(args.tls_ca, args.tls_cert or "", args.tls_key or "") \
        if args.tls_ca else None


def demo(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from spark_client import Client

    console = Console(width=None if sys.stdout.isatty() else 160)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    input_topic, output_topic = f"pipeline-in-{run_id}", f"pipeline-out-{run_id}"
    workdir = Path(args.workdir) / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / "checkpoint"
    client = Client(args.bootstrap, tls=_client_tls(args))
    client.create_topic(input_topic, partitions=INPUT_PARTITIONS)
    client.create_topic(output_topic, partitions=OUTPUT_PARTITIONS)
    console.print(f"seeding [bold]{args.records:,}[/] records into {input_topic} ...")
    with client.producer() as producer:
        for i in range(args.records):
            producer.send(input_topic, seed_value(i), key=str(i % 97))
        producer.flush()
    expected = Counter(transform_value(seed_value(i)) for i in range(args.records))

    log_path = workdir / "job.log"
    kill_at = int(args.records * args.kill_at)
    kills = done = 0
    # Committed output is counted as it grows: each tick reads only what was committed
    # since the last one.
    watcher = client.consumer(output_topic)

    def committed() -> int:
        return done + sum(len(messages) for messages in watcher.read_until())

    with watcher, open(log_path, "ab") as log, Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("committed output", total=args.records)
        job = _start_job(args, input_topic, output_topic, checkpoint, log)
        progress.console.print(f"Spark job started (pid {job.pid}, log {log_path})")
        deadline = time.monotonic() + args.timeout_s
        while True:
            time.sleep(1.0)
            done = committed()
            progress.update(task, completed=min(done, args.records))
            finished = job.poll() is not None
            if finished:
                if kills == 0 and job.returncode == 0:
                    progress.console.print("[yellow]the job finished before it could be "
                                           "killed; use more records[/]")
                break
            if kills == 0 and done >= kill_at and (_in_flight(client, output_topic)
                                                   or done >= 2 * kill_at):
                _kill_group(job)
                kills += 1
                progress.console.print(
                    f"[red]killed the Spark job with SIGKILL[/] at {done:,} committed "
                    "records; restarting it from its checkpoint")
                job = _start_job(args, input_topic, output_topic, checkpoint, log)
            if time.monotonic() > deadline:
                _kill_group(job)
                console.print(f"[bold red]timed out[/] after {args.timeout_s:.0f} s; "
                              f"see {log_path}")
                return 1
        if job.returncode != 0:
            console.print(f"[bold red]the Spark job failed (exit {job.returncode})[/]; "
                          f"see {log_path}")
            return 1
        progress.update(task, completed=committed())

    got = Counter(m.value for m in _read(client, output_topic, "read_committed"))
    uncommitted = sum(1 for _ in _read(client, output_topic, "read_uncommitted"))
    duplicates = sum(n - 1 for n in got.values() if n > 1)
    missing = sum((expected - got).values())
    unexpected = sum((got - expected).values())
    ok = duplicates == 0 and missing == 0 and unexpected == 0
    console.print(f"input {args.records:,} records; output (read_committed) "
                  f"{sum(got.values()):,} records; duplicates {duplicates}; missing {missing}; "
                  f"unexpected {unexpected}")
    console.print(f"records written by killed or superseded attempts and aborted "
                  f"(visible only to read_uncommitted): {uncommitted - sum(got.values()):,}; "
                  f"kills: {kills}")
    console.print("[bold green]exactly once: output equals the transformed input[/]" if ok
                  else "[bold red]NOT exactly once[/]")
    client.close()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spark_client.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("demo", "run"):
        p = sub.add_parser(name)
        p.add_argument("--bootstrap", help="an atomlog server address (default: the local "
                       "cluster's, from DATA_DIR/cluster.json)")
        p.add_argument("--data-dir", default=os.environ.get("ATOMLOG_DATA_DIR", ".atomlog"),
                       help="the local cluster's directory (default: $ATOMLOG_DATA_DIR or "
                            ".atomlog)")
        p.add_argument("--tls-ca", help="a TLS cluster's CA file (default: the local "
                       "cluster's, when it was made with `atomlog up --tls`)")
        p.add_argument("--tls-cert", help="mTLS: the client certificate file (default: the "
                       "local TLS cluster's client certificate)")
        p.add_argument("--tls-key", help="mTLS: the key of --tls-cert")
        p.add_argument("--max-per-trigger", type=int, default=2_000,
                       help="maxRecordsPerTrigger (offsets per micro-batch)")
        p.add_argument("--transaction-timeout-ms", type=int, default=20_000,
                       help="a micro-batch's parent transaction timeout")
        p.add_argument("--master", default="local[2,4]", help="Spark master")
    demo_p, run_p = sub.choices["demo"], sub.choices["run"]
    demo_p.add_argument("--records", type=int, default=20_000)
    demo_p.add_argument("--kill-at", type=float, default=0.4,
                        help="kill the job when this share of the output is committed")
    demo_p.add_argument("--workdir", default=".atomlog/pipeline")
    demo_p.add_argument("--timeout-s", type=float, default=600)
    run_p.add_argument("--input", required=True)
    run_p.add_argument("--output", required=True)
    run_p.add_argument("--checkpoint", required=True)
    args = parser.parse_args(argv)
    cluster_file = Path(args.data_dir) / "cluster.json"
    if not args.bootstrap:
        if not cluster_file.exists():
            parser.error(f"no --bootstrap and no local cluster ({cluster_file}): "
                         "run `atomlog up` first")
        args.bootstrap = json.loads(cluster_file.read_text())["bootstrap"]
    if not args.tls_ca and cluster_file.exists():
        local_tls = json.loads(cluster_file.read_text()).get("tls") or {}
        args.tls_ca = local_tls.get("ca_file")
        args.tls_cert = args.tls_cert or local_tls.get("cert_file")
        args.tls_key = args.tls_key or local_tls.get("key_file")
    if args.command == "run":
        run(args)
        return 0
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
