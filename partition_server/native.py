"""Loads atomlog's native core: `partition_server._native`, built from the Rust crate in
partition_server/rust/ by scripts/build_native.sh (which scripts/bootstrap.sh runs).

The native functions are faster copies of pure functions of record_batch.py (and the
cells of services/fastmetrics.py's metrics), whose Python versions stay the reference:
tests/test_native.py holds each pair to the same answers and errors (docs/native-core.md).
Which core a process runs is told by `status()`.

ATOMLOG_NATIVE chooses, for the whole process:
- `auto` (the default): the native core when it is built and current, else the Python
  functions, with the reason in `status()`;
- `require`: the native core, or an ImportError saying why not (scripts/test.sh sets it,
  so the suite never tests Python in its place by mistake; the benchmarks name the core
  in their machine line);
- `off`: the Python functions.

"Current": in a source checkout, the module was built from the crate's files as they are
now (scripts/build_native.sh compiles their SHA-256 into it, as SOURCES_DIGEST); a module
built from other sources is not used, since its answers may no longer be the reference's.
An installed wheel has no crate beside it and is taken as built.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

MODES = ("auto", "require", "off")
HERE = Path(__file__).resolve().parent
CRATE = HERE / "rust"


def sources_digest(crate: Path | None = None) -> str:
    """SHA-256 of the crate's (default: CRATE) Cargo.toml, Cargo.lock and src/ files (names
    and bytes), as scripts/build_native.sh has it compiled into the module."""
    crate = CRATE if crate is None else crate
    digest = hashlib.sha256()
    files = [crate / "Cargo.toml", crate / "Cargo.lock", *sorted((crate / "src").rglob("*.rs"))]
    for path in files:
        digest.update(path.relative_to(crate).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _stale(module: ModuleType) -> str | None:
    """Why the built module is not current, or None."""
    if not (CRATE / "Cargo.toml").exists():
        return None  # an installed wheel: built with it
    try:
        current = sources_digest()
    except OSError as error:
        return f"the crate's sources cannot be read ({error})"
    if getattr(module, "SOURCES_DIGEST", "") != current:
        return ("it was built from other sources of partition_server/rust "
                "(run scripts/build_native.sh)")
    return None


def _load() -> tuple[ModuleType | None, str]:
    mode = os.environ.get("ATOMLOG_NATIVE", "auto")
    if mode not in MODES:
        raise RuntimeError(f"ATOMLOG_NATIVE={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return None, "python (ATOMLOG_NATIVE=off)"
    why = None
    try:
        from partition_server import _native
    except ImportError as error:
        why = f"the native core is not built ({error}; run scripts/build_native.sh)"
    else:
        stale = _stale(_native)
        if stale is None:
            return _native, "native"
        why = f"the native core is not current: {stale}"
    if mode == "require":
        raise ImportError(f"ATOMLOG_NATIVE=require: {why}")
    return None, f"python ({why})"


core, _status = _load()


def status() -> str:
    """"native", or "python (why)"."""
    return _status
