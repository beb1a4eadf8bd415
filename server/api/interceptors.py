"""Server interceptors: authentication, roles, request ids, undecodable input, and
exception -> status mapping.

One interceptor wraps every method handler so these hold for unary and streaming RPCs alike.
Health stays open without a credential (load balancers), and so does reflection while it is
enabled (``server.api.reflection``), so grpcurl's ``list`` works on a locked-down server.

Who the caller is (``server.tenancy.auth``) is decided inside the call, where the TLS peer is known,
and kept in ``auth.current`` for the servicers. BackendService needs the admin role.

A request the deserializer cannot parse becomes INVALID_ARGUMENT here, logged at debug level:
left to gRPC it is a logged traceback and UNKNOWN per frame, which a fuzzing client turns into
a log flood.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from rollout.runtime.types import InvalidArgument
from rollout.server.api import errors
from rollout.server.tenancy import auth

log = logging.getLogger(__name__)

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""The current RPC's request id (from ``x-request-id`` metadata, or generated)."""

_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
_ADMIN_PREFIXES = ("/rollout.v1.BackendService/",)
MAX_REQUEST_ID = 64


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth_token: str = "", *,
                 authenticator: auth.Authenticator | None = None) -> None:
        self._auth = authenticator or auth.Authenticator(auth_token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        # Reflection is only registered while server.api.reflection is on; off, its methods do
        # not exist and gRPC answers UNIMPLEMENTED before any handler runs.
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        given = str(metadata.get("x-request-id") or "")
        # Echoed into trailers and logs: keep what a client sends there short and printable.
        rid = given if given and len(given) <= MAX_REQUEST_ID and given.isprintable() \
            else uuid.uuid4().hex[:16]
        return _wrap(handler, rid, details.method, self._auth, metadata)


class _Undecodable:
    """Stands in for a request the deserializer rejected; the wrapper answers it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
            return _Undecodable(exc)
    return parse


def _undecodable(req: _Undecodable) -> InvalidArgument:
    log.debug("undecodable request: %r", req.error)
    return InvalidArgument("the request is not a valid protobuf message of this RPC's request "
                           "type (check the client's generated code and the method name)",
                           "UNDECODABLE_REQUEST")


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for req in requests:
        if isinstance(req, _Undecodable):
            raise _undecodable(req)
        yield req


def _wrap(handler: grpc.RpcMethodHandler, rid: str, method: str,
          authenticator: auth.Authenticator, metadata: dict[str, Any]) -> grpc.RpcMethodHandler:
    async def prologue(context: grpc.aio.ServicerContext) -> None:
        request_id.set(rid)
        context.set_trailing_metadata((("x-request-id", rid),))
        try:
            principal = authenticator.authenticate(metadata, context.auth_context())
            if method.startswith(_ADMIN_PREFIXES) and not principal.admin:
                raise errors.PermissionDenied(
                    f"{method} needs the admin role; client {principal.client_id!r} does not "
                    "have it (roles = [\"admin\"] in its server.clients entry)", "ADMIN_REQUIRED")
        except errors.ServiceError as exc:
            await errors.abort(context, exc)
        auth.current.set(principal)

    async def on_error(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AbortError | grpc.aio.UsageError):
            raise exc
        log.debug("%s [%s] failed: %r", method, rid, exc)
        await errors.abort(context, exc)

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await prologue(context)
            try:
                if isinstance(request, _Undecodable):
                    raise _undecodable(request)
                if hasattr(request, "__aiter__"):
                    request = _checked(request)
                return await behavior(request, context)
            except Exception as exc:  # mapped to a status; AbortError re-raised as is
                await on_error(context, exc)
        return wrapped

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await prologue(context)
            try:
                if isinstance(request, _Undecodable):
                    raise _undecodable(request)
                if hasattr(request, "__aiter__"):
                    request = _checked(request)
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
            unary(handler.unary_unary), _tolerant(handler.request_deserializer),
            handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            unary(handler.stream_unary), _tolerant(handler.request_deserializer),
            handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            streaming(handler.unary_stream), _tolerant(handler.request_deserializer),
            handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(
        streaming(handler.stream_stream), _tolerant(handler.request_deserializer),
        handler.response_serializer)
