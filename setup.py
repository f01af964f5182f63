"""The wheel's tag, nothing else (the project is described in pyproject.toml).

A wheel built where the native core was built (scripts/build_native.sh, as the image's
build stage does) carries partition_server/_native.abi3.so, a module for this platform
and CPython's stable ABI from 3.11. Such a wheel is tagged cp311-abi3-<platform>, so pip
installs it only where that module loads. Without the module the wheel is pure Python,
py3-none-any, and runs everywhere on the Python core (docs/native-core.md)."""

from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution

NATIVE = (Path(__file__).resolve().parent / "partition_server" / "_native.abi3.so").exists()


class _Distribution(Distribution):
    def has_ext_modules(self) -> bool:  # a platform wheel when it carries the module
        return NATIVE


setup(distclass=_Distribution,
      options={"bdist_wheel": {"py_limited_api": "cp311"}} if NATIVE else {})
