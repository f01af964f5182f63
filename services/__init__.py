"""What every atomlog service shares: server bootstrap, health, reflection, metrics,
configuration, errors, the ZooKeeper session, the CLI and the local launcher."""

__version__ = "0.1.0"
