"""python -m tests.chaos --workload log|ctp|spark-lite --minutes M --seed S [--nemesis kill,pause,net,disk] [--tls]

Runs one seeded chaos run (tests/chaos/runner.py) and checks its history
(tests/chaos/checker.py). Prints the seed first; exit 0 when the checker found nothing,
1 when it found anomalies or could not check, 2 on bad arguments.
See docs/verification.md."""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from pathlib import Path

from tests.chaos.nemesis import NEMESES, ONE_COPY_ONLY, REPLICATED_ONLY
from tests.chaos.runner import WORKLOADS, Options, Run


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--minutes", type=float, default=1.0,
                        help="length of the fault phase (default 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="replays a run's faults and operations (default: random)")
    parser.add_argument("--nemesis", default=None,
                        help=f"comma-separated, from {','.join(NEMESES)}, or 'none' "
                             "(default: kill,pause,net,disk,restart,power, and misplace "
                             "with one copy or leader,wipe,reassign,corrupt with "
                             "--replication 2 or more; "
                             "power, a power cut that loses every unsynced write, needs "
                             "root and loop devices, and is skipped with a note without: "
                             "tests/chaos/disks.py)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the history and report go (default: "
                             ".atomlog/chaos/<workload>-<seed>-<time>)")
    parser.add_argument("--keep-cluster", action="store_true",
                        help="keep the cluster's data directories after the run")
    parser.add_argument("--replication", type=int, default=1,
                        help="replication factor of every topic, __txn_log included "
                             "(topics.default_replication_factor; default 1); the leader, "
                             "wipe, reassign and corrupt nemeses need 2 or more")
    parser.add_argument("--combined", action="store_true",
                        help="run the combined server (every role in one process) instead "
                             "of a process per role")
    parser.add_argument("--tls", action="store_true",
                        help="run the cluster secured as `atomlog up --tls` does (mTLS, "
                             "auth.mode=mtls, ACLs, ZooKeeper digest); clients use the admin "
                             "certificate")
    parser.add_argument("--go", action="store_true",
                        help="ctp: a fourth worker runs the Go client (clients/go, built with "
                             "scripts/go_tools.sh's toolchain) on its streaming transaction "
                             "path, writing its history as the Python workers do")
    args = parser.parse_args(argv)
    chosen = args.nemesis or ("kill,pause,net,disk,restart,power"
                              + (",leader,wipe,reassign,corrupt" if args.replication > 1
                                 else ",misplace"))
    nemeses = [] if chosen == "none" else [n for n in chosen.split(",") if n]
    unknown = [n for n in nemeses if n not in NEMESES]
    if unknown:
        parser.error(f"unknown nemesis {', '.join(unknown)}; choose from {', '.join(NEMESES)}")
    if not 1 <= args.replication <= 3:
        parser.error("--replication must be 1..3 (the run has 3 partition servers)")
    if args.replication > 1 and args.combined:
        parser.error("--replication needs separate partition servers (not --combined)")
    if args.replication == 1 and any(n in REPLICATED_ONLY for n in nemeses):
        parser.error(f"nemeses {', '.join(REPLICATED_ONLY)} need --replication 2 or more")
    if args.replication > 1 and any(n in ONE_COPY_ONLY for n in nemeses):
        parser.error(f"nemeses {', '.join(ONE_COPY_ONLY)} need --replication 1")
    if args.go and args.workload != "ctp":
        parser.error("--go runs a ctp worker: it needs --workload ctp")
    if not 0 < args.minutes <= 24 * 60:
        parser.error("--minutes must be in (0, 1440]")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    run_dir = args.run_dir or Path(".atomlog") / "chaos" / \
        f"{args.workload}{'-combined' if args.combined else ''}-{seed}-" \
        f"{time.strftime('%Y%m%d-%H%M%S')}"
    return Options(args.workload, args.minutes, seed, nemeses, run_dir, args.keep_cluster,
                   combined=args.combined, replication=args.replication, tls=args.tls,
                   go=args.go)


def _stop(signum, _frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # the run's cleanup still happens


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    signal.signal(signal.SIGTERM, _stop)
    report = Run(options).execute()
    print(f"run directory: {options.run_dir}")
    return 0 if report["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
