"""Per-peer request rate limits on the master's gRPC port (a token bucket per client address)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc

from master.rpc.rewrap import RewrappingInterceptor, async_gen_only, by_kind, rewrap

# A node makes a few calls a second (heartbeat, shard asks); its step reports ride one stream.
DEFAULT_RATE_PER_SECOND = 500.0
DEFAULT_BURST = 1000.0
# Peers not seen for this long are forgotten, so the table stays small.
IDLE_FORGET_SECONDS = 300.0


class TokenBuckets:
    """One token bucket per key: `rate` tokens a second, at most `burst` saved up."""

    def __init__(
        self,
        rate: float = DEFAULT_RATE_PER_SECOND,
        burst: float = DEFAULT_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got rate={rate} burst={burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._lock = threading.Lock()
        self._next_sweep = clock() + IDLE_FORGET_SECONDS

    def take(self, key: str) -> bool:
        """Spend one token of `key`'s bucket; False when it is empty (the caller is too fast)."""
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            if now >= self._next_sweep:
                self._sweep(now)
            return allowed

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + IDLE_FORGET_SECONDS
        stale = [k for k, (_, last) in self._buckets.items() if now - last > IDLE_FORGET_SECONDS]
        for k in stale:
            del self._buckets[k]


class RateLimitInterceptor(RewrappingInterceptor):
    """Answers RESOURCE_EXHAUSTED to a client connection that calls faster than its bucket
    allows (a node keeps one connection to the master, so this is a per-node budget)."""

    def __init__(self, buckets: TokenBuckets) -> None:
        super().__init__()
        self._buckets = buckets

    def rewrap_handler(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        buckets = self._buckets
        too_fast = f"more than {buckets.rate:g} requests/s from this client; slow down"

        def limited(behavior: Callable) -> Callable:
            def call(request_or_iterator: object, context: grpc.ServicerContext) -> object:
                if not buckets.take(context.peer()):
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_fast)
                return behavior(request_or_iterator, context)

            return call

        def limited_async(behavior: Callable) -> Callable:
            async def call(request_or_iterator: object, context: grpc.ServicerContext) -> object:
                if not buckets.take(context.peer()):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_fast)
                return await behavior(request_or_iterator, context)

            return call

        def limited_each_async(behavior: Callable) -> Callable:
            # On a bidirectional stream each message counts as a call (each is an ask).
            async def call(requests: AsyncIterator, context: grpc.aio.ServicerContext):
                async def each() -> AsyncIterator:
                    async for request in requests:
                        if not buckets.take(context.peer()):
                            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_fast)
                        yield request

                async for reply in behavior(each(), context):
                    yield reply

            return call

        wrap = by_kind(limited, limited_async)
        return rewrap(handler, unary=wrap, stream_in=wrap, bidi=async_gen_only(limited_each_async))
