"""A real ZooKeeper server for the local cluster, from the Debian `zookeeper`
package's jars, run by Java as a separate process."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
# ZooKeeper 3.8 logs through SLF4J, and the Debian jar names no binding: without one it
# logs nothing at all (a server that cannot bind its port exits with status 1 and an
# empty log). The log4j 1.2 binding, when installed, makes it log by LOG4J below.
LOG_BINDING_JARS = (Path("/usr/share/java/slf4j-log4j12.jar"), Path("/usr/share/java/log4j-1.2.jar"))
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
# tickTime 500 ms lets sessions be as short as 1 s (2 ticks) for tests; sessions up to
# 60 s stay allowed. The admin HTTP server is off (it would take port 8080).
ZOO_CFG = """\
tickTime=500
initLimit=10
syncLimit=5
dataDir={data_dir}
clientPort={port}
clientPortAddress=127.0.0.1
maxSessionTimeout=60000
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr,stat,mntr
autopurge.snapRetainCount=3
autopurge.purgeInterval=1
maxClientCnxns=0
"""
LOG4J = """\
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t] %c{1}: %m%n
"""


class ZooKeeperMissing(RuntimeError):
    pass


def check_installed() -> str:
    """Path of java; raise ZooKeeperMissing with the fix when something is missing."""
    java = shutil.which("java")
    if java is None:
        raise ZooKeeperMissing("java not found: install a Java runtime "
                               "(apt-get install default-jre-headless)")
    if not ZOOKEEPER_JAR.exists():
        raise ZooKeeperMissing(f"{ZOOKEEPER_JAR} not found: install ZooKeeper "
                               "(apt-get install zookeeper)")
    return java


def prepare(directory: Path, port: int) -> list[str]:
    """Write zoo.cfg and log4j.properties under directory; return the command line."""
    java = check_installed()
    conf = directory / "conf"
    data = directory / "data"
    conf.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    (conf / "zoo.cfg").write_text(ZOO_CFG.format(data_dir=data.resolve(), port=port))
    (conf / "log4j.properties").write_text(LOG4J)
    classpath = [str(conf.resolve()), str(ZOOKEEPER_JAR)]
    if all(jar.exists() for jar in LOG_BINDING_JARS):
        classpath += [str(jar) for jar in LOG_BINDING_JARS]
    return [java, "-Xms64m", "-Xmx256m", "-XX:+UseSerialGC",
            f"-Dlog4j.configuration=file:{(conf / 'log4j.properties').resolve()}",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp", ":".join(classpath), MAIN_CLASS, str((conf / "zoo.cfg").resolve())]


def four_letter(address: str, command: str, timeout_s: float = 1.0) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(command.encode())
        chunks = []
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def is_serving(address: str) -> bool:
    try:
        return four_letter(address, "ruok") == "imok" and "Mode:" in four_letter(address, "srvr")
    except OSError:
        return False


def wait_serving(address: str, timeout_s: float, alive=lambda: True) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_serving(address):
            return True
        if not alive():
            return False
        time.sleep(0.1)
    return False
