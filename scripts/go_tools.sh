#!/usr/bin/env bash
# The Go toolchain and the pinned Go tools of the Go client (clients/go): protoc-gen-go,
# protoc-gen-go-grpc (for `buf generate`) and grpcurl (runs the examples of
# docs/clients.md). Idempotent: the second run finds everything and only prints it.
#
#   bash scripts/go_tools.sh            # prints GO=<go binary> and GO_TOOLS_BIN=<dir>
#   bash scripts/go_tools.sh generate [OUT]
#                                       # clients/go/gen from protos/ (buf generate) and
#                                       # clients/go/atomlog/reasons_gen.go from
#                                       # docs/errors.md (or the same paths under OUT)
#
# Go: $GO, else `go` on PATH, else /usr/local/go/bin/go, else Go $GO_VERSION downloaded
# once from the Go module proxy (the golang.org/toolchain module, the same zip `go`
# itself fetches for GOTOOLCHAIN) into ~/.cache/atomlog/go-$GO_VERSION, checked against
# the SHA-256 below. Tools: built from clients/go/tools/go.mod (versions pinned there and
# in its go.sum) into ~/.cache/atomlog/go-tools/<hash of go.mod, go.sum and go version>/.
# Go's own module and build caches (~/go/pkg/mod, ~/.cache/go-build) hold the rest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ATOMLOG_CACHE:-$HOME/.cache/atomlog}"
GO_VERSION=1.26.8
declare -A GO_ZIP_SHA256=(
  [linux-amd64]=30c2b1bf7dcc88d3eb0a1364e47ddd9128edb3110a30e8a0ef61cd5856b31de7
  [linux-arm64]=02b36b6787b3ac767668f630e2998df45a3b1f9ffee08d1bf3ef6487cd658d99
)
TOOLS=(protoc-gen-go protoc-gen-go-grpc grpcurl)

say() { printf '\033[1m[go tools]\033[0m %s\n' "$*" >&2; }
mkdir -p "$CACHE/go-tools"

find_go() {
  local candidate candidates=("${GO:-}" "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go
                              "$CACHE/go-$GO_VERSION/bin/go")
  # ATOMLOG_GO_DOWNLOAD=1 ignores installed Go (to try the download on a machine that has Go).
  [ "${ATOMLOG_GO_DOWNLOAD:-}" = 1 ] && candidates=("$CACHE/go-$GO_VERSION/bin/go")
  for candidate in "${candidates[@]}"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && go_is_new_enough "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

go_is_new_enough() {  # clients/go/go.mod says go 1.26
  local version
  version="$("$1" env GOVERSION 2>/dev/null)" || return 1
  version="${version#go}"
  [ "$(printf '%s\n' "1.26" "${version%%[-+ ]*}" | sort -V | head -1)" = "1.26" ]
}

download_go() {
  local os arch platform sha proxy url zip target
  os="$(uname -s | tr '[:upper:]' '[:lower:]')"
  case "$(uname -m)" in
    x86_64|amd64) arch=amd64 ;;
    aarch64|arm64) arch=arm64 ;;
    *) say "no Go found and no pinned toolchain for $(uname -m): install Go >= 1.26"; exit 1 ;;
  esac
  platform="$os-$arch"
  sha="${GO_ZIP_SHA256[$platform]:-}"
  if [ -z "$sha" ]; then
    say "no Go found and no pinned toolchain for $platform: install Go >= 1.26"; exit 1
  fi
  proxy="${GOPROXY:-https://proxy.golang.org}"
  proxy="${proxy%%[,|]*}"
  case "$proxy" in http*) ;; *) proxy=https://proxy.golang.org ;; esac
  url="$proxy/golang.org/toolchain/@v/v0.0.1-go$GO_VERSION.$platform.zip"
  target="$CACHE/go-$GO_VERSION"
  zip="$CACHE/go-$GO_VERSION.$platform.zip.part"
  say "no Go >= 1.26 found: downloading Go $GO_VERSION from $url"
  python3 - "$url" "$zip" "$sha" "$target" <<'EOF'
import hashlib, os, shutil, stat, sys, urllib.request, zipfile
url, part, want, target = sys.argv[1:]
with urllib.request.urlopen(url, timeout=300) as reply, open(part, "wb") as out:
    shutil.copyfileobj(reply, out, 1 << 20)
digest = hashlib.sha256(open(part, "rb").read()).hexdigest()
if digest != want:
    os.remove(part)
    sys.exit(f"{url}: SHA-256 {digest}, expected {want}")
staging = target + ".tmp"
shutil.rmtree(staging, ignore_errors=True)
prefix = None
with zipfile.ZipFile(part) as archive:
    for info in archive.infolist():
        name = info.filename
        if prefix is None:  # golang.org/toolchain@v0.0.1-go<version>.<platform>/
            prefix = name[:name.index("/", name.index("@")) + 1]
        if not name.startswith(prefix) or ".." in name.split("/"):
            sys.exit(f"unexpected path in the toolchain zip: {name}")
        path = os.path.join(staging, name[len(prefix):])
        if name.endswith("/"):
            os.makedirs(path, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with archive.open(info) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        # Module zips keep no file modes: the binaries are bin/* and pkg/tool/*/*.
        relative = name[len(prefix):]
        if relative.startswith("bin/") or relative.startswith("pkg/tool/"):
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
os.remove(part)
shutil.rmtree(target, ignore_errors=True)
os.rename(staging, target)
EOF
}

(
  flock 9
  if ! find_go >/dev/null; then
    download_go
  fi
) 9>"$CACHE/.go-toolchain.lock"
GO_BIN="$(find_go)" || { say "Go could not be installed"; exit 1; }

tools_dir="$ROOT/clients/go/tools"
stamp="$(cat "$tools_dir/go.mod" "$tools_dir/go.sum" <("$GO_BIN" env GOVERSION GOOS GOARCH) \
         | sha256sum | cut -c1-16)"
TOOLS_BIN="$CACHE/go-tools/$stamp/bin"
(
  flock 9
  missing=0
  for tool in "${TOOLS[@]}"; do
    [ -x "$TOOLS_BIN/$tool" ] || missing=1
  done
  if [ "$missing" = 1 ]; then
    say "building ${TOOLS[*]} (clients/go/tools/go.mod) into $TOOLS_BIN"
    staging="$(mktemp -d "$CACHE/go-tools/.build.XXXXXX")"
    trap 'rm -rf "$staging"' EXIT
    (cd "$tools_dir" && GOBIN="$staging" GOFLAGS="${GOFLAGS:-} -mod=readonly" \
       "$GO_BIN" install tool)
    mkdir -p "$TOOLS_BIN"
    for tool in "${TOOLS[@]}"; do
      mv "$staging/$tool" "$TOOLS_BIN/$tool"
    done
  fi
) 9>"$CACHE/.go-tools.lock"

case "${1:-env}" in
  env)
    echo "GO=$GO_BIN"
    echo "GO_TOOLS_BIN=$TOOLS_BIN"
    ;;
  generate)
    # gen/ from protos/ (buf, with the pinned plugins) and atomlog/reasons_gen.go from
    # docs/errors.md; into OUT (default clients/go itself: what is checked in).
    out="${2:-$ROOT/clients/go}"
    buf="$(command -v buf 2>/dev/null || echo "$ROOT/.venv/bin/buf")"
    cd "$ROOT/clients/go"
    if [ "$out" = "$ROOT/clients/go" ]; then
      rm -rf gen
    fi
    PATH="$TOOLS_BIN:$PATH" "$buf" generate --template buf.gen.yaml -o "$out"
    mkdir -p "$out/atomlog"
    "$GO_BIN" run ./internal/genreasons "$ROOT/docs/errors.md" "$out/atomlog/reasons_gen.go"
    ;;
  *)
    say "usage: $0 [env | generate [OUT]]"; exit 2 ;;
esac
