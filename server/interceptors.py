"""Server interceptors: bearer-token auth, request ids, and exception -> status mapping.

One interceptor wraps every method handler so the three concerns hold for unary and
streaming RPCs alike. Health and reflection stay open without a token, so load balancers and
grpcurl's ``list`` work on a locked-down server.
"""

from __future__ import annotations

import contextvars
import hmac
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from rollout.server import errors

log = logging.getLogger(__name__)

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""The current RPC's request id (from ``x-request-id`` metadata, or generated)."""

_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth_token: str = "") -> None:
        self._token = auth_token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        rid = str(metadata.get("x-request-id") or uuid.uuid4().hex[:16])
        denial = self._check_auth(metadata)
        return _wrap(handler, rid, denial, details.method)

    def _check_auth(self, metadata: dict[str, Any]) -> errors.Unauthenticated | None:
        if not self._token:
            return None
        given = str(metadata.get("authorization", ""))
        if not given.startswith("Bearer "):
            return errors.Unauthenticated(
                "missing 'authorization: Bearer <token>' metadata", "MISSING_TOKEN")
        if not hmac.compare_digest(given[len("Bearer "):].encode(), self._token):
            return errors.Unauthenticated("the bearer token is wrong", "BAD_TOKEN")
        return None


def _wrap(handler: grpc.RpcMethodHandler, rid: str, denial: Exception | None,
          method: str) -> grpc.RpcMethodHandler:
    async def prologue(context: grpc.aio.ServicerContext) -> None:
        request_id.set(rid)
        context.set_trailing_metadata((("x-request-id", rid),))
        if denial is not None:
            await errors.abort(context, denial)

    async def on_error(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AbortError | grpc.aio.UsageError):
            raise exc
        log.debug("%s [%s] failed: %r", method, rid, exc)
        await errors.abort(context, exc)

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await prologue(context)
            try:
                return await behavior(request, context)
            except Exception as exc:  # mapped to a status; AbortError re-raised as is
                await on_error(context, exc)
        return wrapped

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await prologue(context)
            try:
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:
                    await result
            except Exception as exc:
                await on_error(context, exc)
        return wrapped

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            unary(handler.stream_unary), handler.request_deserializer,
            handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            streaming(handler.unary_stream), handler.request_deserializer,
            handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(
        streaming(handler.stream_stream), handler.request_deserializer,
        handler.response_serializer)
