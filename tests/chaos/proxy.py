"""A fault-injecting TCP proxy for chaos tests of a local (loopback) cluster.

Every service process of the cluster advertises a proxy address instead of its real
port, and every process reaches ZooKeeper through a proxy port, so all traffic between
processes crosses one `FaultProxy`. Each *route* is a listening port on 127.0.0.1 that
forwards every accepted connection to a *target* ("host:port") and stands for one
logical *destination* ("ps-0", "zk", ...). Each accepted connection also has a
*source*: the logical name of the process that opened it. Faults are rules on the link
(source, destination):

    drop    bytes in both directions stall: they are not forwarded but held until the
            rule is healed, then delivered in order with nothing lost (like packets
            lost while TCP retransmits). New connections on the link are accepted, but
            the proxy connects them to the target only once the link heals (their SYN
            "never arrived"); if the client gives up (closes) before that, the
            connection is dropped without ever reaching the target.
    oneway  bytes from source to destination stall; destination -> source flows. New
            connections wait for the heal as with drop.
    delay   every chunk in both directions is forwarded delay_s after the proxy read
            it, order kept (a round trip therefore takes at least 2 * delay_s).
    reset   existing connections on the link are closed at once with RST (SO_LINGER
            0) on both sides; new connections are accepted and closed at once with
            RST, until healed.

source or destination may be "*". Precedence, most specific first: (source, dest),
(source, "*"), ("*", dest), ("*", "*"). Rules are evaluated on every chunk, so a new
rule affects existing connections at once; healing a stall releases the held bytes.

Closing: when one side closes (FIN) the proxy half-closes the other side after
forwarding what it holds for it; on a stalled link the FIN waits with the bytes. When
both directions have seen FIN both sockets are closed. A reset or a write error on
either side closes both sides with RST. If a target refuses the connection the client
is reset.

How sources are identified: on accept the peer is (127.0.0.1, peer_port). The proxy
finds the inode of the client's socket, the one whose local end is the peer and whose
remote end is the listener: by an exact NETLINK_SOCK_DIAG lookup (what `ss` uses; tens
of microseconds), falling back to parsing /proc/net/tcp and /proc/net/tcp6 (rows like
"0100007F:1F90", milliseconds with hundreds of sockets). It then finds the process
holding "socket:[inode]" by reading /proc/<pid>/fd/*: pids seen before first, then the
proxy's own process (it holds two fds per proxied connection, so it goes after the
cache; it is not skipped, so connections made from the process running the proxy are
identified too), then every other pid. The pid goes through name_of_pid. Unknown pids,
lookups that take over 2 s, and connections the client has already closed when the
lookup runs (a few ms after the accept) give "?"; rules naming a source do not apply to
a "?" connection. The lookup runs in a worker thread; the connection's bytes wait until
it is done. name_of_pid is called from that worker thread and must be thread-safe.

Limits: Linux only (/proc), loopback clients in the proxy's network namespace,
IPv4 listeners. If several processes share the socket (a fork after connect), the
first one found wins. At most 4 MiB (+ one 64 KiB chunk) is held per direction of a
connection; beyond that the proxy stops reading that socket, so the sender is slowed
by TCP backpressure, never buffered without bound. stop() drops whatever is held.
Nothing is logged; see stats() and links().
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import socket
import struct
import threading
import time
from typing import Callable

__all__ = ["FaultProxy", "MODES"]

MODES = ("drop", "oneway", "delay", "reset")

CHUNK = 64 * 1024                 # read size
MAX_HELD = 4 * 1024 * 1024        # bytes held per direction before reading stops
IDENTIFY_TIMEOUT_S = 2.0          # bound on finding the source process
CONNECT_TIMEOUT_S = 5.0           # bound on connecting to a target
STOP_TIMEOUT_S = 3.0              # bound on each phase of stop()
CALL_TIMEOUT_S = 10.0             # bound on a call from another thread into the loop
_STREAM_LIMIT = 256 * 1024        # asyncio StreamReader buffer limit
_PID_CACHE_SIZE = 512
_LINGER_RST = struct.pack("ii", 1, 0)

# NETLINK_SOCK_DIAG (linux/sock_diag.h, linux/inet_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG_HDRLEN = 16
_DIAG_INODE_OFFSET = 4 + 48 + 16   # family..retrans, inet_diag_sockid, expires..uid

# What a direction does with its next chunk.
_PASS, _STALL, _DELAY, _RESET = "pass", "stall", "delay", "reset"


# --------------------------------------------------------------------------- /proc lookups

def _proc_hex_v4(ip: str) -> str:
    """An IPv4 address as /proc/net/tcp prints it (the raw 32-bit word, host order)."""
    return "%08X" % struct.unpack("=I", socket.inet_aton(ip))[0]


def _proc_hex_v6(ip: str) -> str:
    """An IPv6 address as /proc/net/tcp6 prints it (four raw 32-bit words)."""
    return "".join("%08X" % w for w in struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, ip)))


def _diag_inode(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The inode of the TCP socket (local -> remote) through NETLINK_SOCK_DIAG: an exact
    lookup by 4-tuple, tens of microseconds however many sockets exist (what `ss` uses).
    0 if the socket is closed (no process holds it), None if there is no such socket.
    An IPv4 lookup also finds an IPv6 socket connected from ::ffff:127.0.0.1. Raises
    OSError if netlink is not available."""
    req = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
    req += struct.pack("!HH", local[1], remote[1])
    req += socket.inet_aton(local[0]).ljust(16, b"\0") + socket.inet_aton(remote[0]).ljust(16, b"\0")
    req += struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)          # any interface, no cookie
    header = struct.pack("=IHHII", _NLMSG_HDRLEN + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(header + req, (0, 0))
        reply = nl.recv(65536)
    if len(reply) < _NLMSG_HDRLEN + 4:
        raise OSError("short sock_diag reply")
    kind = struct.unpack_from("=H", reply, 4)[0]
    if kind == _NLMSG_ERROR:
        errno = -struct.unpack_from("=i", reply, _NLMSG_HDRLEN)[0]
        if errno == 2:                                                # ENOENT
            return None
        raise OSError(errno, "sock_diag lookup failed")
    if kind != _SOCK_DIAG_BY_FAMILY or len(reply) < _NLMSG_HDRLEN + _DIAG_INODE_OFFSET + 4:
        raise OSError("unexpected sock_diag reply")
    return struct.unpack_from("=I", reply, _NLMSG_HDRLEN + _DIAG_INODE_OFFSET)[0]


def _proc_inode(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """Like _diag_inode, by parsing /proc/net/tcp and /proc/net/tcp6 (milliseconds with
    hundreds of sockets)."""
    want = []
    try:
        want.append(("/proc/net/tcp", f"{_proc_hex_v4(local[0])}:{local[1]:04X}",
                     f"{_proc_hex_v4(remote[0])}:{remote[1]:04X}"))
        mapped = lambda ip: ip if ":" in ip else "::ffff:" + ip  # noqa: E731
        want.append(("/proc/net/tcp6", f"{_proc_hex_v6(mapped(local[0]))}:{local[1]:04X}",
                     f"{_proc_hex_v6(mapped(remote[0]))}:{remote[1]:04X}"))
    except OSError:
        return None
    for path, local_hex, remote_hex in want:
        try:
            with open(path, "r") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        orphaned = False
        for line in lines[1:]:
            parts = line.split()
            if len(parts) >= 10 and parts[1] == local_hex and parts[2] == remote_hex:
                if parts[9] != "0":
                    return int(parts[9])
                orphaned = True
        if orphaned:
            return 0
    return None


def _find_inode(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The inode of the socket whose local end is `local` and remote end `remote`; 0 if
    that socket is already closed (no process holds it); None if there is no such socket."""
    if ":" not in local[0] and ":" not in remote[0]:
        try:
            inode = _diag_inode(local, remote)
            if inode is not None:
                return inode
        except (OSError, ValueError, struct.error):
            pass
    return _proc_inode(local, remote)


def _holds(pid: int, link: str) -> bool | None:
    """Whether process `pid` has an fd pointing at `link`; None if it is gone."""
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{base}/{fd}") == link:
                return True
        except OSError:
            continue
    return False


# --------------------------------------------------------------------------- state

class _Route:
    __slots__ = ("destination", "target", "sock", "server", "address")

    def __init__(self, destination: str, target: tuple[str, int], sock: socket.socket):
        self.destination = destination
        self.target = target
        self.sock = sock
        self.server: asyncio.AbstractServer | None = None
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"


class _Direction:
    """Bytes read from one side, waiting to be written to the other."""
    __slots__ = ("forward", "queue", "held", "eof", "done", "wake", "space", "forwarded")

    def __init__(self, forward: bool):
        self.forward = forward                          # True: source -> destination
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()  # (read at, data)
        self.held = 0
        self.eof: str | None = None                     # None, "fin" or "rst"
        self.done = False                               # FIN forwarded
        self.wake = asyncio.Event()                     # data, eof, or a rule change
        self.space = asyncio.Event()                    # held dropped below MAX_HELD
        self.forwarded = 0


class _Conn:
    __slots__ = ("route", "cwriter", "uwriter", "peer", "source", "pid", "target", "state",
                 "up", "down", "wake", "tasks", "closed", "started")

    def __init__(self, route: _Route, cwriter: asyncio.StreamWriter):
        self.route = route
        self.cwriter = cwriter
        self.uwriter: asyncio.StreamWriter | None = None
        self.peer: tuple[str, int] | None = None
        self.source: str | None = None                  # None until identified
        self.pid: int | None = None
        self.target: str | None = None
        self.state = "identifying"
        self.up = _Direction(True)
        self.down = _Direction(False)
        self.wake = asyncio.Event()                     # rule change / client eof, before connect
        self.tasks: set[asyncio.Task] = set()
        self.closed = False
        self.started = time.monotonic()


def _parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host:
        raise ValueError(f"target must be 'host:port', got {target!r}")
    return host.strip("[]"), int(port)


# --------------------------------------------------------------------------- the proxy

class FaultProxy:
    """See the module docstring. All public methods may be called from any thread but
    the proxy's own; they wait until the change is in effect."""

    def __init__(self, name_of_pid: Callable[[int], str | None]):
        self._name_of_pid = name_of_pid
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._routes: dict[str, _Route] = {}
        self._rules: dict[tuple[str, str], tuple[str, float]] = {}
        self._conns: set[_Conn] = set()
        self._pid_cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pid_lock = threading.Lock()
        self._stats: dict = {
            "accepted": 0,              # connections accepted
            "closed": 0,                # connections closed (any reason)
            "bytes_to_destination": 0,  # bytes forwarded source -> destination
            "bytes_to_source": 0,       # bytes forwarded destination -> source
            "resets": 0,                # connections the proxy closed with RST (any reason)
            "fault_resets": 0,          # existing connections reset by a "reset" rule
            "refused": 0,               # new connections closed at once by a "reset" rule
            "abandoned": 0,             # closed by the client before a stalled link healed
            "connect_failures": 0,      # target refused or did not answer
            "unknown_source": 0,        # source could not be identified ("?")
            "internal_errors": 0,       # unexpected exceptions (connection reset)
            "loop_errors": 0,           # errors asyncio would have logged
            "accepted_by_source": {},   # source name -> connections accepted
        }

    # ---- lifecycle

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="fault-proxy-lookup")
            thread = threading.Thread(target=self._run_loop, args=(loop, ready),
                                      name="fault-proxy", daemon=True)
            self._loop, self._thread = loop, thread
            thread.start()
        ready.wait(STOP_TIMEOUT_S)

    def _run_loop(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self._loop_error)  # count, never log
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
                loop.run_until_complete(asyncio.sleep(0))
            finally:
                loop.close()

    def _loop_error(self, _loop, _context) -> None:
        self._stats["loop_errors"] += 1

    def stop(self) -> None:
        """Close the listeners and every connection (dropping held bytes), stop the loop
        and join its thread. Returns within a few seconds whatever the connections do."""
        with self._lock:
            loop, thread, executor = self._loop, self._thread, self._executor
            if thread is None:
                return
            self._thread = None
        if thread is threading.current_thread():
            raise RuntimeError("FaultProxy.stop() called from the proxy's own thread")

        async def shutdown() -> None:
            for route in self._routes.values():
                if route.server is not None:
                    route.server.close()
                else:
                    route.sock.close()
            me = asyncio.current_task()
            tasks = [t for c in self._conns for t in c.tasks if t is not me]
            for conn in list(self._conns):
                self._close(conn, "abort")
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            for _ in range(3):  # let transports run their connection_lost (closes the fds)
                await asyncio.sleep(0)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(STOP_TIMEOUT_S)
        except Exception:
            pass
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        thread.join(STOP_TIMEOUT_S)
        executor.shutdown(wait=False, cancel_futures=True)
        self._routes.clear()

    def __enter__(self) -> "FaultProxy":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- calls into the loop

    def _call(self, fn: Callable, *args):
        """Run fn(*args) on the loop (a plain function or a coroutine function) and wait."""
        loop, thread = self._loop, self._thread
        if thread is None or loop is None:
            raise RuntimeError("FaultProxy is not running (call start())")
        if thread is threading.current_thread():
            if asyncio.iscoroutinefunction(fn):
                raise RuntimeError("cannot wait for the proxy loop from its own thread")
            return fn(*args)

        async def runner():
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(runner(), loop).result(CALL_TIMEOUT_S)

    # ---- routes

    def add_route(self, destination: str, target: str, listen_port: int = 0,
                  faults_as: str | None = None) -> str:
        """Listen on 127.0.0.1:listen_port (0: any free port) for `destination`, forwarding
        to `target` ("host:port"). Returns the listening "127.0.0.1:port". Raises OSError
        if listen_port is busy, ValueError if the destination already has a route.
        `faults_as`: the destination name this route's connections answer to in fault
        rules (a second port of one process, e.g. a partition server's replication link,
        under the process's name); default `destination`."""
        parsed = _parse_target(target)
        if destination in ("*", "?") or faults_as in ("*", "?"):
            raise ValueError(f"{destination!r} is not a valid destination name")
        if self._thread is None:
            raise RuntimeError("FaultProxy is not running (call start())")
        if destination in self._routes:
            raise ValueError(f"destination {destination!r} already has a route")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", listen_port))
            sock.listen(512)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        route = _Route(faults_as or destination, parsed, sock)

        async def serve() -> None:
            if destination in self._routes:
                raise ValueError(f"destination {destination!r} already has a route")
            route.server = await asyncio.start_server(
                lambda r, w: self._accept(route, r, w), sock=sock, limit=_STREAM_LIMIT, backlog=512)
            self._routes[destination] = route

        try:
            self._call(serve)
        except BaseException:
            sock.close()
            raise
        return route.address

    def retarget(self, destination: str, target: str) -> None:
        """New connections to `destination` go to `target`; existing ones stay."""
        parsed = _parse_target(target)

        def apply() -> None:
            self._routes[destination].target = parsed

        self._call(apply)

    def routes(self) -> dict[str, dict]:
        """destination -> {"listen": "127.0.0.1:port", "target": "host:port"}."""
        return self._call(lambda: {d: {"listen": r.address, "target": "%s:%d" % r.target}
                                   for d, r in self._routes.items()})

    # ---- faults

    def set_fault(self, source: str, destination: str, mode: str, delay_s: float = 0.0) -> None:
        """Set the rule for the link (source, destination); either may be "*". Replaces any
        rule for exactly that pair. In effect for existing connections when this returns."""
        if mode not in MODES:
            raise ValueError(f"unknown fault mode {mode!r}; expected one of {MODES}")
        delay_s = float(delay_s)
        if mode == "delay" and not delay_s >= 0:
            raise ValueError("delay_s must be >= 0")

        def apply() -> None:
            self._rules[(source, destination)] = (mode, delay_s)
            self._rules_changed()

        self._call(apply)

    def heal(self, source: str, destination: str) -> None:
        """Remove the rule for exactly (source, destination); held bytes then flow."""
        def apply() -> None:
            if self._rules.pop((source, destination), None) is not None:
                self._rules_changed()

        self._call(apply)

    def heal_all(self) -> None:
        def apply() -> None:
            self._rules.clear()
            self._rules_changed()

        self._call(apply)

    def faults(self) -> list[dict]:
        """The current rules."""
        return self._call(lambda: [{"source": s, "destination": d, "mode": m, "delay_s": t}
                                   for (s, d), (m, t) in sorted(self._rules.items())])

    def _rule_for(self, source: str, destination: str) -> tuple[str, float] | None:
        rules = self._rules
        if not rules:
            return None
        for key in ((source, destination), (source, "*"), ("*", destination), ("*", "*")):
            rule = rules.get(key)
            if rule is not None:
                return rule
        return None

    def _action(self, conn: _Conn, forward: bool) -> tuple[str, float]:
        rule = self._rule_for(conn.source, conn.route.destination)
        if rule is None:
            return _PASS, 0.0
        mode, delay = rule
        if mode == "drop":
            return _STALL, 0.0
        if mode == "oneway":
            return (_STALL if forward else _PASS), 0.0
        if mode == "delay":
            return _DELAY, delay
        return _RESET, 0.0

    def _rules_changed(self) -> None:
        for conn in list(self._conns):
            if conn.source is None:        # still identifying: checks the rules when done
                continue
            if self._action(conn, True)[0] == _RESET:
                self._stats["fault_resets"] += 1
                self._close(conn, "rst")
                continue
            conn.wake.set()
            conn.up.wake.set()
            conn.down.wake.set()

    # ---- diagnostics

    def links(self) -> list[dict]:
        """One dict per open connection: source, destination, target, pid, peer_port,
        state, fault, bytes forwarded and bytes held (stalled or delayed) each way."""
        def snapshot() -> list[dict]:
            now = time.monotonic()
            out = []
            for c in self._conns:
                rule = self._rule_for(c.source, c.route.destination) if c.source else None
                out.append({
                    "source": c.source or "?",
                    "destination": c.route.destination,
                    "target": c.target,
                    "pid": c.pid,
                    "peer_port": c.peer[1] if c.peer else None,
                    "state": c.state,
                    "fault": rule[0] if rule else None,
                    "bytes_to_destination": c.up.forwarded,
                    "bytes_to_source": c.down.forwarded,
                    "stalled_to_destination": c.up.held,
                    "stalled_to_source": c.down.held,
                    "age_s": round(now - c.started, 3),
                })
            out.sort(key=lambda d: (d["destination"], d["source"], d["peer_port"] or 0))
            return out

        return self._call(snapshot)

    def stats(self) -> dict:
        def snapshot() -> dict:
            out = dict(self._stats)
            out["accepted_by_source"] = dict(out["accepted_by_source"])
            out["open"] = len(self._conns)
            out["routes"] = len(self._routes)
            return out

        if self._thread is None:
            return snapshot()
        return self._call(snapshot)

    # ---- connections (all on the loop thread)

    def _spawn(self, conn: _Conn, pump, *args) -> None:
        """Run `pump(conn, *args)` as a task of the connection. The coroutine is made in
        the task: a task cancelled before its first step (the connection closed at once)
        leaves no coroutine that was never awaited."""
        task = asyncio.get_running_loop().create_task(self._guard(conn, pump, args))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _guard(self, conn: _Conn, pump, args) -> None:
        try:
            await pump(conn, *args)
        except asyncio.CancelledError:
            pass
        except Exception:
            self._stats["internal_errors"] += 1
            self._close(conn, "rst")

    async def _accept(self, route: _Route, creader: asyncio.StreamReader,
                      cwriter: asyncio.StreamWriter) -> None:
        conn = _Conn(route, cwriter)
        me = asyncio.current_task()
        conn.tasks.add(me)
        self._conns.add(conn)
        self._stats["accepted"] += 1
        try:
            await self._serve(conn, creader)
        except asyncio.CancelledError:
            pass
        except Exception:
            self._stats["internal_errors"] += 1
            self._close(conn, "rst")
        finally:
            conn.tasks.discard(me)

    async def _serve(self, conn: _Conn, creader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        peer = conn.cwriter.get_extra_info("peername")
        listen = conn.cwriter.get_extra_info("sockname")
        if not peer or not listen:             # the client is gone already
            self._close(conn, "abort")
            return
        conn.peer, listen = tuple(peer[:2]), tuple(listen[:2])
        try:
            pid, name = await asyncio.wait_for(
                loop.run_in_executor(self._executor, self._identify, conn.peer, listen),
                IDENTIFY_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError, OSError):
            pid, name = None, None
        if conn.closed:
            return
        conn.pid = pid
        conn.source = name if name else "?"
        if conn.source == "?":
            self._stats["unknown_source"] += 1
        by_source = self._stats["accepted_by_source"]
        by_source[conn.source] = by_source.get(conn.source, 0) + 1

        # A new connection on a stalled link reaches the target only once the link heals.
        conn.state = "waiting"
        started_reading = False
        while True:
            action = self._action(conn, True)[0]
            if action == _RESET:
                self._stats["refused"] += 1
                self._close(conn, "rst")
                return
            if not started_reading:
                started_reading = True
                self._spawn(conn, self._pump_in, creader, conn.up)
            if action != _STALL:
                break
            if conn.up.eof is not None:
                self._stats["abandoned"] += 1
                self._close(conn, "abort")
                return
            conn.wake.clear()
            await conn.wake.wait()
            if conn.closed:
                return

        conn.state = "connecting"
        host, port = conn.route.target
        conn.target = f"{host}:{port}"
        try:
            ureader, uwriter = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=_STREAM_LIMIT), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            self._stats["connect_failures"] += 1
            self._close(conn, "rst")
            return
        if conn.closed:
            uwriter.transport.abort()
            return
        conn.uwriter = uwriter
        conn.state = "open"
        self._spawn(conn, self._pump_out, conn.up, uwriter)
        self._spawn(conn, self._pump_in, ureader, conn.down)
        self._spawn(conn, self._pump_out, conn.down, conn.cwriter)

    def _identify(self, peer: tuple[str, int], listen: tuple[str, int]) -> tuple[int | None, str | None]:
        """Worker thread: the pid and name of the process that owns the peer socket."""
        deadline = time.monotonic() + IDENTIFY_TIMEOUT_S / 2
        while True:
            inode = _find_inode(peer, listen)
            if inode == 0:                     # the client has closed it already
                return None, None
            pid = self._find_pid(inode) if inode is not None else None
            if pid is not None:
                try:
                    name = self._name_of_pid(pid)
                except Exception:
                    name = None
                return pid, name
            if time.monotonic() >= deadline:
                return None, None
            time.sleep(0.02)

    def _find_pid(self, inode: int) -> int | None:
        """The process holding socket `inode`: first the pids seen before (most recent
        first), then the proxy's own process (which holds two fds per proxied
        connection, so it is not scanned first), then every other process."""
        link = f"socket:[{inode}]"
        me = os.getpid()
        with self._pid_lock:
            cached = [pid for pid in reversed(self._pid_cache) if pid != me]
        cached.append(me)
        for pid in cached:
            held = _holds(pid, link)
            if held:
                self._remember(pid)
                return pid
            if held is None:
                with self._pid_lock:
                    self._pid_cache.pop(pid, None)
        tried = set(cached)
        try:
            entries = os.listdir("/proc")
        except OSError:
            return None
        for entry in entries:
            if not entry.isdigit():
                continue
            pid = int(entry)
            if pid in tried:
                continue
            if _holds(pid, link):
                self._remember(pid)
                return pid
        return None

    def _remember(self, pid: int) -> None:
        if pid == os.getpid():
            return
        with self._pid_lock:
            self._pid_cache[pid] = None
            self._pid_cache.move_to_end(pid)
            while len(self._pid_cache) > _PID_CACHE_SIZE:
                self._pid_cache.popitem(last=False)

    async def _pump_in(self, conn: _Conn, reader: asyncio.StreamReader, d: _Direction) -> None:
        """Read from one side into d, stopping while d holds MAX_HELD bytes."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                while d.held >= MAX_HELD:
                    d.space.clear()
                    await d.space.wait()
                data = await reader.read(CHUNK)
                if not data:
                    d.eof = "fin"
                    break
                d.queue.append((loop.time(), data))
                d.held += len(data)
                d.wake.set()
        except (ConnectionError, OSError):
            d.eof = "rst"
        d.wake.set()
        conn.wake.set()

    async def _pump_out(self, conn: _Conn, d: _Direction, writer: asyncio.StreamWriter) -> None:
        """Write d's bytes to the other side as the link's rule allows."""
        loop = asyncio.get_running_loop()
        other = conn.down if d is conn.up else conn.up
        counter = "bytes_to_destination" if d.forward else "bytes_to_source"
        while not conn.closed:
            d.wake.clear()
            action, delay = self._action(conn, d.forward)
            if action == _RESET:
                self._stats["fault_resets"] += 1
                self._close(conn, "rst")
                return
            if action == _STALL or (not d.queue and d.eof is None):
                await d.wake.wait()
                continue
            if d.queue:
                read_at, data = d.queue[0]
                if action == _DELAY:
                    wait = read_at + delay - loop.time()
                    if wait > 0:
                        timer = loop.call_later(wait, d.wake.set)
                        try:
                            await d.wake.wait()
                        finally:
                            timer.cancel()
                        continue
                d.queue.popleft()
                d.held -= len(data)
                if d.held < MAX_HELD:
                    d.space.set()
                if writer.transport.is_closing():
                    self._close(conn, "rst")
                    return
                writer.write(data)
                d.forwarded += len(data)
                self._stats[counter] += len(data)
                try:
                    await writer.drain()
                except (ConnectionError, OSError):
                    self._close(conn, "rst")
                    return
                continue
            # Everything forwarded and the reading side is closed: pass the close on.
            if d.eof == "rst":
                self._close(conn, "rst")
                return
            try:
                if writer.can_write_eof() and not writer.transport.is_closing():
                    writer.write_eof()
            except (ConnectionError, OSError):
                self._close(conn, "rst")
                return
            d.done = True
            if other.done:
                self._close(conn, "fin")
            return

    def _close(self, conn: _Conn, how: str) -> None:
        """Close both sides: "fin" gracefully, "rst" with RST, "abort" without flushing."""
        if conn.closed:
            return
        conn.closed = True
        conn.state = "closed"
        self._conns.discard(conn)
        self._stats["closed"] += 1
        if how == "rst":
            self._stats["resets"] += 1
        for writer in (conn.cwriter, conn.uwriter):
            if writer is None:
                continue
            transport = writer.transport
            if how == "fin":
                transport.close()
                continue
            if how == "rst":
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                    except OSError:
                        pass
            transport.abort()
        for d in (conn.up, conn.down):
            d.queue.clear()
            d.held = 0
            d.wake.set()
            d.space.set()
        conn.wake.set()
        me = asyncio.current_task()
        for task in list(conn.tasks):
            if task is not me:
                task.cancel()
