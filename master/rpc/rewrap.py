"""Rebuild a gRPC method handler with its behaviour wrapped (for server interceptors)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import grpc

Wrap = Callable[[Callable], Callable]
MAX_CACHED_HANDLERS = 1024  # far above the number of methods the master serves


def rewrap(
    handler: grpc.RpcMethodHandler,
    unary: Wrap | None = None,
    stream_in: Wrap | None = None,
    bidi: Wrap | None = None,
) -> grpc.RpcMethodHandler:
    """The handler with `unary` around a unary-request behaviour (unary_unary, unary_stream),
    `stream_in` around a stream-request one (stream_unary) and `bidi` around a stream_stream
    one; a kind without its wrap as it is."""
    kinds = (
        ("unary_unary", unary, grpc.unary_unary_rpc_method_handler),
        ("unary_stream", unary, grpc.unary_stream_rpc_method_handler),
        ("stream_unary", stream_in, grpc.stream_unary_rpc_method_handler),
        ("stream_stream", bidi, grpc.stream_stream_rpc_method_handler),
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


class RewrappingInterceptor(grpc.ServerInterceptor):
    """A server interceptor that wraps each method's handler once (`rewrap_handler`, given the
    full method name) and then serves the wrapped handler from a `RewrapCache`."""

    def __init__(self) -> None:
        self._wrapped = RewrapCache()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return self._wrapped.get(method, handler, lambda h: self.rewrap_handler(method, h))

    def rewrap_handler(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler of `method` with this interceptor's wraps around its behaviour."""
        raise NotImplementedError


def async_gen_only(async_wrap: Wrap) -> Wrap:
    """A wrap for the aio server's async-generator behaviours (its answers on a bidirectional
    stream); other behaviours as they are."""
    return lambda b: async_wrap(b) if inspect.isasyncgenfunction(b) else b


def by_kind(sync_wrap: Wrap, async_wrap: Wrap) -> Wrap:
    """A wrap that puts `async_wrap` around coroutine behaviours (the aio server's inline
    handlers) and `sync_wrap` around the others (which it runs in a thread pool)."""
    return lambda b: async_wrap(b) if inspect.iscoroutinefunction(b) else sync_wrap(b)


class InterceptedHandlers(grpc.GenericRpcHandler):
    """The services registered on it, behind sync server interceptors that run as plain calls
    when a call's handler is looked up (on the aio server: no coroutine per interceptor and
    call, as `grpc.aio` interceptors would cost). Fits interceptors that decide from the
    method and metadata alone and wrap behaviours (built on `rewrap` with `by_kind` wraps)."""

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor]) -> None:
        self._handlers: list[grpc.GenericRpcHandler] = []
        lookup = self._lookup
        for interceptor in reversed(interceptors):
            lookup = functools.partial(interceptor.intercept_service, lookup)
        self._intercepted = lookup

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Register services, as on a server (generated `add_*Servicer_to_server` call it)."""
        self._handlers.extend(handlers)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return self._intercepted(handler_call_details)

    def _lookup(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        for handlers in self._handlers:
            handler = handlers.service(handler_call_details)
            if handler is not None:
                return handler
        return None
