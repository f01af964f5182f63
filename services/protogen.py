"""Generate the Python code for atomlog's API from `protos/atomlog/v1/*.proto`.

    python -m services.protogen          # (re)write the generated files
    python -m services.protogen --check  # exit 1 if they differ from the protos

The generated package is `atomlog.v1`; it lives beside its .proto files
(`protos/atomlog/v1/`) and pyproject maps the `atomlog` package to `protos/atomlog`,
so protoc's imports (`from atomlog.v1 import common_pb2`) work unchanged.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = PROTO_ROOT / "atomlog" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PACKAGE_DIR.glob("*.proto"))


def generated_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def generate(output_root: Path) -> None:
    """Run protoc over every proto file, writing under output_root/atomlog/v1."""
    from grpc_tools import protoc  # dev dependency: only needed to generate

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    relative = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        *relative,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def differences() -> list[str]:
    """Names of generated files that are missing, stale or extra."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        fresh_dir = fresh_root / "atomlog" / "v1"
        fresh = {p.name: p for p in generated_files(fresh_dir)}
        current = {p.name: p for p in generated_files(PACKAGE_DIR)}
        problems = [f"missing: {n}" for n in sorted(fresh.keys() - current.keys())]
        problems += [f"extra (no proto): {n}" for n in sorted(current.keys() - fresh.keys())]
        for name in sorted(fresh.keys() & current.keys()):
            if not filecmp.cmp(fresh[name], current[name], shallow=False):
                problems.append(f"stale: {name}")
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.protogen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="only compare; exit 1 when generated code is out of date")
    args = parser.parse_args(argv)
    if args.check:
        problems = differences()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated code is out of date: run `python -m services.protogen`",
                  file=sys.stderr)
            return 1
        print(f"generated code matches {len(proto_files())} proto files")
        return 0
    for stale in generated_files(PACKAGE_DIR):
        stale.unlink()
    generate(PROTO_ROOT)
    print(f"generated {len(generated_files(PACKAGE_DIR))} files in {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
