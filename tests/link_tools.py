"""Speaking to a leader's replication link (partition_server/copy_link.py) from a test:
its address from a server's registration, and raw frames on a socket."""

from __future__ import annotations

import json
import socket
import struct

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
