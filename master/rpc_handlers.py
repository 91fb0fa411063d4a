"""Rebuild a gRPC method handler with its behaviour wrapped (for server interceptors)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

Wrap = Callable[[Callable], Callable]


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
