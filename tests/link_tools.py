"""Speaking to a leader's replication link (partition_server/copy_link.py) from a test:
its address from a server's registration, and raw frames on a socket."""

from __future__ import annotations

import json
import socket
import struct
import time
import urllib.request

from partition_server.copy_link import KIND_REQUEST, MAGIC

HEAD = struct.Struct(">IB")


def link_address(cluster, server: str) -> str:
    zk = cluster.zookeeper()
    try:
        data, _ = zk.get(f"/servers/{server}")
    finally:
        zk.stop()
    return json.loads(data)["replication_link"]


def connect(address: str, magic: bytes = MAGIC) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(magic)
    return sock


def request_frame(body: bytes, token: str = "") -> bytes:
    payload = struct.pack(">H", len(token.encode())) + token.encode() + body
    return HEAD.pack(len(payload) + 1, KIND_REQUEST) + payload


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """(kind, payload) of the next frame, or None when the leader closed the link."""
    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    head = exactly(HEAD.size)
    if head is None:
        return None
    length, kind = HEAD.unpack(head)
    payload = exactly(length - 1)
    return None if payload is None else (kind, payload)


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def calls_by_way(metrics_addresses, service: str, methods) -> dict[str, dict[str, float]]:
    """The calls of each of `service`'s `methods` the servers at `metrics_addresses`
    took, {"link": ..., "grpc": ...}: those taken on their links, and the rest of those
    started. A scrape may fall between a link call's two counts (taken on the link, then
    started: a step of the server's loop, read from its metrics thread), which would show
    a link call as -1 over gRPC; so the servers are read until two reads in a row agree."""
    last = None
    for _ in range(50):
        totals = _calls_by_way(metrics_addresses, service, methods)
        if totals == last:
            return totals
        last = totals
        time.sleep(0.05)
    raise AssertionError(f"the servers' call counts kept moving: {last}")


def _calls_by_way(metrics_addresses, service: str, methods) -> dict[str, dict[str, float]]:
    totals = {"link": dict.fromkeys(methods, 0.0), "grpc": dict.fromkeys(methods, 0.0)}
    for address in metrics_addresses:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for method in methods:
            label = f'{{method="/atomlog.v1.{service}/{method}"}} '
            on_link = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("atomlog_link_calls_total" + label))
            started = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("atomlog_rpc_started_total" + label))
            totals["link"][method] += on_link
            totals["grpc"][method] += started - on_link
    return totals
