#!/usr/bin/env bash
# Idempotent set-up shared by scripts/main.sh and scripts/test.sh: installs what is
# missing (Java and ZooKeeper from Debian packages, a virtualenv with atomlog and its
# dependencies) and does nothing when everything is already there.
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
"$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  say "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# Reinstall only when the dependency list changed.
stamp="$VENV/.atomlog-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing atomlog and its dependencies into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,spark,bench]"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
