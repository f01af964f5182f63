"""deploy/kubernetes: every overlay renders with kustomize, passes kubernetes-validate
--strict for the Kubernetes versions docs/operations.md names, and the rendered objects
have the properties an operator relies on (probes, drain, PDBs, security, placement,
settings the servers really accept, network paths). A real ZooKeeper runs the dev
overlay's zoo.cfg and answers the probes the manifests give it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from services import localzk
from services.config import load_config
from services.launcher import free_port
from tests.conftest import REPO_ROOT

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("dev", "production")
# The oldest Kubernetes the manifests support (native preStop sleep is on by default from
# 1.30, gRPC probes from 1.27, PDB unhealthyPodEvictionPolicy from 1.31) and the newest
# the validator knows; docs/operations.md names both.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
ROLES = {"partition-server": "partition_server", "coordinator": "coordinator",
         "id-allocator": "id_allocator"}
KUSTOMIZE_VERSION = "v5.8.1"  # scripts/bootstrap.sh installs it


def tool(name: str) -> str:
    """A tool scripts/bootstrap.sh installs: on PATH, or in its per-user cache."""
    found = shutil.which(name)
    cache_dir = Path(os.environ.get("ATOMLOG_TOOLS") or
                     Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                     / "atomlog" / "tools")
    if found is None and (cache_dir / "bin" / name).exists():
        found = str(cache_dir / "bin" / name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/bootstrap.sh` (it installs "
                    "kustomize, prometheus and promtool)")
    return found


@cache
def rendered_text(overlay: str) -> str:
    result = subprocess.run([tool("kustomize"), "build", str(KUBERNETES / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@cache
def rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(d for d in yaml.safe_load_all(rendered_text(overlay)) if d)


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == kind}


def workloads(overlay: str) -> dict[str, dict]:
    return {**objects(overlay, "StatefulSet"), **objects(overlay, "Deployment")}


def atomlog_workloads(overlay: str) -> dict[str, dict]:
    """Role (partition-server, ...) -> its StatefulSet or Deployment."""
    found = {}
    for workload in workloads(overlay).values():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/name") == "atomlog":
            found[labels["app.kubernetes.io/component"]] = workload
    return found


def container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pod"
    return containers[0]


def config_map(overlay: str, prefix: str) -> dict:
    """The generated ConfigMap named prefix-<hash>."""
    matches = [o for name, o in objects(overlay, "ConfigMap").items()
               if re.fullmatch(rf"{prefix}-[a-z0-9]{{10}}", name)]
    assert len(matches) == 1, f"one ConfigMap {prefix}-<hash>"
    return matches[0]


def selects(selector: dict, labels: dict) -> bool:
    """Does a label selector (matchLabels/matchExpressions or a plain map) match labels?"""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and not present or operator == "DoesNotExist" and present:
            return False
    return True


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def pod_env(overlay: str, workload: dict, ordinal: int = 0) -> dict[str, str]:
    """The environment Kubernetes would give pod `ordinal` of the workload: downward-API
    fields, ConfigMap keys and $(VAR) references resolved as the kubelet does."""
    namespace = workload["metadata"]["namespace"]
    pod_name = (f"{workload['metadata']['name']}-{ordinal}" if workload["kind"] == "StatefulSet"
                else f"{workload['metadata']['name']}-5d8f9c7b6-x2x9z")
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace,
              "status.podIP": "10.1.2.3"}
    # The pod's labels: the template's, and the node's zone as the PodTopologyLabels
    # admission plugin adds it (a missing label reads as "").
    labels = {**workload["spec"]["template"]["metadata"].get("labels", {}),
              "topology.kubernetes.io/zone": f"zone-{ordinal % 3}"}
    fields.update({f"metadata.labels['{k}']": v for k, v in labels.items()})
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects(overlay, "ConfigMap").values()}
    env: dict[str, str] = {}
    for item in container(workload).get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                                       item["value"])
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = SECRET_KEYS[(ref["name"], ref["key"])]
        else:
            ref = item["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in maps, f"{item['name']} refers to a missing ConfigMap {ref['name']}"
            env[item["name"]] = maps[ref["name"]][ref["key"]]
    return env


# Stand-ins for the Secrets an operator creates (docs/security.md#kubernetes): the keys
# the manifests read through the environment, and files of every mounted Secret.
SECRET_KEYS = {("atomlog-auth", "super-users"): "ops-admin"}


def secret_files(secret: str, directory: Path) -> Path:
    """Files standing in for Secret `secret`'s keys, written under directory/secret."""
    from services.tls import LocalCa

    where = directory / "secrets" / secret
    if where.exists():
        return where
    where.mkdir(parents=True)
    if secret == "atomlog-tls":
        ca = LocalCa(where / "ca")
        (where / "ca.crt").write_bytes(ca.ca_file.read_bytes())
        ca.issue(where / "tls.crt", where / "tls.key", "atomlog-server", ["atomlog-server"])
    elif secret == "atomlog-zookeeper-digest":
        (where / "digest").write_text("atomlog:0123456789abcdef0123\n")
    else:
        raise AssertionError(f"no stand-in for Secret {secret}")
    return where


def secret_mounts(workload: dict) -> dict[str, str]:
    """mountPath -> Secret name, for every Secret volume the container mounts."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]]["secret"]["secretName"]
            for m in container(workload)["volumeMounts"] if "secret" in volumes.get(m["name"], {})}


def mounted_file(overlay: str, workload: dict, path: str) -> str:
    """The content of a file the pod reads from a ConfigMap volume."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container(workload)["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = volumes[mount["name"]]
            assert "configMap" in volume, f"{path} is not from a ConfigMap"
            data = objects(overlay, "ConfigMap")[volume["configMap"]["name"]]["data"]
            return data[path[len(mount["mountPath"]):].lstrip("/")]
    raise AssertionError(f"{path} is not mounted")


def server_config(overlay: str, role: str, tmp_path: Path, ordinal: int = 0):
    """services.config.load_config on what the pod gets: the --config file from the
    ConfigMap and the container's environment (the servers' own loader and checks)."""
    workload = atomlog_workloads(overlay)[role]
    args = container(workload)["args"]
    assert args[0] == role and args[1] == "--config", args
    config_file = tmp_path / f"{overlay}-{role}.toml"
    config_file.write_text(mounted_file(overlay, workload, args[2]))
    env = pod_env(overlay, workload, ordinal)
    # Paths into mounted Secrets point at stand-in files (the servers read and check them).
    for mount, secret in secret_mounts(workload).items():
        stand_in = str(secret_files(secret, tmp_path))
        env = {name: stand_in + value[len(mount):] if value.startswith(mount + "/") else value
               for name, value in env.items()}
    return load_config(ROLES[role], config_file, env)


# ---------------------------------------------------------------- rendering and schemas
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_with_the_pinned_kustomize(overlay):
    version = subprocess.run([tool("kustomize"), "version"], capture_output=True, text=True)
    assert version.stdout.strip() == KUSTOMIZE_VERSION
    kinds = {o["kind"] for o in rendered(overlay)}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "Service", "StatefulSet", "Deployment",
            "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    namespace = next(iter(objects(overlay, "Namespace")))
    assert all(o["metadata"].get("namespace") == namespace for o in rendered(overlay)
               if o["kind"] != "Namespace"), "every object in the overlay's namespace"


def test_every_overlay_passes_strict_schema_validation(tmp_path):
    files = []
    for overlay in OVERLAYS:
        files.append(tmp_path / f"{overlay}.yaml")
        files[-1].write_text(rendered_text(overlay))
    validator = Path(sys.executable).parent / "kubernetes-validate"
    for version in KUBERNETES_VERSIONS:
        result = subprocess.run([str(validator), "--strict", "--quiet", "-k", version,
                                 *map(str, files)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "ERROR" not in result.stdout, result.stdout + result.stderr
    # The validator is strict: a misspelt field in the same output is refused.
    bad = tmp_path / "misspelt.yaml"
    bad.write_text(rendered_text("production").replace("minReadySeconds:", "minReadySecond:", 1))
    result = subprocess.run([str(validator), "--strict", "--quiet", "-k", KUBERNETES_VERSIONS[0],
                             str(bad)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "minReadySecond" in result.stdout


def test_docs_name_the_validated_kubernetes_versions():
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    for version in KUBERNETES_VERSIONS:
        assert f"Kubernetes {version.rsplit('.', 1)[0]}" in text
    assert KUSTOMIZE_VERSION in text and KUSTOMIZE_VERSION in (
        REPO_ROOT / "scripts" / "bootstrap.sh").read_text()


# ---------------------------------------------------------------- shape of each overlay
def test_dev_runs_one_of_each_and_production_a_quorum_and_spares():
    dev = {name: w["spec"]["replicas"] for name, w in workloads("dev").items()}
    assert dev == {"atomlog-zookeeper": 1, "atomlog-partition-server": 1,
                   "atomlog-coordinator": 1, "atomlog-id-allocator": 1}
    prod = {name: w["spec"]["replicas"] for name, w in workloads("production").items()}
    assert prod["atomlog-zookeeper"] == 3
    assert prod["atomlog-partition-server"] >= 3
    assert prod["atomlog-coordinator"] >= 2 and prod["atomlog-id-allocator"] >= 2
    for name in ("atomlog-zookeeper", "atomlog-partition-server"):
        def size(overlay):
            template = workloads(overlay)[name]["spec"]["volumeClaimTemplates"][0]
            quantity = template["spec"]["resources"]["requests"]["storage"]
            return int(quantity.removesuffix("Gi"))
        assert size("dev") < size("production"), "dev has small volumes"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stateful_servers_are_statefulsets_with_headless_services_and_volumes(overlay):
    services = objects(overlay, "Service")
    for name in ("atomlog-zookeeper", "atomlog-partition-server"):
        workload = objects(overlay, "StatefulSet")[name]
        spec = workload["spec"]
        service = services[spec["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert selects(service["spec"]["selector"], pod_labels(workload))
        assert selects(spec["selector"], pod_labels(workload))
        claims = spec["volumeClaimTemplates"]
        assert [c["metadata"]["name"] for c in claims] == ["data"]
        assert claims[0]["spec"]["accessModes"] == ["ReadWriteOnce"]
        mounts = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
        assert "data" in mounts
        assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain",
                                                                "whenScaled": "Retain"}
    for name in ("atomlog-coordinator", "atomlog-id-allocator"):
        deployment = objects(overlay, "Deployment")[name]
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_workload_has_a_disruption_budget_that_allows_a_drain(overlay):
    budgets = objects(overlay, "PodDisruptionBudget").values()
    for name, workload in workloads(overlay).items():
        mine = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(workload))]
        assert len(mine) == 1, f"{name}: one PodDisruptionBudget"
        spec = mine[0]["spec"]
        assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        others = [w for n, w in workloads(overlay).items() if n != name]
        assert not any(selects(spec["selector"], pod_labels(w)) for w in others)
    zookeeper = workloads(overlay)["atomlog-zookeeper"]["spec"]["replicas"]
    if zookeeper > 1:  # a drain never takes the ensemble below its quorum
        assert zookeeper - 1 >= zookeeper // 2 + 1


# ---------------------------------------------------------------- probes and shutdown
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_atomlog_pods_probe_the_grpc_health_service_and_drain_on_sigterm(overlay, tmp_path):
    roles = atomlog_workloads(overlay)
    assert set(roles) == set(ROLES)
    for role, workload in roles.items():
        c = container(workload)
        config = server_config(overlay, role, tmp_path)
        grpc_port = int(config["server.listen"].rsplit(":", 1)[1])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == grpc_port
        assert ports["metrics"] == int(config["server.metrics_listen"].rsplit(":", 1)[1])
        assert config["server.listen"].startswith("0.0.0.0:"), "probes and peers reach the pod IP"
        if role == "partition-server":  # followers reach their leaders' replication links
            assert config["replication.link_listen"].startswith("0.0.0.0:")
            assert ports["replication"] == int(config["replication.link_listen"].rsplit(":", 1)[1])
        if role == "coordinator":  # clients' commits on the coordinator's link
            assert config["coordinator.link_listen"].startswith("0.0.0.0:")
            assert ports["link"] == int(config["coordinator.link_listen"].rsplit(":", 1)[1])
        # With TLS the probes ask the plaintext health-only port (kubelet speaks no TLS).
        probe_port = (int(config["server.health_listen"].rsplit(":", 1)[1])
                      if config["tls.enabled"] else grpc_port)
        assert not config["tls.enabled"] or ports["health"] == probe_port
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            # Native gRPC probe of the standard health service: overall status (""), but
            # a partition server is ready once caught up (its replicas back in their ISRs).
            service = "atomlog.caught_up" if (kind, role) == ("readinessProbe",
                                                               "partition-server") else ""
            assert probe["grpc"]["port"] == probe_port and \
                probe["grpc"].get("service", "") == service, (role, kind)
            assert set(probe) & {"exec", "httpGet", "tcpSocket"} == set()
        ready = c["readinessProbe"]
        # NOT_SERVING (from SIGTERM on) takes the pod out of Services within 15 s.
        assert ready["periodSeconds"] * ready["failureThreshold"] <= 15
        live, start = c["livenessProbe"], c["startupProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 60, "no restart on a hiccup"
        # Start-up may wait out the previous session of the same name (x 1.5 + 2 s, as
        # services/runtime.py registers), then recover.
        session_s = config["zookeeper.session_timeout_ms"] / 1000
        assert start["periodSeconds"] * start["failureThreshold"] >= session_s * 1.5 + 2 + 60
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop >= 5
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        drain = config["server.shutdown_grace_ms"] / 1000
        # preStop, then SIGTERM: NOT_SERVING, unregister (<= 2 s), drain, stop hooks.
        assert grace >= pre_stop + drain + 2 + 10, (role, grace, pre_stop, drain)


def test_zookeeper_pods_probe_quorum_membership():
    for overlay in OVERLAYS:
        c = container(workloads(overlay)["atomlog-zookeeper"])
        assert "srvr" in c["readinessProbe"]["exec"]["command"][-1]
        assert "ruok" in c["livenessProbe"]["exec"]["command"][-1]


# ---------------------------------------------------------------- settings the servers read
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servers_accept_the_settings_and_environment_the_manifests_give(overlay, tmp_path):
    roles = atomlog_workloads(overlay)
    namespace = roles["partition-server"]["metadata"]["namespace"]
    zookeeper = workloads(overlay)["atomlog-zookeeper"]
    zk_service = zookeeper["spec"]["serviceName"]
    ensemble = ",".join(f"atomlog-zookeeper-{i}.{zk_service}:2181"
                        for i in range(zookeeper["spec"]["replicas"]))
    for role, workload in roles.items():
        config = server_config(overlay, role, tmp_path, ordinal=1)
        pod = pod_env(overlay, workload, ordinal=1)
        assert config["zookeeper.hosts"] == ensemble
        assert config.sources["zookeeper.hosts"] == "ATOMLOG_ZOOKEEPER_HOSTS"
        assert config["server.name"] == pod["POD_NAME"], "the server's name is the pod's"
        assert config.sources["server.advertised_host"] == "ATOMLOG_SERVER_ADVERTISED_HOST"
        if workload["kind"] == "StatefulSet":
            service = workload["spec"]["serviceName"]
            assert config["server.advertised_host"] == (
                f"atomlog-partition-server-1.{service}.{namespace}.svc.cluster.local")
            assert config["server.data_dir"] == next(
                m["mountPath"] for m in container(workload)["volumeMounts"] if m["name"] == "data")
            # Replicas spread over zones: the pod's zone label is the server's rack.
            assert config["server.rack"] == "zone-1"
            assert config.sources["server.rack"] == "ATOMLOG_SERVER_RACK"
        else:
            assert config["server.advertised_host"] == "10.1.2.3"
        if role == "coordinator":  # __txn_log waits for every partition server
            assert config["coordinator.expected_partition_servers"] == \
                roles["partition-server"]["spec"]["replicas"]
    # The coordinators' ZooKeeper session fits what zoo.cfg lets ZooKeeper grant.
    tick = int(re.search(r"^tickTime=(\d+)$", zoo_cfg(overlay), re.M).group(1))
    coordinator = server_config(overlay, "coordinator", tmp_path)
    assert 2 * tick <= coordinator["coordinator.zookeeper_session_timeout_ms"] <= 20 * tick
    partition = server_config(overlay, "partition-server", tmp_path)
    assert partition["partition.late_transaction_ms"] == coordinator["transaction.max_timeout_ms"]


def zoo_cfg(overlay: str) -> str:
    return mounted_file(overlay, workloads(overlay)["atomlog-zookeeper"], "/etc/zookeeper/zoo.cfg")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_zoo_cfg_lists_one_server_per_pod_with_the_id_the_pod_writes(overlay):
    zookeeper = workloads(overlay)["atomlog-zookeeper"]
    servers = dict(re.findall(r"^server\.(\d+)=(\S+)$", zoo_cfg(overlay), re.M))
    service = zookeeper["spec"]["serviceName"]
    assert servers == {str(i + 1): f"atomlog-zookeeper-{i}.{service}:2888:3888;2181"
                       for i in range(zookeeper["spec"]["replicas"])}
    c = container(zookeeper)
    heap = int(next(e["value"] for e in c["env"] if e["name"] == "ZK_SERVER_HEAP"))
    limit = c["resources"]["limits"]["memory"]
    limit_mib = int(limit[:-2]) * (1024 if limit.endswith("Gi") else 1)
    assert heap <= limit_mib * 0.6, "heap leaves room for the JVM's other memory"


# ---------------------------------------------------------------- security and placement
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_meet_the_restricted_pod_security_standard(overlay):
    namespace = next(iter(objects(overlay, "Namespace").values()))
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, workload in workloads(overlay).items():
        spec = workload["spec"]["template"]["spec"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0 and pod["runAsGroup"] > 0
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False, f"{name}: no ATOMLOG_*_PORT variables"
        assert "hostNetwork" not in spec and "hostPID" not in spec
        c = container(workload)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts, "a writable /tmp on a read-only root"
        resources = c["resources"]
        for key in ("cpu", "memory"):
            assert resources["requests"][key] and resources["limits"][key], (name, key)
        assert c["image"].split(":")[-1] not in ("", "latest")


def test_the_atomlog_image_tag_is_the_project_version():
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    for overlay in OVERLAYS:
        for workload in atomlog_workloads(overlay).values():
            assert container(workload)["image"] == f"atomlog:{version}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_spread_over_nodes_and_zones(overlay):
    for name, workload in workloads(overlay).items():
        spec = workload["spec"]["template"]["spec"]
        anti = spec["affinity"]["podAntiAffinity"]
        terms = (anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
                 + [t["podAffinityTerm"] for t in
                    anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])])
        assert any(t["topologyKey"] == "kubernetes.io/hostname"
                   and selects(t["labelSelector"], pod_labels(workload)) for t in terms), name
        if overlay == "production" and workload["kind"] == "StatefulSet":
            required = anti["requiredDuringSchedulingIgnoredDuringExecution"]
            assert [t["topologyKey"] for t in required] == ["kubernetes.io/hostname"], name
        spread = spec["topologySpreadConstraints"]
        assert any(s["topologyKey"] == "topology.kubernetes.io/zone" and s["maxSkew"] == 1
                   and selects(s["labelSelector"], pod_labels(workload)) for s in spread), name


# ---------------------------------------------------------------- network
def allowed(overlay: str, source: dict, target: dict, port: int) -> bool:
    """Would the overlay's NetworkPolicies let a pod labelled `source` open a TCP
    connection to port `port` of a pod labelled `target` (same namespace)? Egress of the
    source and ingress of the target must both allow it (named ports resolved on the
    target's container)."""
    target_ports = {}
    for workload in workloads(overlay).values():
        if selects(workload["spec"]["selector"], target):
            target_ports = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}

    def port_matches(rule_ports) -> bool:
        if not rule_ports:
            return True
        return any(target_ports.get(p["port"], p["port"]) == port
                   and p.get("protocol", "TCP") == "TCP" for p in rule_ports)

    def peer_matches(peers, labels) -> bool:
        if not peers:
            return True
        return any(("podSelector" in peer and selects(peer["podSelector"], labels))
                   or ("podSelector" not in peer and "namespaceSelector" in peer
                       and not peer["namespaceSelector"]) for peer in peers)

    def direction(kind: str, pod: dict, other: dict, peers_key: str) -> bool:
        policies = [p for p in objects(overlay, "NetworkPolicy").values()
                    if selects(p["spec"]["podSelector"], pod) and kind in p["spec"]["policyTypes"]]
        if not policies:
            return True
        rules = [r for p in policies for r in p["spec"].get(kind.lower(), [])]
        return any(peer_matches(r.get(peers_key), other) and port_matches(r.get("ports"))
                   for r in rules)

    return (direction("Egress", source, target, "to")
            and direction("Ingress", target, source, "from"))


def test_network_policies_allow_exactly_the_paths_atomlog_uses():
    overlay = "production"
    roles = {role: pod_labels(w) for role, w in atomlog_workloads(overlay).items()}
    zookeeper = pod_labels(workloads(overlay)["atomlog-zookeeper"])
    client = {"app": "spark-job", "atomlog.io/client": "true"}
    stranger = {"app": "something-else"}
    for source in roles.values():
        assert allowed(overlay, source, zookeeper, 2181)
        for target in roles.values():  # markers, verification, TC-log appends, id blocks
            assert allowed(overlay, source, target, 7070)
    for target in roles.values():
        assert allowed(overlay, client, target, 7070)
        assert not allowed(overlay, stranger, target, 7070)
        assert not allowed(overlay, client, target, 9102), "metrics only from monitoring"
    assert allowed(overlay, zookeeper, zookeeper, 2888) and allowed(overlay, zookeeper, zookeeper, 3888)
    # The partition servers' link: followers copy from their leaders, coordinators stage,
    # append and send markers, clients produce, fetch and receive (the SDK's and the Go
    # client's default: refused, each connection waited out its connect timeout);
    # nobody else reaches it.
    partition_server = roles["partition-server"]
    assert allowed(overlay, partition_server, partition_server, 7072)
    assert allowed(overlay, roles["coordinator"], partition_server, 7072)
    assert allowed(overlay, client, partition_server, 7072)
    for source in (roles["id-allocator"], stranger):
        assert not allowed(overlay, source, partition_server, 7072), source
    # The coordinators' link: clients' transaction calls and partition servers'
    # verifications; no stranger, and no id allocator, reaches it.
    assert allowed(overlay, client, roles["coordinator"], 7072)
    assert allowed(overlay, partition_server, roles["coordinator"], 7072)
    for source in (roles["id-allocator"], stranger):
        assert not allowed(overlay, source, roles["coordinator"], 7072), source
    assert not allowed(overlay, client, zookeeper, 2181)
    assert not allowed(overlay, roles["coordinator"], zookeeper, 2888)
    # DNS is open to every pod (kube-dns or a node-local cache).
    rules = [r for p in objects(overlay, "NetworkPolicy").values() for r in p["spec"]["egress"]]
    assert sum(1 for r in rules if "to" not in r and {53} == {p["port"] for p in r["ports"]}) == 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_client_service_reaches_every_server_role(overlay):
    service = objects(overlay, "Service")["atomlog"]
    assert service["spec"]["type"] == "ClusterIP"
    port = service["spec"]["ports"][0]
    for workload in atomlog_workloads(overlay).values():
        assert selects(service["spec"]["selector"], pod_labels(workload))
        assert port["targetPort"] in {p["name"] for p in container(workload)["ports"]}
    assert not selects(service["spec"]["selector"],
                       pod_labels(workloads(overlay)["atomlog-zookeeper"]))


# ---------------------------------------------------------------- ZooKeeper for real
def test_a_real_zookeeper_runs_the_dev_zoo_cfg_and_answers_the_probes(tmp_path):
    """The dev overlay's zoo.cfg and the container's start command (myid) run on the
    Debian ZooKeeper; the readiness and liveness probe commands, run by bash as the
    kubelet would, fail before it listens and pass once it serves."""
    zookeeper = workloads("dev")["atomlog-zookeeper"]
    c = container(zookeeper)
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    local = lambda text: (text.replace("/data", str(data))  # noqa: E731
                          .replace(";2181", f";127.0.0.1:{port}").replace("2181", str(port))
                          .replace("atomlog-zookeeper-0.atomlog-zookeeper-headless", "127.0.0.1"))
    cfg = tmp_path / "zoo.cfg"
    cfg.write_text(local(zoo_cfg("dev")).replace("2888:3888", f"{free_port()}:{free_port()}"))
    start = c["command"][-1]
    myid_part, run_part = start.split(" && exec ")
    assert run_part == "zkServer.sh start-foreground /etc/zookeeper/zoo.cfg"
    subprocess.run(["bash", "-c", local(myid_part)], check=True,
                   env={**os.environ, "HOSTNAME": "atomlog-zookeeper-0"})
    assert (data / "myid").read_text().strip() == "1"
    ready = ["bash", "-c", local(c["readinessProbe"]["exec"]["command"][-1])]
    alive = ["bash", "-c", local(c["livenessProbe"]["exec"]["command"][-1])]

    def probe(command: list[str], timeout_s: float) -> bool:
        """Passes, as the kubelet judges it: exit 0 within the probe's timeoutSeconds."""
        try:
            return subprocess.run(command, capture_output=True, timeout=timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    ready_timeout = c["readinessProbe"]["timeoutSeconds"]
    assert not probe(ready, ready_timeout)
    java = localzk.check_installed()
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "log4j.properties").write_text(localzk.LOG4J)
    with open(tmp_path / "zookeeper.log", "wb") as log:
        server = subprocess.Popen([java, "-Xmx128m", "-XX:+UseSerialGC", "-cp",
                                   f"{conf}:{localzk.ZOOKEEPER_JAR}", localzk.MAIN_CLASS, str(cfg)],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not probe(ready, ready_timeout):
            assert server.poll() is None, (tmp_path / "zookeeper.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "ZooKeeper never became ready"
            time.sleep(0.2)
        assert probe(alive, c["livenessProbe"]["timeoutSeconds"])
        assert localzk.four_letter(f"127.0.0.1:{port}", "srvr").count("Mode: standalone") == 1
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_production_runs_mtls_acls_and_zookeeper_acls_from_secrets(tmp_path):
    """docs/security.md#kubernetes: every server serves mutual TLS, authenticates by
    certificate, authorizes with ACLs and holds the ZooKeeper digest, all from Secrets
    mounted read-only (no Secret is in the repository); dev stays plaintext."""
    assert not objects("production", "Secret") and not objects("dev", "Secret")
    for role, workload in atomlog_workloads("production").items():
        config = server_config("production", role, tmp_path)
        assert config["tls.enabled"] and config["tls.client_auth"] == "require"
        assert config["auth.mode"] == "mtls" and config["auth.authorizer"] == "acl"
        assert config["auth.super_users"] == "ops-admin"
        assert config["auth.service_principals"] == config["tls.server_name"] == "atomlog-server"
        assert config["zookeeper.digest_file"].endswith("/atomlog-zookeeper-digest/digest")
        mounts = secret_mounts(workload)
        assert sorted(mounts.values()) == ["atomlog-tls", "atomlog-zookeeper-digest"]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        for mount in container(workload)["volumeMounts"]:
            if mount["mountPath"] in mounts:
                assert mount["readOnly"]
                assert volumes[mount["name"]]["secret"]["defaultMode"] == 0o400
    for role in atomlog_workloads("dev"):
        config = server_config("dev", role, tmp_path)
        assert not config["tls.enabled"] and config["auth.authorizer"] == "none"
