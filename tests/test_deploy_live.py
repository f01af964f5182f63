"""The dashboards and rules against real tools: `atomlog up --prometheus` starts the
Debian package's Prometheus beside the shared test cluster, a small load runs (idempotent
produce, streaming and one-call transactions, commits and aborts, read_committed reads,
and a few deliberate client errors so the error panels have series), then every
dashboard query and every rule expression goes through Prometheus's HTTP API: each must
parse and return series. The rules are loaded by that Prometheus, which must report
every group healthy. Also: the committed dashboards are what deploy/grafana/dashboards.py
renders, and `promtool` checks and unit-tests the rules."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from tests.conftest import REPO_ROOT, create_online
from tests.test_deploy_kubernetes import atomlog_workloads, tool

PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
GRAFANA_DIR = REPO_ROOT / "deploy" / "grafana"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
# Grafana's variables, as Grafana would expand them for "All" on this Prometheus (2 s
# scrapes: $__rate_interval is at least 4 scrape intervals; 20 s holds ~10 samples).
GRAFANA_VARIABLES = {"$__rate_interval": "20s", "$namespace": ".*", "$topic": ".*"}
# Expressions whose series exist only after a fault this test cannot cause on a shared
# cluster. For these the query must still succeed, and every metric they select and
# every label they filter on must exist on that Prometheus.
ONLY_AFTER_A_FAULT = {
    "AtomlogProducerIdSpaceExhausted": "needs 2^63 producer ids handed out",
    "AtomlogProducerIdAllocationFailing": "needs ZooKeeper to fail under the allocator",
    "AtomlogRpcInternalErrors": "needs a server bug (INTERNAL) or data loss",
}


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every panel target."""
    found = []
    for path in sorted((GRAFANA_DIR / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for p in board["panels"]:
            for target in p.get("targets", []):
                found.append((board["uid"], p["title"], target["expr"]))
    return found


def with_bool(expr: str) -> str:
    """The expression with every comparison outside {...} turned into `op bool`, so it
    returns its series whether or not the condition holds."""
    out, depth, i = [], 0, 0
    while i < len(expr):
        ch = expr[i]
        if ch == '"':
            end = expr.index('"', i + 1)
            out.append(expr[i:end + 1])
            i = end + 1
            continue
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            match = re.match(r"(==|!=|>=|<=|>|<)(?!\s*bool)", expr[i:])
            if match and not expr[i:].startswith(("!~", "=~")):
                out.append(match.group(1) + " bool")
                i += len(match.group(1))
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def test_with_bool_rewrites_only_comparisons():
    assert with_bool('up{role=~"a|b",x!="1"} == 0') == 'up{role=~"a|b",x!="1"} == bool 0'
    assert with_bool("a > 0 and b >= 1") == "a > bool 0 and b >= bool 1"
    assert with_bool("(x or on() vector(0)) < 16") == "(x or on() vector(0)) < bool 16"


# ---------------------------------------------------------------- offline checks
def test_committed_dashboards_are_what_the_generator_renders():
    rendered = load_module(GRAFANA_DIR / "dashboards.py").render()
    files = {p.name: p.read_text() for p in (GRAFANA_DIR / "dashboards").glob("*.json")}
    assert files == rendered, "run: python deploy/grafana/dashboards.py"
    titles = {json.loads(text)["title"] for text in rendered.values()}
    assert titles == {"atomlog / Cluster overview", "atomlog / Transactions",
                      "atomlog / Partitions and storage", "atomlog / Clients"}
    for text in rendered.values():
        board = json.loads(text)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for p in board["panels"]:
            grid = p["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
            if p["type"] != "row":
                assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert p["targets"] and all(t["expr"] for t in p["targets"])


def test_grafana_provisioning_points_at_the_dashboards():
    datasource = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/atomlog.yml").read_text())
    assert datasource["apiVersion"] == 1
    assert [d["type"] for d in datasource["datasources"]] == ["prometheus"]
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning/dashboards/atomlog.yml").read_text())
    assert provider["providers"][0]["type"] == "file"
    assert provider["providers"][0]["options"]["path"].startswith("/")


def test_promtool_checks_the_rules_and_both_scrape_configurations(tmp_path):
    promtool = tool("promtool")
    result = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR,
                            capture_output=True, text=True)
    assert result.returncode == 0 and f"{len(rules())} rules found" not in result.stderr, \
        result.stdout + result.stderr
    # Debian's Prometheus is built without Kubernetes service discovery: check the rest of
    # kubernetes.yml with a static target in its place.
    config = yaml.safe_load((PROMETHEUS_DIR / "kubernetes.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    job.pop("kubernetes_sd_configs")
    job["static_configs"] = [{"targets": ["127.0.0.1:9102"]}]
    config["rule_files"] = [str(PROMETHEUS_DIR / "rules" / "*.yml")]
    (tmp_path / "kubernetes.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "kubernetes.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Its relabelling gives the labels the rules group by, from the pod labels of
    # deploy/kubernetes; and it keeps the port the pods name "metrics".
    targets = {r.get("target_label"): r["source_labels"][0] for r in job["relabel_configs"]}
    assert targets["role"] == "__meta_kubernetes_pod_label_atomlog_io_role"
    assert targets["instance_name"] == "__meta_kubernetes_pod_name"
    roles = {w["spec"]["template"]["metadata"]["labels"]["atomlog.io/role"]
             for w in atomlog_workloads("production").values()}
    assert roles == {"partition_server", "coordinator", "id_allocator"}
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert any(r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]
               and r["regex"] == "metrics" for r in keep)


def test_promtool_unit_tests_cover_every_alert():
    result = subprocess.run([tool("promtool"), "test", "rules", "atomlog-rules.test.yml"],
                            cwd=PROMETHEUS_DIR / "tests", capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    tests = yaml.safe_load((PROMETHEUS_DIR / "tests" / "atomlog-rules.test.yml").read_text())["tests"]
    firing = {check["alertname"] for t in tests for check in t.get("alert_rule_test", [])
              if check["exp_alerts"]}
    quiet = {check["alertname"] for t in tests for check in t.get("alert_rule_test", [])
             if not check["exp_alerts"]}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts == firing == quiet, "each alert: a case where it fires, one where it does not"


def test_every_alert_has_a_runbook_in_the_operations_guide():
    docs = (REPO_ROOT / "docs" / "operations.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", docs, re.M)}
    for rule in rules():
        if "alert" in rule:
            runbook = rule["annotations"]["runbook"]
            assert runbook == f"docs/operations.md#{rule['alert'].lower()}"
            assert rule["alert"].lower() in anchors, f"no section {rule['alert']} in docs/operations.md"
            assert rule["labels"]["severity"] in ("critical", "warning")


# ---------------------------------------------------------------- against a real Prometheus
class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as reply:
            return json.loads(reply.read())

    def query(self, expr: str) -> list:
        try:
            answer = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as error:  # 400: does not parse
            raise AssertionError(f"{expr}: {error.read().decode()}") from None
        assert answer["status"] == "success", answer
        return answer["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(cluster):
    """`atomlog up --prometheus` on the shared cluster, a small load, enough scrapes."""
    report = json.loads(cluster.run("up", "--prometheus", "--output", "json").stdout)
    url = report["prometheus_url"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    assert "prometheus" in report["started"] + report["already_running"]
    status = cluster.status()
    assert status["prometheus"]["health"] == "SERVING" and status["prometheus"]["url"] == url
    server = Prometheus(url)
    try:
        _load(cluster, seconds=10)
        began = time.monotonic()  # two more scrapes and a rule evaluation after the load
        while time.monotonic() - began < 30:
            ready = server.query("role:atomlog_rpc_handled:rate5m") and server.query(
                'count(count_over_time(atomlog_coordinator_transactions_ended_total[20s]) >= 3)')
            if ready:
                break
            time.sleep(0.5)
        time.sleep(4)
        yield server
    finally:
        # Leave the shared cluster as it was: no Prometheus, none recorded for later `up`s.
        from services.launcher import ClusterFile, marker_of, process_alive
        recorded = ClusterFile.load(cluster.data_dir)
        entry = recorded.prometheus if recorded else None
        if entry is not None:
            if process_alive(entry.pid, marker_of(entry)):
                os.kill(entry.pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while process_alive(entry.pid, marker_of(entry)) and time.monotonic() < deadline:
                    time.sleep(0.05)
            recorded.prometheus = None
            recorded.save(cluster.data_dir)


def _load(cluster, seconds: float) -> None:
    from atomlog.v1 import (common_pb2, id_allocator_pb2, id_allocator_pb2_grpc, partition_pb2,
                            partition_pb2_grpc)
    from partition_server.record_batch import Record, encode_batch
    from spark_client import Client

    bootstrap = cluster.info["bootstrap"]
    one_call, streaming = Client(bootstrap), Client(bootstrap, one_call_max_bytes=0)
    topic = create_online(one_call, f"deploy-live-{int(time.time())}", 3)
    # A replicated topic, so the replication gauges have series.
    create_online(one_call, f"deploy-live-replicated-{int(time.time())}", 1,
                  replication_factor=3)
    deadline, n = time.monotonic() + seconds, 0
    with one_call.producer() as producer, streaming.producer() as s_producer, \
            one_call.consumer(topic) as consumer:
        while time.monotonic() < deadline:
            producer.send(topic, b"plain-%d" % n).result(timeout=10)
            with one_call.transaction(timeout_s=30) as txn:  # one-call, committed
                producer.send(topic, b"one-call-%d" % n, partition=n % 3, txn=txn)
            txn = streaming.begin_transaction(timeout_s=30)  # streaming: EndTxn, markers
            s_producer.send(topic, b"streaming-%d" % n, partition=(n + 1) % 3, txn=txn).result(timeout=10)
            txn.commit() if n % 3 else txn.abort()
            consumer.poll(timeout_s=0.05)
            n += 1
            time.sleep(0.2)
    # Client mistakes the error panels show: a batch with a broken CRC and one for a
    # topic that does not exist (refused batches by reason), a producer-id block larger
    # than allowed (allocation failures by reason, INVALID_ARGUMENT calls).
    batch = bytearray(encode_batch([Record(value=b"x" * 64)]))
    batch[-1] ^= 0xFF
    servers = [p for p in cluster.services() if p["role"] == "partition_server"]
    for process in servers:
        with grpc.insecure_channel(process["grpc_address"]) as channel:
            stub = partition_pb2_grpc.PartitionServiceStub(channel)
            stub.Produce(partition_pb2.ProduceRequest(items=[
                partition_pb2.ProduceItem(topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
                                          record_batch=bytes(batch)),
                partition_pb2.ProduceItem(topic_partition=common_pb2.TopicPartition(
                    topic="no-such-topic", partition=0), record_batch=bytes(encode_batch([Record(value=b"y")])))]),
                timeout=10)
    allocator = next(p for p in cluster.services() if p["role"] == "id_allocator")
    with grpc.insecure_channel(allocator["grpc_address"]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            id_allocator_pb2_grpc.IdAllocatorServiceStub(channel).AllocateProducerIds(
                id_allocator_pb2.AllocateProducerIdsRequest(count=2_000_000_000), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    one_call.close()
    streaming.close()


def expand(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_query_returns_series(prometheus):
    empty = []
    queries = dashboard_queries()
    assert len(queries) >= 40
    for uid, title, expr in queries:
        if not prometheus.query(expand(expr)):
            empty.append(f"{uid} / {title}: {expr}")
    assert not empty, "queries without series:\n" + "\n".join(empty)


def test_dashboard_variables_find_their_values(prometheus):
    for path in (GRAFANA_DIR / "dashboards").glob("*.json"):
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
            metric, label = match.groups()
            answer = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": expand(metric)})
            assert answer["status"] == "success"
            if label == "topic":
                assert any(v.startswith("deploy-live-") for v in answer["data"]), answer


def test_every_rule_expression_returns_series_and_prometheus_evaluates_them(prometheus):
    empty = []
    for rule in rules():
        name = rule.get("alert") or rule["record"]
        expr = with_bool(rule["expr"]) if "alert" in rule else rule["expr"]
        if prometheus.query(expr):
            assert name not in ONLY_AFTER_A_FAULT, f"{name} has series now: drop it from the list"
            continue
        if name in ONLY_AFTER_A_FAULT:
            for metric, matchers in re.findall(r"(atomlog_[a-z0-9_]+)\{([^}]*)\}", rule["expr"]):
                assert prometheus.query(f"count({metric})"), f"{name}: no {metric} at all"
                for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                    assert prometheus.query(f'count({metric}{{{label}!=""}})'), (name, label)
            continue
        empty.append(f"{name}: {expr}")
    assert not empty, "rule expressions without series:\n" + "\n".join(empty)
    # The Prometheus of `atomlog up --prometheus` loaded every rule file and evaluates
    # every rule without errors; recorded series exist.
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r.get("alert") or r["record"] for r in rules()}
    assert all(r["health"] == "ok" for r in loaded.values()), [
        (n, r.get("lastError")) for n, r in loaded.items() if r["health"] != "ok"]
    for rule in rules():
        if "record" in rule:
            assert prometheus.query(rule["record"]), f"{rule['record']} was not recorded"
