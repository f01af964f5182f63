"""The Spark driver of tests/test_spark_speculation.py (run as a subprocess).

    python tests/spark_speculation_job.py MASTER BOOTSTRAP TOPIC UI_PORT

Writes TASKS x ROWS_PER_TASK rows to TOPIC through `df.write.format("atomlog")` on a
standalone cluster with aggressive speculation. Task SLOW_TASK's first attempt computes
and hands on all of its rows, then stalls: Spark streams an Arrow UDF's output batches to
the downstream writer as they are yielded, so the atomlog writer of that attempt has sent
(most of) its rows in its child transaction before the stall, and then waits for the end
of its input. Speculation starts a copy of the task on the other worker (Spark never runs
a speculative copy on a host that already runs an attempt of the task); the copy hands on
its rows once the original's are in the partition (speculation may start it while the
original is still starting up), wins, the driver commits the parent naming the copy's
child, and Spark kills the original.

Every row of task t goes to atomlog partition t (column `partition`), so the losing
attempt's rows all land in one partition. The last stdout line is `RESULT {json}`: the
write stage's task attempts and the executors, from the driver's REST API.
"""

import json
import sys
import time
import urllib.request
from collections.abc import Iterator

TASKS = 4
ROWS_PER_TASK = 2000
PADDING = "x" * 200  # enough bytes that the pipe buffers cannot hold a task's rows
SLOW_TASK = 1
STALL_S = 90.0  # far longer than the speculative copy needs; Spark kills the original
# After Spark asks to kill a task, it waits this long before it kills the task's Python
# workers (default 2 s). Longer, so that the killed original cannot end its child itself
# (its writer's except-clause aborts it) before the driver's commit: the original's child
# is still OPEN when the parent commits, and the parent's commit is what aborts it.
PYTHON_KILL_TIMEOUT = "10s"
# Five JVMs start on what may be a small machine: quick-starting ones.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def value_of(i: int) -> str:
    return f"t{i // ROWS_PER_TASK}-{i:06d}-{PADDING}"


def wait_for_rows(bootstrap: str, topic: str, partition: int, rows: int,
                  timeout_s: float = 60.0) -> None:
    """Until the partition holds at least `rows` records (committed or not)."""
    from spark_client import Client

    deadline = time.monotonic() + timeout_s
    with Client(bootstrap) as client:
        while (client.describe_partition(topic, partition).high_watermark < rows
               and time.monotonic() < deadline):
            time.sleep(0.1)


def rest(ui: str, path: str):
    with urllib.request.urlopen(f"{ui}/api/v1/{path}", timeout=10) as reply:
        return json.loads(reply.read())


def main() -> None:
    master, bootstrap, topic, ui_port = sys.argv[1:5]
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from pyspark.sql.functions import arrow_udf, col

    from spark_client.spark import register

    spark = (SparkSession.builder.master(master).appName("atomlog-speculation")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.memory", "512m")
             .config("spark.ui.port", ui_port)
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
             .config("spark.executor.memory", "512m")
             .config("spark.executor.cores", "1")
             .config("spark.cores.max", "2")
             # Start tasks only once both executors (one per worker, per host) are there.
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "90s")
             .config("spark.speculation", "true")
             .config("spark.speculation.interval", "100ms")
             .config("spark.speculation.quantile", "0.5")
             .config("spark.speculation.multiplier", "1.5")
             .config("spark.speculation.minTaskRuntime", "1s")
             # Speculate on duration alone, not on the (efficiency) processing-rate test.
             .config("spark.speculation.efficiency.enabled", "false")
             .config("spark.python.task.killTimeout", PYTHON_KILL_TIMEOUT)
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    register(spark)
    ui = spark.sparkContext.uiWebUrl.rstrip("/")
    app = spark.sparkContext.applicationId

    rows_per_task, slow_task, stall_s = ROWS_PER_TASK, SLOW_TASK, STALL_S

    @arrow_udf("string")
    def values(ids: Iterator[pa.Array]) -> Iterator[pa.Array]:
        from pyspark import TaskContext

        context = TaskContext.get()
        slow = context.partitionId() == slow_task
        if slow and context.attemptNumber() > 0:
            # The speculative copy: speculation may start it while the original is still
            # starting its Python workers; let it hand on its rows only once the
            # original's rows are in the partition (nothing else writes there yet), so the
            # original has written when the copy wins.
            wait_for_rows(bootstrap, topic, slow_task, rows_per_task // 2)
        for batch in ids:
            yield pa.array([value_of(i) for i in batch.to_pylist()])
        # The original: every row is yielded (and so handed to the writer) before the
        # stall.
        if slow and context.attemptNumber() == 0:
            time.sleep(stall_s)

    df = spark.range(0, TASKS * rows_per_task, numPartitions=TASKS).select(
        values("id").alias("value"), (col("id") / rows_per_task).cast("int").alias("partition"))
    began = time.monotonic()
    # Small producer batches: the writer gathers about 4 of them before a send_batch()
    # call, so the original sends its rows as they come, not only at the end of its input.
    (df.write.format("atomlog").option("bootstrap", bootstrap).option("topic", topic)
     .option("batchMaxBytes", "16384").mode("append").save())
    took = time.monotonic() - began

    # The write is committed. Wait (briefly) until Spark has recorded the end of every
    # attempt, the killed original included, then report them.
    def attempts() -> list[dict]:
        found = []
        for stage in rest(ui, f"applications/{app}/stages"):
            tasks = rest(ui, f"applications/{app}/stages/{stage['stageId']}/"
                             f"{stage['attemptId']}/taskList?length=1000")
            found += [dict(t, stageId=stage["stageId"]) for t in tasks]
        return found

    deadline = time.monotonic() + 60
    found = attempts()
    while any(t["status"] == "RUNNING" for t in found) and time.monotonic() < deadline:
        time.sleep(0.2)
        found = attempts()
    executors = rest(ui, f"applications/{app}/allexecutors")
    keep = ("stageId", "taskId", "index", "attempt", "status", "speculative", "host",
            "executorId", "launchTime", "duration", "errorMessage")
    print("RESULT " + json.dumps({
        "write_seconds": took, "app": app,
        "tasks": [{k: t.get(k) for k in keep} for t in found],
        "executors": [{"id": e["id"], "hostPort": e["hostPort"]} for e in executors]}),
        flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
