#!/usr/bin/env bash
# Idempotent set-up shared by scripts/main.sh and scripts/test.sh: installs what is
# missing (Java, ZooKeeper and Prometheus with promtool from Debian packages; kustomize
# built from the Go module proxy into a per-user cache; a virtualenv with atomlog and its
# dependencies; the native core, built with cargo from crates.io, Debian's cargo and rustc
# installed when there is none) and does nothing when everything is already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ATOMLOG_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

say() { printf '\033[1m[atomlog setup]\033[0m %s\n' "$*" >&2; }

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  say "Python >= 3.11 is required (found $("$PYTHON" --version 2>&1))"; exit 1; }

missing=()
command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
[ -f /usr/share/java/zookeeper.jar ] || missing+=(zookeeper)
# Prometheus and promtool: deploy/prometheus rules and the dashboards are checked against
# them (tests/test_deploy_*.py), and `atomlog up --prometheus` runs it.
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
"$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  say "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# kustomize renders deploy/kubernetes (tests/test_deploy_kubernetes.py). Built once per
# machine from the Go module proxy (about 2 minutes on 2 cores), kept under the user's
# cache so fresh clones reuse it; needs Go >= 1.24 (kustomize's go.mod), which this kind
# of machine ships in /usr/local/go. GOTOOLCHAIN=local: never fetch another Go.
KUSTOMIZE_VERSION="v5.8.1"
TOOLS="${ATOMLOG_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/atomlog/tools}"
kustomize_bin="$TOOLS/kustomize-$KUSTOMIZE_VERSION/kustomize"
if [ ! -x "$kustomize_bin" ]; then
  GO="$(command -v go || true)"
  [ -n "$GO" ] || [ ! -x /usr/local/go/bin/go ] || GO=/usr/local/go/bin/go
  if [ -z "$GO" ]; then
    say "kustomize $KUSTOMIZE_VERSION is built with Go >= 1.24, and no go command was found"
    exit 1
  fi
  # In the background, alongside the virtualenv's pip install (the build is CPU, pip
  # mostly I/O); waited for below.
  say "building kustomize $KUSTOMIZE_VERSION into $TOOLS (once per machine)"
  (
    mkdir -p "$TOOLS"
    staging="$(mktemp -d "$TOOLS/.kustomize.XXXXXX")"
    GOBIN="$staging" GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
      "$GO" install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
    mkdir -p "$TOOLS/kustomize-$KUSTOMIZE_VERSION"
    mv "$staging/kustomize" "$kustomize_bin"
    rmdir "$staging"
  ) &
  kustomize_build=$!
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# Reinstall only when what the install reads changed: pyproject.toml without its
# [tool.pytest.ini_options] table (test options are not an install; a change there used to
# cost a pip upgrade and a full `pip install -e` on the next run). A stamp of the whole
# file, as written before, is accepted for the same content.
stamp="$VENV/.atomlog-installed"
want="$(awk '/^\[/ { skip = ($0 == "[tool.pytest.ini_options]") } !skip' "$ROOT/pyproject.toml" \
        | sha256sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$have" = "$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)" ]; then
  echo "$want" > "$stamp"
  have="$want"
fi
if [ "$have" != "$want" ]; then
  say "installing atomlog and its dependencies into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,spark,bench]"
  echo "$want" > "$stamp"
fi
# Spark starts its Python workers with its own pyspark.zip and py4j zip first on
# PYTHONPATH: zipimport compiles every pyspark module from source in every worker (it
# never caches bytecode), 1.1-1.3 s a process, and a micro-batch's planning and tasks
# start a dozen. This .pth (run by site.py at each start of the virtualenv's Python)
# moves those two zips behind site-packages, whose pyspark and py4j are the same
# versions with their bytecode cached: a streaming query's first micro-batch took 16.6
# s instead of 24.9 s (docs/benchmarks.md, "Spark's Python workers"). Only processes
# with those zips on their path change.
site_packages="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cmp -s "$ROOT/scripts/atomlog-spark-workers.pth" "$site_packages/atomlog-spark-workers.pth" \
  || cp "$ROOT/scripts/atomlog-spark-workers.pth" "$site_packages/atomlog-spark-workers.pth"
# atomlog's native core (partition_server/rust): built when its sources changed since the
# last build, with Debian's cargo and rustc installed first when no cargo is found.
PYTHON="$VENV/bin/python" bash "$ROOT/scripts/build_native.sh"
if [ -n "${kustomize_build:-}" ]; then
  wait "$kustomize_build" || { say "building kustomize $KUSTOMIZE_VERSION failed"; exit 1; }
  unset kustomize_build
fi
mkdir -p "$TOOLS/bin"
[ "$(readlink "$TOOLS/bin/kustomize" 2>/dev/null)" = "$kustomize_bin" ] || ln -sfn "$kustomize_bin" "$TOOLS/bin/kustomize"
export PATH="$VENV/bin:$TOOLS/bin:$PATH"
