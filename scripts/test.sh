#!/usr/bin/env bash
# The whole test suite: set up what is missing, then run pytest (real ZooKeeper and
# service processes on loopback). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
exec python -m pytest "$@"
