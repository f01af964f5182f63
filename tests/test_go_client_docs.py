"""Every example of docs/clients.md runs against the suite's cluster, in order, in one
bash session (shell variables carry from one example to the next), with the pinned
grpcurl of scripts/go_tools.sh on PATH and ADDR set to the cluster's bootstrap address.

An example is a ```sh block; the ```json or ```text block right after it, if any, is
its output as the page shows it. JSON outputs are matched by structure: every key shown
must be there with the value shown ("..." matches any value; lists match element by
element), and an output showing a gRPC error ({"code": ...}) must come from a failed
call. Text outputs: every line shown must be a line of the output. The ```python block
that begins with "# mkbatch.py" is written to mkbatch.py in the session's directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from spark_client import Client
from tests.conftest import REPO_ROOT, wait_until
from tests.go_tools import go_tools

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]  # the tools may need building

DOC = REPO_ROOT / "docs" / "clients.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)


@dataclass
class Example:
    script: str
    line: int
    kind: str | None = None  # "json" or "text": the output shown
    output: str = ""


def examples(text: str) -> tuple[list[Example], dict[str, str]]:
    found: list[Example] = []
    files: dict[str, str] = {}
    last_end = None
    for match in BLOCK.finditer(text):
        kind, body = match.group(1), match.group(2)
        line = text.count("\n", 0, match.start()) + 1
        follows = last_end is not None and not text[last_end:match.start()].strip()
        if kind == "sh":
            found.append(Example(body, line))
        elif kind in ("json", "text") and follows and found and found[-1].kind is None:
            found[-1].kind, found[-1].output = kind, body
        elif kind == "python" and body.startswith("# mkbatch.py"):
            files["mkbatch.py"] = body
        last_end = match.end()
    return found, files


def json_documents(text: str) -> list:
    decoder, docs, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        doc, pos = decoder.raw_decode(text, pos)
        docs.append(doc)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return docs


def mismatch(shown, actual, path: str = "$") -> str | None:
    """Where `actual` differs from what the page shows, or None."""
    if shown == "...":
        return None
    if isinstance(shown, dict):
        if not isinstance(actual, dict):
            return f"{path}: {actual!r} is not an object"
        for key, value in shown.items():
            if key not in actual:
                return f"{path}.{key}: missing"
            found = mismatch(value, actual[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(shown, list):
        if not isinstance(actual, list) or len(actual) != len(shown):
            return f"{path}: {actual!r} does not have {len(shown)} elements"
        for i, (a, b) in enumerate(zip(shown, actual)):
            found = mismatch(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if shown == actual else f"{path}: {actual!r}, the page shows {shown!r}"


def test_mismatch_finds_differences():
    assert mismatch({"a": "...", "b": [1, {"c": "x"}]}, {"a": 5, "b": [1, {"c": "x", "d": 2}], "e": 1}) is None
    assert mismatch({"b": [1]}, {"b": [1, 2]})
    assert mismatch({"b": {"c": "x"}}, {"b": {"c": "y"}})
    assert mismatch({"z": 1}, {})


class Shell:
    """One bash process reading commands from a pipe; each example's output goes to a file."""

    def __init__(self, cwd: Path, env: dict):
        self.cwd = cwd
        self.process = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)

    def run(self, number: int, script: str) -> tuple[int, str]:
        path = self.cwd / f"example-{number}.sh"
        out = self.cwd / f"example-{number}.out"
        path.write_text(script)
        self.process.stdin.write(f"source {path} > {out} 2>&1; echo \"__rc__ $?\"\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line.startswith("__rc__ "), f"the shell said {line!r}"
        return int(line.split()[1]), out.read_text()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=10)


def wait_for_settled_leases(bootstrap: str) -> None:
    """Until every TC partition has a coordinator and none holds more than its share
    (coordinators balance their leases for a moment after a start): the page reads the
    owners once per example."""
    client = Client(bootstrap, tune_allocator=False)
    last: list = []

    def settled() -> bool:
        client.metadata.refresh()
        routes = dict(client.metadata.tc_routes)
        owners = [a for a in routes.values() if a]
        share = -(-len(routes) // max(1, len(set(owners))))
        now = [len(owners) == len(routes) and owners.count(a) <= share for a in owners]
        stable = routes == (last[-1] if last else None)
        last.append(routes)
        return all(now) and stable

    try:
        wait_until(settled, 30, "the coordinators' leases to settle")
    finally:
        client.close()


def test_every_example_of_clients_md_runs(cluster, tmp_path):
    wait_for_settled_leases(cluster.info["bootstrap"])
    found = go_tools(1200)
    runnable, files = examples(DOC.read_text())
    assert len(runnable) >= 20 and "mkbatch.py" in files
    assert sum(e.kind is not None for e in runnable) >= 18, "most examples show their output"
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    env = {"PATH": f"{found['GO_TOOLS_BIN']}:{os.environ['PATH']}", "HOME": os.environ["HOME"],
           "ADDR": cluster.info["bootstrap"], "LANG": "C.UTF-8"}
    shell = Shell(tmp_path, env)
    try:
        for number, example in enumerate(runnable):
            where = f"docs/clients.md:{example.line}"
            code, output = shell.run(number, example.script)
            if example.kind == "json":
                shown = json_documents(example.output)
                try:
                    actual = json_documents(output)
                except json.JSONDecodeError:
                    raise AssertionError(f"{where}: the output is not JSON:\n{output}") from None
                failed = any(isinstance(d, dict) and "code" in d for d in shown)
                assert (code != 0) == failed, f"{where}: exit status {code}\n{output}"
                assert len(actual) == len(shown), f"{where}: {len(actual)} answers:\n{output}"
                for doc_shown, doc_actual in zip(shown, actual):
                    problem = mismatch(doc_shown, doc_actual)
                    assert problem is None, f"{where}: {problem}\n{output}"
            else:
                assert code == 0, f"{where}: exit status {code}\n{output}"
                if example.kind == "text":
                    lines = set(output.splitlines())
                    missing = [l for l in example.output.splitlines() if l.strip() and l not in lines]
                    assert not missing, f"{where}: {missing} not in the output:\n{output}"
    finally:
        shell.close()
