"""Tests of the fault-injecting TCP proxy (tests/chaos/proxy.py), with real sockets on
127.0.0.1: a threaded TCP server as the target, clients in this process and in a
subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.chaos.proxy import CHUNK, MAX_HELD, FaultProxy

ME = "tester"


def wait_until(predicate, timeout_s: float = 3.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class TcpServer:
    """A threaded TCP server on 127.0.0.1. Each connection echoes what it receives (or
    only collects it), and is kept in `conns` so a test can send from the server side or
    look at what arrived. When a client half-closes, the server closes its socket."""

    class Conn:
        def __init__(self, sock: socket.socket):
            self.sock = sock
            self.received = bytearray()
            self.eof = threading.Event()

    def __init__(self, echo: bool = True):
        self.echo = echo
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.conns: list[TcpServer.Conn] = []
        self._stopping = threading.Event()
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            sock.settimeout(None)
            conn = TcpServer.Conn(sock)
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: "TcpServer.Conn") -> None:
        try:
            while True:
                data = conn.sock.recv(65536)
                if not data:
                    break
                conn.received += data
                if self.echo:
                    conn.sock.sendall(data)
        except OSError:
            pass
        finally:
            conn.eof.set()
            try:
                conn.sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stopping.set()
        self.listener.close()
        for conn in self.conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()


def connect(address: str, timeout: float = 2.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def assert_reset(address: str, read_timeout: float = 2.0) -> None:
    """Connect to a route whose proxy accepts the connection and then resets it (a
    "reset" rule, a refusing target): the client sees ECONNRESET, at its first read or
    already from connect(). The kernel completes the handshake before the proxy accepts,
    and connect() (which waits for it and then reads SO_ERROR) may run only after the
    proxy's thread has accepted, identified and reset the connection (a loaded machine,
    or the GIL held by the proxy's thread)."""
    try:
        sock = connect(address)
    except ConnectionResetError:
        return
    with sock:
        sock.settimeout(read_timeout)
        with pytest.raises(ConnectionResetError):
            sock.recv(1)


def recv_exactly(sock: socket.socket, n: int, timeout: float = 2.0) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            raise AssertionError(f"EOF after {len(out)} of {n} bytes")
        out += data
    return bytes(out)


def assert_stalls(sock: socket.socket, timeout: float = 0.5) -> None:
    sock.settimeout(timeout)
    with pytest.raises(socket.timeout):
        data = sock.recv(1)
        raise AssertionError(f"expected no bytes, got {data!r}")


def round_trip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    return recv_exactly(sock, len(payload))


@pytest.fixture
def names() -> dict[int, str]:
    return {os.getpid(): ME}


@pytest.fixture
def proxy(names):
    p = FaultProxy(names.get)
    p.start()
    yield p
    stats = p.stats()
    p.stop()
    assert stats["internal_errors"] == stats["loop_errors"] == 0
    assert not [t for t in threading.enumerate() if t.name == "fault-proxy"]


@pytest.fixture
def echo():
    server = TcpServer()
    yield server
    server.close()


@pytest.fixture
def route(proxy, echo) -> str:
    return proxy.add_route("echo", echo.address)


def test_round_trip_and_close(proxy, echo, route):
    payload = os.urandom(1 << 20)
    with connect(route) as c:
        assert round_trip(c, b"hello") == b"hello"
        c.sendall(payload)
        assert recv_exactly(c, len(payload)) == payload
        c.shutdown(socket.SHUT_WR)           # the FIN crosses; the server closes; EOF comes back
        assert c.recv(1) == b""
    assert echo.conns[0].eof.wait(2)
    wait_until(lambda: proxy.stats()["open"] == 0, what="the connection to be closed")
    stats = proxy.stats()
    assert stats["accepted"] == 1
    assert stats["bytes_to_destination"] == stats["bytes_to_source"] == len(payload) + 5
    assert stats["resets"] == 0


def test_identifies_this_process(proxy, route):
    with connect(route) as c:
        assert round_trip(c, b"x") == b"x"
        (link,) = proxy.links()
        assert link["source"] == ME
        assert link["pid"] == os.getpid()
        assert link["destination"] == "echo"
        assert link["peer_port"] == c.getsockname()[1]
        assert link["bytes_to_destination"] == link["bytes_to_source"] == 1


CHILD = r"""
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
sys.stdin.readline()                                  # wait until the test knows our pid
s = socket.create_connection((host, int(port)), timeout=5)
s.sendall(b"hello-from-child")
got = b""
while len(got) < 16:
    got += s.recv(16 - len(got))
print("echo:" + got.decode(), flush=True)
sys.stdin.readline()                                  # keep the connection open until told
"""


def test_identifies_a_subprocess(proxy, names, route):
    with subprocess.Popen([sys.executable, "-c", CHILD, route], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            names[child.pid] = "client-3"
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "echo:hello-from-child"
            (link,) = proxy.links()
            assert (link["source"], link["pid"], link["destination"]) == ("client-3", child.pid, "echo")
            child.stdin.write("done\n")
            child.stdin.flush()
            assert child.wait(5) == 0
        finally:
            child.kill()
    assert proxy.stats()["accepted_by_source"] == {"client-3": 1}


def test_identifies_an_ipv4_mapped_ipv6_client(proxy, route):
    port = int(route.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as c:
        c.settimeout(2)
        c.connect(("::ffff:127.0.0.1", port))
        assert round_trip(c, b"v6") == b"v6"
        assert [link["source"] for link in proxy.links()] == [ME]


def test_unknown_process_is_question_mark(echo):
    with FaultProxy(lambda pid: None) as p:
        address = p.add_route("echo", echo.address)
        with connect(address) as c:
            assert round_trip(c, b"x") == b"x"
            assert [link["source"] for link in p.links()] == ["?"]
        assert p.stats()["unknown_source"] == 1


def test_drop_stalls_then_heal_delivers_everything_in_order(proxy, echo, route):
    c1 = connect(route)
    assert round_trip(c1, b"a") == b"a"
    proxy.set_fault(ME, "echo", "drop")
    for part in (b"1", b"22", b"333"):
        c1.sendall(part)
    c2 = connect(route)                     # a new connection on the link: accepted, stalled
    c2.sendall(b"new")
    c1.shutdown(socket.SHUT_WR)             # the close waits with the bytes
    assert_stalls(c1, 0.5)
    assert_stalls(c2, 0.05)
    assert len(echo.conns) == 1             # c2 never reached the target
    assert echo.conns[0].received == b"a"
    links = {link["peer_port"]: link for link in proxy.links()}
    assert links[c1.getsockname()[1]]["stalled_to_destination"] == 6
    assert links[c2.getsockname()[1]]["state"] == "waiting"

    proxy.heal(ME, "echo")
    assert recv_exactly(c1, 6) == b"122333"
    assert c1.recv(1) == b""                # the server closed after our FIN arrived
    assert recv_exactly(c2, 3) == b"new"
    assert echo.conns[0].received == b"a122333"
    c1.close()
    c2.close()


def test_drop_new_connection_abandoned_before_heal_never_reaches_target(proxy, echo, route):
    proxy.set_fault(ME, "echo", "drop")
    with connect(route) as c:
        c.sendall(b"lost")
        wait_until(lambda: [link["state"] for link in proxy.links()] == ["waiting"],
                   what="the connection to be identified")
    wait_until(lambda: proxy.stats()["abandoned"] == 1, what="the connection to be abandoned")
    proxy.heal(ME, "echo")
    with connect(route) as c:
        assert round_trip(c, b"ok") == b"ok"
    assert len(echo.conns) == 1 and echo.conns[0].received == b"ok"


def test_drop_backpressure_bounds_held_bytes(proxy):
    sink = TcpServer(echo=False)
    try:
        address = proxy.add_route("sink", sink.address)
        payload = os.urandom(48 << 20)
        with connect(address) as c:
            c.sendall(b"x")
            wait_until(lambda: sink.conns and sink.conns[0].received == b"x", what="first byte")
            proxy.set_fault("*", "sink", "drop")
            c.settimeout(10)
            sender = threading.Thread(target=c.sendall, args=(payload,), daemon=True)
            sender.start()
            wait_until(lambda: proxy.links()[0]["stalled_to_destination"] >= MAX_HELD,
                       what="the proxy to hold MAX_HELD bytes")
            time.sleep(0.2)
            held = proxy.links()[0]["stalled_to_destination"]
            assert MAX_HELD <= held <= MAX_HELD + CHUNK
            assert len(sink.conns[0].received) == 1
            proxy.heal("*", "sink")
            sender.join(10)
            assert not sender.is_alive()
            c.shutdown(socket.SHUT_WR)
            assert sink.conns[0].eof.wait(10)
        assert sink.conns[0].received == b"x" + payload
    finally:
        sink.close()


def test_oneway_stalls_source_to_destination_only(proxy, echo, route):
    with connect(route) as c:
        assert round_trip(c, b"a") == b"a"
        server_side = echo.conns[0]
        proxy.set_fault(ME, "echo", "oneway")
        c.sendall(b"up")
        server_side.sock.sendall(b"down")           # destination -> source still flows
        assert recv_exactly(c, 4, timeout=1) == b"down"
        assert_stalls(c, 0.3)                        # "up" never reached the server to be echoed
        assert server_side.received == b"a"
        proxy.heal(ME, "echo")
        assert recv_exactly(c, 2) == b"up"
        assert server_side.received == b"aup"


def test_delay_applies_each_way(proxy, route):
    with connect(route) as c:
        assert round_trip(c, b"a") == b"a"
        proxy.set_fault(ME, "echo", "delay", delay_s=0.2)
        began = time.monotonic()
        assert round_trip(c, b"slow") == b"slow"
        assert time.monotonic() - began >= 0.4      # 0.2 s each way
        c.sendall(b"1")
        c.sendall(b"2")
        c.sendall(b"3")
        assert recv_exactly(c, 3) == b"123"          # order kept
        proxy.heal(ME, "echo")
        began = time.monotonic()
        assert round_trip(c, b"fast") == b"fast"
        assert time.monotonic() - began < 0.15


def test_reset_existing_and_new_connections(proxy, echo, route):
    c1 = connect(route)
    assert round_trip(c1, b"a") == b"a"
    proxy.set_fault(ME, "echo", "reset")
    c1.settimeout(1)
    began = time.monotonic()
    with pytest.raises(ConnectionResetError):
        c1.recv(1)
    assert time.monotonic() - began < 0.5
    c1.close()
    assert echo.conns[0].eof.wait(1)                  # the server side was reset too

    assert_reset(route, read_timeout=1)               # accepted, then closed at once
    assert len(echo.conns) == 1
    stats = proxy.stats()
    assert stats["fault_resets"] == 1 and stats["refused"] == 1

    proxy.heal(ME, "echo")
    with connect(route) as c3:
        assert round_trip(c3, b"ok") == b"ok"


def test_wildcards_and_precedence(proxy, route):
    with connect(route) as c:
        assert round_trip(c, b"a") == b"a"

        proxy.set_fault("*", "echo", "drop")           # any source
        c.sendall(b"b")
        assert_stalls(c, 0.3)
        proxy.heal("*", "echo")
        assert recv_exactly(c, 1) == b"b"

        proxy.set_fault("other", "echo", "drop")       # another source: not us
        proxy.set_fault(ME, "elsewhere", "drop")       # another destination: not this one
        assert round_trip(c, b"c") == b"c"

        proxy.set_fault(ME, "*", "drop")               # us, any destination
        c.sendall(b"d")
        assert_stalls(c, 0.3)
        proxy.set_fault(ME, "echo", "delay", 0.05)     # more specific than (ME, "*")
        assert recv_exactly(c, 1) == b"d"
        proxy.heal(ME, "echo")
        c.sendall(b"e")
        assert_stalls(c, 0.1)                          # (ME, "*") applies again
        proxy.heal_all()
        assert recv_exactly(c, 1) == b"e"
        assert proxy.faults() == []


def test_retarget(proxy, echo, route):
    other = TcpServer()
    try:
        c1 = connect(route)
        assert round_trip(c1, b"one") == b"one"
        proxy.retarget("echo", other.address)
        with connect(route) as c2:
            assert round_trip(c2, b"two") == b"two"
        assert round_trip(c1, b"still") == b"still"    # existing connections stay
        c1.close()
        assert [bytes(conn.received) for conn in echo.conns] == [b"onestill"]
        assert [bytes(conn.received) for conn in other.conns] == [b"two"]
    finally:
        other.close()


def test_a_second_port_of_a_process_takes_its_faults(proxy, echo, route):
    """A route added `faults_as` another destination (a partition server's replication
    link beside its gRPC port) is cut by that destination's faults, and healed with them."""
    link = proxy.add_route("echo/link", echo.address, faults_as="echo")
    assert proxy.routes()["echo/link"]["listen"] == link
    c1 = connect(link)
    assert round_trip(c1, b"a") == b"a"
    proxy.set_fault(ME, "echo", "reset")
    c1.settimeout(1)
    with pytest.raises(ConnectionResetError):
        c1.recv(1)
    c1.close()
    assert_reset(link, read_timeout=1)
    proxy.heal(ME, "echo")
    with connect(link) as c2:
        assert round_trip(c2, b"ok") == b"ok"
    with pytest.raises(ValueError):
        proxy.add_route("other", echo.address, faults_as="*")


def test_connection_refused_target_resets_client(proxy):
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    address = proxy.add_route("dead", f"127.0.0.1:{port}")
    assert_reset(address)
    assert proxy.stats()["connect_failures"] == 1


def test_listen_port_busy_and_duplicate_route(proxy, echo):
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            proxy.add_route("echo", echo.address, listen_port=busy.getsockname()[1])
    finally:
        busy.close()
    address = proxy.add_route("echo", echo.address)
    with pytest.raises(ValueError):
        proxy.add_route("echo", echo.address)
    with connect(address) as c:
        assert round_trip(c, b"x") == b"x"


def test_stop_is_prompt_with_stalled_connection(names, echo):
    p = FaultProxy(names.get)
    p.start()
    address = p.add_route("echo", echo.address)
    c = connect(address)
    assert round_trip(c, b"a") == b"a"
    p.set_fault(ME, "echo", "drop")
    c.sendall(b"stalled" * 1000)
    wait_until(lambda: p.links()[0]["stalled_to_destination"] == 7000, what="bytes to stall")
    began = time.monotonic()
    p.stop()
    assert time.monotonic() - began < 2
    c.settimeout(2)
    try:
        assert c.recv(1) == b""
    except ConnectionResetError:
        pass
    c.close()
    with pytest.raises(OSError):                        # the listener is gone
        connect(address, timeout=0.5)
    p.stop()                                            # idempotent
