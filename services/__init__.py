"""What every atomlog service shares: server bootstrap, health, reflection, metrics,
configuration, errors, the ZooKeeper session, the CLI and the local launcher."""

import os

__version__ = "0.1.0"

# gRPC's fork handlers off unless the user chose (read when grpc is first imported, and
# every atomlog process imports this package before grpc): atomlog forks only to exec
# (servers, the CLI, pyspark's JVM gateway) and starts its benchmarks' processes with
# "spawn", so the handlers serve nothing here; with them, a fork while another thread is
# in a gRPC call runs gRPC in the child, whose poller finds its epoll descriptor closed
# (close_fds): a test run's SparkSession died that way ("Java gateway process exited",
# the child's last words "epoll_wait error: Bad file descriptor"; grpc/grpc#13873).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
