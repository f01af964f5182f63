"""The SDK's channels (spark_client/routing.py) reach a server again soon after it comes
back, however long it was down: with gRPC's default reconnect backoff (growing to 120 s)
every call on the channel kept failing at once with the old "connection refused" for
seconds after a restart, longer than a subscription call retries (a consumer created
right after a failover whose new leader had been down and restarted gave up)."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import launcher
from spark_client.routing import Channels


def test_a_server_that_comes_back_is_reached_within_a_second():
    address = f"127.0.0.1:{launcher.free_port()}"
    channels = Channels()
    stub = channels.stub(address, health_pb2_grpc.HealthStub)
    server = None
    try:
        # Down for 6.5 s: gRPC's default backoff would have tried at about 1, 2.6 and
        # 5.2 s, and next at about 9.3 s (±20 % each).
        began = time.monotonic()
        while time.monotonic() - began < 6.5:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                raise AssertionError(f"something answers at {address}")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            time.sleep(0.05)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        server.add_insecure_port(address)
        server.start()
        back = time.monotonic()
        while True:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            time.sleep(0.02)
        # The reconnect backoff is at most 0.5 s (+20 % jitter): well inside the 1.1 s a
        # subscription call's retries take at least.
        assert time.monotonic() - back < 1.0
    finally:
        channels.close()
        if server is not None:
            server.stop(0)
