"""Process-wide Prometheus metrics shared by every service, and the /metrics endpoint.

Naming: prefix `atomlog_`, base units, counters end in `_total`, latencies are
histograms, and no label takes unbounded values (methods and codes are bounded sets).
"""

from __future__ import annotations

import ssl
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (Gauge, Info, disable_created_metrics, make_wsgi_app,
                               start_http_server)

from services.fastmetrics import Counter, Histogram

# `_created` series double the exposition size and Prometheus does not need them.
disable_created_metrics()

# Latency buckets from 100 µs to 10 s: unary calls on loopback take about 0.4 ms.
LATENCY_BUCKETS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

BUILD_INFO = Info("atomlog_build", "Version, role and name of this server process, and its "
                  "record batch functions' core: native (partition_server/rust) or python.")
RPC_STARTED = Counter("atomlog_rpc_started_total", "gRPC calls started.", ["method"])
RPC_HANDLED = Counter("atomlog_rpc_handled_total", "gRPC calls finished, by status code.",
                      ["method", "code"])
RPC_LATENCY = Histogram("atomlog_rpc_duration_seconds", "gRPC call handling time.",
                        ["method"], buckets=LATENCY_BUCKETS_SECONDS)
RPC_IN_FLIGHT = Gauge("atomlog_rpc_in_flight", "gRPC calls being handled now.")
LOCAL_CALLS = Counter("atomlog_local_calls_total", "Calls to a service of this same process, "
                      "made as function calls instead of gRPC (services/local.py).", ["method"])
AUTH_FAILURES = Counter("atomlog_authentication_failures_total", "Calls refused "
                        "UNAUTHENTICATED (services/auth.py), by why.", ["reason"])
AUTHENTICATED_CALLS = Counter("atomlog_authenticated_calls_total", "Calls whose principal "
                              "was established, by mechanism (mtls, jwt, static).", ["mechanism"])
ZOOKEEPER_CONNECTED = Gauge("atomlog_zookeeper_connected",
                            "1 while the ZooKeeper session is connected, else 0.")
ZOOKEEPER_SESSIONS = Counter("atomlog_zookeeper_sessions_total",
                             "ZooKeeper sessions established (more than 1 means one expired).")
SERVING = Gauge("atomlog_serving", "1 while the server's health status is SERVING.")
GC_PAUSES = Histogram("atomlog_gc_pause_seconds", "Python garbage collections by "
                      "generation (2: full), timed: while one runs the process runs nothing "
                      "else, its event loop included.", ["generation"],
                      buckets=LATENCY_BUCKETS_SECONDS)


class _HttpsServer(ThreadingMixIn, WSGIServer):
    """The /metrics server over TLS: each connection's handshake runs on that
    connection's own thread, with a deadline, so a silent client cannot hold up the
    accept loop."""

    daemon_threads = True
    handshake_timeout_s = 10.0

    def finish_request(self, request, client_address) -> None:
        request.settimeout(self.handshake_timeout_s)
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError):
            return  # a plaintext client, no or a wrong client certificate, a timeout
        request.settimeout(None)
        super().finish_request(request, client_address)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 — no access log on stderr
        pass


class MetricsEndpoint:
    """The /metrics HTTP server on its own thread (prometheus_client's); over HTTPS when
    given the server's TLS files (services/tls.ServerTls: reloaded like the gRPC port's)."""

    def __init__(self, host: str, port: int, server_tls=None):
        if server_tls is None:
            server, thread = start_http_server(port, addr=host)
        else:
            server = make_server(host, port, make_wsgi_app(), _HttpsServer,
                                 handler_class=_QuietHandler)
            server.socket = server_tls.ssl_context().wrap_socket(
                server.socket, server_side=True, do_handshake_on_connect=False)
            thread = threading.Thread(target=server.serve_forever, name="metrics-https",
                                      daemon=True)
            thread.start()
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port = server.server_port
        self.scheme = "https" if server_tls is not None else "http"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
