#!/usr/bin/env bash
# Builds atomlog's native core (the Rust crate in partition_server/rust) into
# partition_server/_native.abi3.so, with the SHA-256 of the sources it was built from in
# partition_server/_native.sources (partition_server/native.py uses a module only when the
# two agree). Does nothing when they already do. Installs Debian's cargo and rustc when
# no cargo is found. scripts/bootstrap.sh runs it; run it by hand after editing the crate.
# The crates come from crates.io at the versions Cargo.lock pins; cargo's build
# directory is kept outside the tree, per user (~/.cache/atomlog/native-target).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-${VENV:-$ROOT/.venv}/bin/python}"
CRATE="$ROOT/partition_server/rust"
MODULE="$ROOT/partition_server/_native.abi3.so"
STAMP="$ROOT/partition_server/_native.sources"

say() { printf '\033[1m[atomlog native]\033[0m %s\n' "$*" >&2; }

want="$(cd "$ROOT" && ATOMLOG_NATIVE=off "$PYTHON" -c 'from partition_server.native import sources_digest; print(sources_digest())')"
if [ -f "$MODULE" ] && [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
  exit 0
fi

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
PYO3_PYTHON="$PYTHON" cargo build --quiet --release --locked --manifest-path "$CRATE/Cargo.toml"
# Written beside, then renamed: a process importing the module meanwhile sees the old
# file or the new one, never half of one.
cp "$CARGO_TARGET_DIR/release/lib_native.so" "$MODULE.tmp"
mv -f "$MODULE.tmp" "$MODULE"
echo "$want" > "$STAMP"
say "built $MODULE"
