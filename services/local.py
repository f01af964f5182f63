"""In-process dispatch: a call to a service that this same process hosts is a function
call, not a gRPC round trip through the loopback.

A server registers each servicer it hosts under its advertised address
(`register`); the places that call other servers (the coordinator's partition routes,
the partition server's verifier, the coordinator's producer-id pool) ask `stub()` for a
stub, and get a `LocalStub` when the address is their own process's. In a process that
hosts one role that happens only for calls to itself; in the combined server (every role
in one process) every server-to-server call is local.

A `LocalStub` behaves as a grpc.aio stub does for what our callers use: `await
stub.Method(request, timeout=...)` returns the reply, and a failure raises a
`grpc.aio.AioRpcError` carrying the same status code, message and `ErrorInfo` details
the gRPC interceptor would have sent (services/interceptors.py), so error handling and
retries are the same on both paths. A timeout cancels the servicer's work and raises
DEADLINE_EXCEEDED. The servicer runs in the caller's task, as a function call would.
The request and reply objects are shared, not copied: neither side
changes them after the call (none of ours does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from services import auth, tls
from services.errors import AtomlogError, unexpected
from services.grpcutil import RECONNECT_OPTIONS

log = logging.getLogger("atomlog.local")

_SERVICERS: dict[tuple[str, str], Any] = {}  # (address, full service name) -> servicer


# TLS for calls to other servers (tls.enabled): set once by the runtime at start-up, used
# by every StubCache of the process (the coordinator's partition routes, the partition
# server's verifier, the producer-id pool). None: plaintext.
_CHANNEL_TLS: "tls.ChannelTls | None" = None


def set_channel_tls(channel_tls: "tls.ChannelTls | None") -> None:
    global _CHANNEL_TLS
    _CHANNEL_TLS = channel_tls


def channel_tls() -> "tls.ChannelTls | None":
    return _CHANNEL_TLS


# The bearer token this server sends to the others (auth.service_token_file): set once by
# the runtime at start-up. None: no token (mTLS identifies the server, or no auth).
_CHANNEL_TOKEN: "auth.TokenSource | None" = None


def set_channel_token(source: "auth.TokenSource | None") -> None:
    global _CHANNEL_TOKEN
    _CHANNEL_TOKEN = source


def channel_token() -> "auth.TokenSource | None":
    return _CHANNEL_TOKEN


def aio_channel(address: str, options: list | None = None) -> grpc.aio.Channel:
    """A channel from this server to another: TLS when the process has it, and its
    service token on every call when it has one, and a reconnect backoff of at most 0.5 s
    (grpcutil.RECONNECT_OPTIONS)."""
    options = [*RECONNECT_OPTIONS, *(options or [])]
    interceptors = auth.aio_interceptors(_CHANNEL_TOKEN)
    if _CHANNEL_TLS is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return _CHANNEL_TLS.aio_channel(address, options, interceptors)


def register(address: str, service: str, servicer: Any) -> None:
    _SERVICERS[(address, service)] = servicer


def unregister(address: str) -> None:
    for key in [k for k in _SERVICERS if k[0] == address]:
        del _SERVICERS[key]


def servicer(address: str, service: str) -> Any | None:
    return _SERVICERS.get((address, service))


def stub(address: str, service: str, stub_class, channel_for):
    """A LocalStub when this process hosts `service` at `address`, else
    stub_class(channel_for(address)) (the caller caches either)."""
    local = servicer(address, service)
    if local is not None:
        return LocalStub(local, service)
    return stub_class(channel_for(address))


class StubCache:
    """One channel and one stub per address for one service (a stub built per call costs
    CPU), a LocalStub where this process hosts the service. Not thread-safe: one event
    loop."""

    def __init__(self, service: str, stub_class, channel_options: list | None = None):
        self.service = service
        self._stub_class = stub_class
        self._options = channel_options or []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self._tls_generation = _CHANNEL_TLS.current()[0] if _CHANNEL_TLS is not None else 0
        self._retired: set[asyncio.Future] = set()

    def get(self, address: str):
        if _CHANNEL_TLS is not None and _CHANNEL_TLS.current()[0] != self._tls_generation:
            self._renew()
        found = self._stubs.get(address)
        if found is None:
            found = self._stubs[address] = stub(address, self.service, self._stub_class,
                                                self._channel)
        return found

    def _renew(self) -> None:
        """The TLS files were reloaded: new channels from now on; the old ones close once
        their calls have had a minute to finish."""
        self._tls_generation = _CHANNEL_TLS.current()[0]
        self._retire(set(self._stubs) | set(self._channels))

    def retain(self, addresses) -> None:
        """Forget every address not in `addresses` (the servers that exist now). Else
        each address a server ever had (a pod's, new at every restart) kept a channel
        for good."""
        self._retire((set(self._stubs) | set(self._channels)) - set(addresses))

    def _retire(self, addresses) -> None:
        """Forget `addresses`: their channels close once their calls have had a minute to
        finish."""
        if not addresses:
            return
        self._retired = {task for task in self._retired if not task.done()}
        for address in addresses:
            self._stubs.pop(address, None)
            channel = self._channels.pop(address, None)
            if channel is not None:
                self._retired.add(asyncio.ensure_future(channel.close(grace=60.0)))

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self._options)
        return channel

    async def close(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()
        for task in list(self._retired):
            task.cancel()
        self._retired.clear()


class LocalContext:
    """The part of grpc.aio.ServicerContext our servicers use."""

    def __init__(self, timeout_s: float | None):
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancelled(self) -> bool:
        return False


def rpc_error(error: AtomlogError) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(error.code, grpc.aio.Metadata(),
                                grpc.aio.Metadata(*error.trailing_metadata()),
                                details=error.message)


class LocalStub:
    """A stub whose methods call the servicer in this process (see the module doc)."""

    def __init__(self, servicer: Any, service: str):
        self._servicer = servicer
        self._service = service

    def __getattr__(self, method: str):
        """The call function of `method`, made once (then found as an attribute)."""
        behavior = getattr(self._servicer, method)
        name = f"/{self._service}/{method}"
        # Imported here: the SDK imports this module (rpc_error) and would otherwise bring
        # prometheus_client and http.server into every client process.
        from services import metrics

        counted = metrics.LOCAL_CALLS.labels(name)

        async def call(request, timeout: float | None = None, **_options):
            counted.inc()
            # The caller is this server, not the client whose call led here.
            principal = auth.set_current(auth.IN_PROCESS)
            try:
                # The servicer runs in the caller's task (asyncio.wait_for would make a
                # task per call); on timeout asyncio.timeout cancels it there.
                if timeout is None:
                    return await behavior(request, LocalContext(None))
                async with asyncio.timeout(timeout):
                    return await behavior(request, LocalContext(timeout))
            except AtomlogError as error:
                raise rpc_error(error) from None
            except asyncio.TimeoutError:
                raise rpc_error(AtomlogError(
                    "REQUEST_TIMED_OUT", f"{name} (in-process) took longer than {timeout} s")) \
                    from None
            except NotImplementedError:
                raise rpc_error(AtomlogError("UNIMPLEMENTED", f"{name} is not implemented")) \
                    from None
            except Exception as unhandled:  # answered as the interceptor answers it
                error = unexpected(unhandled, name)
                if error.reason == "INTERNAL":
                    log.exception("unhandled error in %s (in-process)", name)
                raise rpc_error(error) from None
            finally:
                auth.reset_current(principal)

        call.__name__ = method
        setattr(self, method, call)
        return call
