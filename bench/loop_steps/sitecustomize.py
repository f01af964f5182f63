"""bench/transactions.py --loop-steps: counts and times every event-loop callback of a
server process, keyed by what ran (a task's coroutine, and what it had been waiting
for; or the callback's name), between two signals.

Active only in a server (`serve` among the arguments) started with
ATOMLOG_BENCH_LOOP_STEPS=DIR and this directory first on PYTHONPATH; it never ships in a
server. It writes DIR/ready-<pid> at start-up, so the benchmark signals only processes
that carry it (SIGUSR1 would end any other). SIGUSR1 clears the counts (the timed window
starts); SIGUSR2 writes them to DIR/loop-<pid>.json as {key: [steps, seconds]}.
Wrapping each callback costs about a microsecond of its own, counted in it. In every
process it then runs the sitecustomize it shadows, if there is one further on sys.path.

With ATOMLOG_BENCH_COUNT_CALLS=1 too (--count-calls) it counts calls instead: cProfile
runs on the event loop's thread between the two signals, and the file holds the
Python-level calls by module ({module: [calls, seconds of their own]}; C functions as
"builtin"); the callbacks are not wrapped.
"""

import os
import sys

_DIR = os.environ.get("ATOMLOG_BENCH_LOOP_STEPS")


def _write_counts(counts: dict) -> None:
    """DIR/loop-<pid>.json, whole (the benchmark reads it once it exists)."""
    import json

    path = os.path.join(_DIR, f"loop-{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(counts, out)
    os.replace(path + ".tmp", path)


if _DIR and "serve" in sys.argv and os.environ.get("ATOMLOG_BENCH_COUNT_CALLS"):
    import cProfile
    import signal

    _profiler: list = []
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def _module(filename: str) -> str:
        if filename == "~":
            return "builtin"
        if filename.startswith(_root + os.sep) and os.sep + ".venv" + os.sep not in filename:
            return os.path.relpath(filename, _root)
        return os.path.basename(filename)

    def _start(*_args) -> None:
        if not _profiler:
            _profiler.append(cProfile.Profile())
            _profiler[0].enable()

    def _stop(*_args) -> None:
        counts: dict = {}
        if _profiler:
            profiler = _profiler.pop()
            profiler.disable()
            profiler.create_stats()
            for (filename, _, _), (_, calls, own, _, _) in profiler.stats.items():
                entry = counts.setdefault(_module(filename), [0, 0.0])
                entry[0] += calls
                entry[1] += own
        _write_counts(counts)

    signal.signal(signal.SIGUSR1, _start)  # (in the main thread: the event loop's)
    signal.signal(signal.SIGUSR2, _stop)
    with open(os.path.join(_DIR, f"ready-{os.getpid()}"), "w"):
        pass
elif _DIR and "serve" in sys.argv:
    import asyncio.events
    import signal
    import time

    _counts: dict = {}
    _run = asyncio.events.Handle._run
    _clock = time.perf_counter

    def _key(handle) -> str:
        callback = handle._callback
        task = getattr(callback, "__self__", None)
        if task is not None and hasattr(task, "get_coro"):
            coro = task.get_coro()
            inner = coro
            for _ in range(32):  # the innermost coroutine it awaits: where it resumes
                awaited = getattr(inner, "cr_await", None)
                if awaited is None or not hasattr(awaited, "cr_await"):
                    break
                inner = awaited
            return (f"task {getattr(coro, '__qualname__', type(coro).__name__)} @ "
                    f"{getattr(inner, '__qualname__', '?')}")
        return getattr(callback, "__qualname__", type(callback).__name__)

    def _timed_run(handle) -> None:
        began = _clock()
        try:
            key = _key(handle)
        except Exception:  # noqa: BLE001 — a diagnostic must not break the server
            key = "?"
        _run(handle)
        entry = _counts.get(key)
        if entry is None:
            entry = _counts[key] = [0, 0.0]
        entry[0] += 1
        entry[1] += _clock() - began

    def _clear(*_args) -> None:
        _counts.clear()

    def _write(*_args) -> None:
        _write_counts(_counts)

    asyncio.events.Handle._run = _timed_run
    signal.signal(signal.SIGUSR1, _clear)
    signal.signal(signal.SIGUSR2, _write)
    with open(os.path.join(_DIR, f"ready-{os.getpid()}"), "w"):
        pass


def _chain() -> None:
    """Run the sitecustomize this one shadows (the next one on sys.path), as Python
    would have without this folder first on PYTHONPATH: a server keeps its own set-up."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()
