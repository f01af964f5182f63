#!/usr/bin/env bash
# The main job: set up what is missing, bring up the local cluster (ZooKeeper, an id
# allocator, two coordinators, three partition servers) if it is not running, then run
# the exactly-once pipeline: seed an input topic, run a Spark Structured Streaming
# consume-transform-produce job over atomlog, kill it with SIGKILL mid-run, restart it
# from its checkpoint, and verify that the output equals the transformed input exactly
# once. Arguments go to `atomlog up`; PIPELINE_RECORDS sets the input size.
# ATOMLOG_TLS=1 runs it secured: a cluster of its own (ATOMLOG_DATA_DIR, default
# .atomlog/secured) made by `atomlog up --tls` (mTLS, auth.mode=mtls, ACLs, ZooKeeper
# digest); the pipeline connects with that cluster's admin client certificate.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
up_args=()
if [[ "${ATOMLOG_TLS:-0}" == 1 ]]; then
  export ATOMLOG_DATA_DIR="${ATOMLOG_DATA_DIR:-.atomlog/secured}"
  up_args+=(--tls)
fi
atomlog up ${up_args[@]+"${up_args[@]}"} "$@"
python -m spark_client.pipeline demo --records "${PIPELINE_RECORDS:-20000}"
atomlog status
