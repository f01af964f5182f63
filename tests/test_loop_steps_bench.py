"""bench/loop_steps/sitecustomize.py, the event-loop step counter behind
`bench/transactions.py --loop-steps`: a process that carries it (`serve` among its
arguments, its folder in ATOMLOG_BENCH_LOOP_STEPS, first on PYTHONPATH) announces itself,
counts each callback under the task or callback that ran from the SIGUSR1 on, and
writes the counts on SIGUSR2; the benchmark reads them per transaction. A process
without it is never signalled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import transactions as tb  # noqa: E402

# Four rounds: a task that sleeps, then one that awaits a future a callback sets.
SCRIPT = """
import asyncio, os, signal, sys

async def napper():
    await asyncio.sleep(0)

async def waiter(future):
    await future

async def main():
    await asyncio.sleep(0)
    os.kill(os.getpid(), signal.SIGUSR1)  # the window opens
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    for _ in range(4):
        await asyncio.create_task(napper())
        future = loop.create_future()
        loop.call_soon(future.set_result, None)
        await asyncio.create_task(waiter(future))
    os.kill(os.getpid(), signal.SIGUSR2)
    await asyncio.sleep(0.05)

asyncio.run(main())
print("carried", os.path.exists(os.path.join(os.environ["ATOMLOG_BENCH_LOOP_STEPS"],
                                             f"ready-{os.getpid()}")))
"""


def run(tmp_path: Path, *argv: str, calls: bool = False) -> tuple[str, int]:
    env = {**os.environ, "ATOMLOG_BENCH_LOOP_STEPS": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "loop_steps"), str(ROOT)])}
    env.pop(tb.COUNT_CALLS_ENV, None)
    if calls:
        env[tb.COUNT_CALLS_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT, *argv], env=env, text=True,
                          capture_output=True, timeout=60)
    return done.stdout + done.stderr, done.returncode


def test_a_server_counts_its_callbacks_by_task_between_the_signals(tmp_path):
    output, code = run(tmp_path, "serve")
    assert code == 0 and "carried True" in output, output
    [written] = tmp_path.glob("loop-*.json")
    counts = json.loads(written.read_text())
    # Each napper: its first step, then its resumption inside asyncio.sleep (the
    # innermost coroutine it awaited). Each waiter: one step, as the callback queued
    # before it has set its future already.
    assert counts["task napper @ napper"][0] == 4, counts
    assert counts["task napper @ sleep"][0] == 4, counts
    assert counts["task waiter @ waiter"][0] == 4, counts
    assert counts["Future.set_result"][0] == 4, counts
    assert all(steps > 0 and seconds >= 0 for steps, seconds in counts.values())
    # Per transaction, as the benchmark prints it (here: the 4 rounds).
    pid = int(written.stem.split("-")[1])
    os.environ[tb.LOOP_STEPS_ENV] = str(tmp_path)
    try:
        per = tb.loop_steps_read([pid], 4)
    finally:
        del os.environ[tb.LOOP_STEPS_ENV]
    assert per["task napper @ napper"][0] == 1
    assert per["all"][0] == sum(v[0] for k, v in per.items() if k != "all")
    assert list(per)[-1] == "all"
    assert "all (" in tb.loop_steps_text(per)


def test_with_count_calls_a_server_counts_its_calls_by_module_between_the_signals(
        tmp_path):
    """--count-calls: cProfile on the event loop's thread between the signals, the calls
    by module; the callbacks are not wrapped (they would be counted)."""
    output, code = run(tmp_path, "serve", calls=True)
    assert code == 0 and "carried True" in output, output
    [written] = tmp_path.glob("loop-*.json")
    counts = json.loads(written.read_text())
    # The script's own coroutines (run from "-c": the module "<string>") and asyncio's.
    assert counts["<string>"][0] >= 8, counts  # 4 nappers and 4 waiters at least
    assert counts["tasks.py"][0] > 0 and counts["builtin"][0] > 0, counts
    # Nothing of its own but the signal's handler that stops it: no wrapped callbacks.
    assert counts.get("bench/loop_steps/sitecustomize.py", [0])[0] <= 1, counts
    pid = int(written.stem.split("-")[1])
    os.environ[tb.LOOP_STEPS_ENV] = str(tmp_path)
    os.environ[tb.COUNT_CALLS_ENV] = "1"
    try:
        per = tb.loop_steps_read([pid], 4)
        text = tb.loop_steps_text(per)
    finally:
        del os.environ[tb.LOOP_STEPS_ENV], os.environ[tb.COUNT_CALLS_ENV]
    assert per["<string>"][0] == counts["<string>"][0] / 4
    assert text.startswith("Python-level calls per transaction") and "all (" in text


def test_a_process_that_is_not_a_server_carries_nothing_and_is_not_signalled(tmp_path):
    output, code = run(tmp_path)  # no "serve": SIGUSR1 keeps its default and ends it
    assert code != 0 and "carried" not in output
    assert not list(tmp_path.iterdir())
    os.environ[tb.LOOP_STEPS_ENV] = str(tmp_path)
    try:
        assert tb.loop_steps_signal([os.getpid()], 0) == []  # no ready file: left alone
    finally:
        del os.environ[tb.LOOP_STEPS_ENV]


def test_the_sitecustomize_it_shadows_still_runs(tmp_path):
    """Its folder goes first on PYTHONPATH, so Python would import only it: it runs the
    next sitecustomize on the path itself, in a server and in any other process."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.OWN_SITECUSTOMIZE_RAN = True\n")
    steps = tmp_path / "steps"
    steps.mkdir()
    check = "import builtins; print('own ran', getattr(builtins, 'OWN_SITECUSTOMIZE_RAN', False))"
    for argv in (["serve"], []):
        env = {**os.environ, "ATOMLOG_BENCH_LOOP_STEPS": str(steps),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "loop_steps"), str(own)])}
        done = subprocess.run([sys.executable, "-c", check, *argv], env=env, text=True,
                              capture_output=True, timeout=60)
        assert "own ran True" in done.stdout, done.stdout + done.stderr
    assert list(steps.glob("ready-*")), "the server did not carry the counter"


def test_a_benchmark_refuses_a_bad_setting_as_a_usage_error(capsys):
    """`--set` of bench/transactions.py and bench/failover.py: a setting no role takes is
    a usage error before any cluster starts (bench/failover.py used to end in
    launcher.up's traceback)."""
    import argparse

    import common

    parser = argparse.ArgumentParser(prog="bench")
    assert common.cluster_settings(parser, ["partition.durability=wal"]) == {
        "partition.durability": "wal"}
    for items, problem in ((["partition.fsync=false"], "unknown setting 'partition.fsync'"),
                           (["partition.durability"], "--set takes NAME=VALUE")):
        with pytest.raises(SystemExit) as ended:
            common.cluster_settings(parser, items)
        assert ended.value.code == 2 and problem in capsys.readouterr().err
