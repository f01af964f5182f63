#!/usr/bin/env bash
# The main job: set up what is missing, bring up the local cluster (ZooKeeper, an id
# allocator, two coordinators, three partition servers) and show its status.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
atomlog up "$@"
atomlog topic create demo --partitions 6 >/dev/null 2>&1 || true  # exists after the first run
atomlog topic describe demo
atomlog status
