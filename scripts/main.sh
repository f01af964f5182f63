#!/usr/bin/env bash
# The main job: set up what is missing, bring up the local cluster (ZooKeeper, an id
# allocator, two coordinators, three partition servers) if it is not running, then run
# the exactly-once pipeline: seed an input topic, run a Spark Structured Streaming
# consume-transform-produce job over atomlog, kill it with SIGKILL mid-run, restart it
# from its checkpoint, and verify that the output equals the transformed input exactly
# once. Arguments go to `atomlog up`; PIPELINE_RECORDS sets the input size.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
atomlog up "$@"
python -m spark_client.pipeline demo --records "${PIPELINE_RECORDS:-20000}"
atomlog status
