"""Server interceptor: the one place where every call is authenticated (services/auth.py:
its principal, or UNAUTHENTICATED) and authorized (services/acl.py, with
auth.authorizer=acl: PERMISSION_DENIED before the servicer runs, so a refused call changes
nothing), where errors become gRPC statuses, and where every call is counted and timed. Servicers raise `AtomlogError` and stay thin; they find the
caller in `services.auth.current()`."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services import auth, metrics
from services.errors import AtomlogError, unexpected
from services.logs import event

log = logging.getLogger("atomlog.rpc")
# Wrapped method handlers kept per interceptor (one per method and authorizer in use).
MAX_WRAPPED_HANDLERS = 1024


class ErrorsAndMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: auth.Authenticator | None = None):
        self.authenticator = authenticator if authenticator is not None else auth.Authenticator()
        # services.acl.Authorizer when auth.authorizer=acl (set by the runtime at start).
        self.authorizer = None
        # (kind, method, behavior) -> (authenticator, authorizer, wrapped handler)
        self._wrapped: dict[tuple, tuple] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        if method.startswith(auth.EXEMPT_PREFIXES):
            return handler  # health probes and reflection need no credentials
        if handler.unary_unary is None:
            # A stream (atomlog's own RPCs are all unary): authenticated, not wrapped; with
            # an authorizer refused (no ACL rule covers it: fail closed).
            if self.authorizer is not None:
                return _refused_stream(method, handler)
            return handler if not self.authenticator.enabled else _authenticated_stream(
                self.authenticator, method, handler)
        # The request is parsed inside the wrapper, not by gRPC: a request that does not
        # parse (bad UTF-8 in a string field, a malformed message) was answered UNKNOWN
        # with no ErrorInfo; now INVALID_ARGUMENT with one, as on the link.
        return self._cached(("grpc", method, handler.unary_unary),
                            lambda: grpc.unary_unary_rpc_method_handler(
                                _wrap(method, handler.unary_unary, self.authenticator,
                                      self.authorizer, handler.request_deserializer),
                                request_deserializer=None,
                                response_serializer=handler.response_serializer))

    def wrapped(self, method: str, behavior):
        """`behavior` (a unary servicer method) as gRPC calls it through this interceptor:
        authenticated, authorized, counted and timed, its errors given to
        `context.abort`. For a transport of our own (partition_server/copy_link.py), whose
        context's abort raises them."""
        return self._cached(("call", method, behavior),
                            lambda: _wrap(method, behavior, self.authenticator, self.authorizer))

    def _cached(self, key: tuple, make):
        # Asked on every call: the wrapped handler is made once per method (and per
        # authorizer: the runtime sets it at start).
        cached = self._wrapped.get(key)
        if cached is not None and cached[0] is self.authenticator \
                and cached[1] is self.authorizer:
            return cached[2]
        if len(self._wrapped) >= MAX_WRAPPED_HANDLERS:
            self._wrapped.clear()
        wrapped = make()
        self._wrapped[key] = (self.authenticator, self.authorizer, wrapped)
        return wrapped


def principal_of(authenticator: auth.Authenticator, method: str, metadata,
                 auth_context: dict, peer: str) -> auth.Principal:
    """The caller's principal (counted and noted), or AtomlogError UNAUTHENTICATED (the
    failure logged and counted). Also used by the replication link
    (partition_server/copy_link.py), whose requests carry the same bearer tokens."""
    if not authenticator.enabled:
        return auth.NOBODY
    try:
        principal = authenticator.authenticate(metadata, auth_context)
    except auth.AuthFailure as failure:
        auth.record_failure(failure, method, peer)
        raise AtomlogError("UNAUTHENTICATED", f"{method}: {failure.message}",
                           {"failure": failure.failure, "auth_mode": authenticator.mode}) \
            from None
    metrics.AUTHENTICATED_CALLS.labels(principal.mechanism).inc()
    authenticator.note(principal, peer)
    return principal


async def authenticate(authenticator: auth.Authenticator, method: str,
                       context: grpc.aio.ServicerContext) -> auth.Principal:
    """The call's principal (also set as services.auth.current()); on bad credentials the
    call is aborted UNAUTHENTICATED (logged and counted)."""
    try:
        principal = principal_of(authenticator, method, context.invocation_metadata(),
                                 context.auth_context(), context.peer())
    except AtomlogError as error:
        await context.abort(error.code, error.message, error.trailing_metadata())
    auth.set_current(principal)
    return principal


def _authenticated_stream(authenticator: auth.Authenticator, method: str, handler):
    kinds = (("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler))
    for kind, make in kinds:
        behavior = getattr(handler, kind)
        if behavior is None:
            continue
        if kind.endswith("_stream"):
            async def wrapped(request, context, behavior=behavior):
                await authenticate(authenticator, method, context)
                async for reply in behavior(request, context):
                    yield reply
        else:
            async def wrapped(request, context, behavior=behavior):
                await authenticate(authenticator, method, context)
                return await behavior(request, context)
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    return handler


def _refused_stream(method: str, handler):
    error = AtomlogError("PERMISSION_DENIED", f"{method}: a streaming method, which no ACL "
                         "covers", {"operation": "alter", "resource_type": "cluster",
                                    "resource_name": "atomlog"})

    async def refuse(request, context):
        await context.abort(error.code, error.message, error.trailing_metadata())

    for kind, make in (("unary_stream", grpc.unary_stream_rpc_method_handler),
                       ("stream_unary", grpc.stream_unary_rpc_method_handler),
                       ("stream_stream", grpc.stream_stream_rpc_method_handler)):
        if getattr(handler, kind) is not None:
            return make(refuse, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


def _wrap(method: str, behavior, authenticator: auth.Authenticator, authorizer=None,
          deserialize=None):
    """`behavior` authenticated, authorized, counted and timed; with `deserialize`, the
    request arrives as bytes and is parsed here (INVALID_ARGUMENT when it does not)."""
    # This method's metric children, looked up once, not on every call.
    started_calls = metrics.RPC_STARTED.labels(method)
    latency = metrics.RPC_LATENCY.labels(method)
    handled_ok = metrics.RPC_HANDLED.labels(method, grpc.StatusCode.OK.name)

    async def wrapped(request, context: grpc.aio.ServicerContext):
        if authenticator.enabled:
            await authenticate(authenticator, method, context)
        else:
            auth.set_current(auth.NOBODY)
        started_calls.inc()
        metrics.RPC_IN_FLIGHT.inc()
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if deserialize is not None:
                try:
                    request = deserialize(request)
                except Exception as error:  # noqa: BLE001 — the caller's bytes
                    raise AtomlogError("INVALID_ARGUMENT", f"{method}: the request does not "
                                       f"parse: {type(error).__name__}: {error}") from None
            if authorizer is None:
                return await behavior(request, context)
            principal = auth.current()
            authorizer.check(method, request, principal)  # PERMISSION_DENIED: nothing ran
            reply = await behavior(request, context)
            authorizer.answered(method, request, reply, principal)
            return reply
        except AtomlogError as error:
            code = error.code
            await context.abort(error.code, error.message, error.trailing_metadata())
        except NotImplementedError:
            code = grpc.StatusCode.UNIMPLEMENTED
            error = AtomlogError("UNIMPLEMENTED", f"{method} is not implemented by this server")
            await context.abort(error.code, error.message, error.trailing_metadata())
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except Exception as unhandled:  # a bug (logged whole), or ZooKeeper gone
            error = unexpected(unhandled, method)
            code = error.code
            if error.reason == "INTERNAL":
                log.exception("unhandled error in %s", method)
            await context.abort(error.code, error.message, error.trailing_metadata())
        finally:
            metrics.RPC_IN_FLIGHT.dec()
            latency.observe(time.perf_counter() - started)
            if code is grpc.StatusCode.OK:
                handled_ok.inc()
            else:
                metrics.RPC_HANDLED.labels(method, code.name).inc()
                event(log, "rpc failed", logging.DEBUG, method=method, code=code.name)

    return wrapped
