"""Server interceptor: the one place where errors become gRPC statuses, and where
every call is counted and timed. Servicers raise `AtomlogError` and stay thin."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services import metrics
from services.errors import AtomlogError, unexpected
from services.logs import event

log = logging.getLogger("atomlog.rpc")


class ErrorsAndMetricsInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler  # unknown method (gRPC answers UNIMPLEMENTED) or a stream
        return grpc.unary_unary_rpc_method_handler(
            _wrap(handler_call_details.method, handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _wrap(method: str, behavior):
    async def wrapped(request, context: grpc.aio.ServicerContext):
        metrics.RPC_STARTED.labels(method).inc()
        metrics.RPC_IN_FLIGHT.inc()
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await behavior(request, context)
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
            metrics.RPC_LATENCY.labels(method).observe(time.perf_counter() - started)
            metrics.RPC_HANDLED.labels(method, code.name).inc()
            if code not in (grpc.StatusCode.OK,):
                event(log, "rpc failed", logging.DEBUG, method=method, code=code.name)

    return wrapped
