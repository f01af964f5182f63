#!/usr/bin/env bash
# The whole test suite: set up what is missing, then run pytest (real ZooKeeper and
# service processes on loopback). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
# Bytecode of the repository's modules, kept outside the tree. With
# PYTHONDONTWRITEBYTECODE=1 (as CI's environment sets it) every server, CLI call and
# workload client the suite starts compiled services/, partition_server/, coordinator/,
# ... again: a cluster start's six servers took 1.9 s of CPU instead of 1.3 s.
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/atomlog/pycache}"
unset PYTHONDONTWRITEBYTECODE
# Two workers (pytest-xdist): the suite waits much of its time (failovers, session
# timeouts, Spark's start-up), and on one worker it used half of this 2-CPU machine
# (measured 2026-11-29: 1,190 s, 54% busy). Each module runs whole on one worker
# (tests/conftest.py, pytest_xdist_make_scheduler). ATOMLOG_TEST_WORKERS=0 runs it in
# this process.
# The suite runs on the native core (partition_server/native.py): a build that is missing
# or stale fails every test at import instead of testing Python in its place. Its tests
# (tests/test_native.py, tests/test_record_batch.py) run the Python reference too.
export ATOMLOG_NATIVE="${ATOMLOG_NATIVE:-require}"
exec python -m pytest -n "${ATOMLOG_TEST_WORKERS:-2}" "$@"
