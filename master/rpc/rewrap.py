"""Rebuild a gRPC method handler with its behaviour wrapped (for server interceptors)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc

Wrap = Callable[[Callable], Callable]
MAX_CACHED_HANDLERS = 1024  # far above the number of methods the master serves


def rewrap(
    handler: grpc.RpcMethodHandler,
    unary: Wrap | None = None,
    stream_in: Wrap | None = None,
) -> grpc.RpcMethodHandler:
    """The handler with `unary` around a unary-request behaviour (unary_unary, unary_stream)
    and `stream_in` around a stream-request one (stream_unary); other kinds as they are."""
    kinds = (
        ("unary_unary", unary, grpc.unary_unary_rpc_method_handler),
        ("unary_stream", unary, grpc.unary_stream_rpc_method_handler),
        ("stream_unary", stream_in, grpc.stream_unary_rpc_method_handler),
    )
    for attr, wrap, make in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            if wrap is None:
                return handler
            return make(
                wrap(behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class RewrapCache:
    """Rewrapped handlers kept per (method, original handler), so a call after the first pays a
    dict lookup instead of building a new handler (the server asks interceptors on every call).

    The original handler is kept alive in the cache, so its id() is never reused."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(
        self,
        method: str,
        handler: grpc.RpcMethodHandler,
        build: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler],
    ) -> grpc.RpcMethodHandler:
        key = (method, id(handler))
        hit = self._cache.get(key)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = build(handler)
        # Bounded: refused calls (a wrong token) may name any method at all.
        if len(self._cache) < MAX_CACHED_HANDLERS:
            # A dict assignment is atomic: racing first calls both build, one entry stays.
            self._cache[key] = (handler, wrapped)
        return wrapped


def by_kind(sync_wrap: Wrap, async_wrap: Wrap) -> Wrap:
    """A wrap that puts `async_wrap` around coroutine behaviours (the aio server's inline
    handlers) and `sync_wrap` around the others (which it runs in a thread pool)."""
    return lambda b: async_wrap(b) if inspect.iscoroutinefunction(b) else sync_wrap(b)


class AioInterceptor(grpc.aio.ServerInterceptor):
    """A sync server interceptor (built on `rewrap` with `by_kind` wraps) on the aio server."""

    def __init__(self, interceptor: grpc.ServerInterceptor) -> None:
        self._interceptor = interceptor

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return self._interceptor.intercept_service(lambda _: handler, handler_call_details)
