#!/usr/bin/env bash
# The main job: set up what is missing, bring up the local cluster (ZooKeeper, an id
# allocator, two coordinators, three partition servers), write and read back a topic,
# and show the cluster's status.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
atomlog up "$@"
atomlog topic create demo --partitions 6 >/dev/null 2>&1 || true  # exists after the first run
atomlog topic describe demo
seq 1 1000 | sed 's/^/record /' | atomlog produce demo
atomlog consume demo --max-messages 5 --idle-timeout 10
atomlog status
