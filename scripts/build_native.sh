#!/usr/bin/env bash
# Builds atomlog's native core (the Rust crate in partition_server/rust) into
# partition_server/_native.abi3.so, with the SHA-256 of the sources it was built from
# compiled in (partition_server/native.py uses a module only when it matches the sources
# beside it). Does nothing when it already does. Installs Debian's cargo and rustc when
# no cargo is found. scripts/bootstrap.sh runs it; run it by hand after editing the crate.
# The crates come from crates.io at the versions Cargo.lock pins; cargo's build
# directory is kept outside the tree, per user (~/.cache/atomlog/native-target).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-${VENV:-$ROOT/.venv}/bin/python}"
CRATE="$ROOT/partition_server/rust"
MODULE="$ROOT/partition_server/_native.abi3.so"

say() { printf '\033[1m[atomlog native]\033[0m %s\n' "$*" >&2; }

# The digest of this tree's crate, and whether this tree's module was built from it: both
# by path, as the interpreter may import partition_server from another checkout (an
# editable install's).
digest() {
  (cd "$ROOT" && ATOMLOG_NATIVE=off "$PYTHON" - "$@" <<'PY'
import importlib.util, pathlib, sys
from partition_server.native import sources_digest
want = sources_digest(pathlib.Path(sys.argv[1]))
if len(sys.argv) > 2:  # the module's: exit 0 when it matches
    spec = importlib.util.spec_from_file_location("_native", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.exit(0 if getattr(module, "SOURCES_DIGEST", "") == want else 1)
print(want)
PY
  )
}
if [ -f "$MODULE" ] && digest "$CRATE" "$MODULE" >/dev/null 2>&1; then
  exit 0  # built, and from these sources
fi
want="$(digest "$CRATE")"

[ -d "$HOME/.cargo/bin" ] && export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  say "installing Debian packages: cargo rustc"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    cargo rustc >/dev/null
fi

# crates.io's sparse index (plain HTTPS to index.crates.io). Cargo 1.68 and later use it
# by default; Debian 12's cargo (1.65) has it behind an unstable flag, and its default
# index is a git clone from GitHub, which a machine that reaches only the package
# registries cannot make.
cargo_minor="$(cargo --version | sed -E 's/^cargo 1\.([0-9]+).*/\1/')"
if [ "$cargo_minor" -lt 68 ] 2>/dev/null; then
  export CARGO_REGISTRIES_CRATES_IO_PROTOCOL=sparse CARGO_UNSTABLE_SPARSE_REGISTRY=true
  export __CARGO_TEST_CHANNEL_OVERRIDE_DO_NOT_USE_THIS=nightly
fi

say "building the native core ($(rustc --version))"
export CARGO_TARGET_DIR="${ATOMLOG_NATIVE_TARGET:-${XDG_CACHE_HOME:-$HOME/.cache}/atomlog/native-target}"
# PyO3 reads the interpreter's version and ABI from PYO3_PYTHON (abi3: >= 3.11).
# ATOMLOG_NATIVE_SOURCES: the digest compiled into the module (a change builds again).
ATOMLOG_NATIVE_SOURCES="$want" PYO3_PYTHON="$PYTHON" \
  cargo build --quiet --release --locked --manifest-path "$CRATE/Cargo.toml"
# Written beside, then renamed: a process importing the module meanwhile sees the old
# file or the new one, never half of one. (The module carries its digest, so a build of
# another checkout sharing the target directory would be refused, not taken.)
staged="$(mktemp "$MODULE.XXXXXX")"
cp "$CARGO_TARGET_DIR/release/lib_native.so" "$staged"
chmod 0755 "$staged"
mv -f "$staged" "$MODULE"
say "built $MODULE"
