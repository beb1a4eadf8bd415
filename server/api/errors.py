"""The one place that maps exceptions to gRPC status codes with rich error details.

Every RPC failure ends with a ``google.rpc.Status`` carrying a ``google.rpc.ErrorInfo`` (domain
``rollout.v1``, an UPPER_SNAKE reason, and the offending field in its metadata) and, for bad
requests, a ``BadRequest`` field violation, so clients can branch on the reason rather than
parse messages.

Mapping (STYLE.md): bad request -> INVALID_ARGUMENT; unknown thing -> NOT_FOUND; job not in a
cancellable state -> FAILED_PRECONDITION; backend or sandbox down -> UNAVAILABLE; overload or
quota -> RESOURCE_EXHAUSTED; no credential -> UNAUTHENTICATED; a credential that may not do
this -> PERMISSION_DENIED; broken invariant -> INTERNAL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout.runtime.llm import LLMUnavailable
from rollout.runtime.types import InvalidArgument

DOMAIN = "rollout.v1"
log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with a definite status code; raise it anywhere in the server."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"

    def __init__(self, message: str, reason: str | None = None, field: str = "") -> None:
        super().__init__(message)
        self.reason = reason or self.default_reason
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    """The caller is known but may not do this (another client's job, a non-admin calling
    BackendService, a host path outside the configured roots)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class AlreadyExists(ServiceError):
    """A job id that another client owns, or a finished job re-submitted with REJECT."""

    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED
    default_reason = "ABORTED"


@dataclass(frozen=True)
class Mapped:
    code: grpc.StatusCode
    reason: str
    message: str
    field: str = ""


# Reasons that mean "the named thing does not exist" rather than "the value is malformed".
_NOT_FOUND_REASONS = {"UNKNOWN_ENVIRONMENT"}
# Reasons that mean "well-formed, but the operator's configuration does not allow it".
_PERMISSION_REASONS = {"PATH_NOT_ALLOWED"}


def classify(exc: BaseException) -> Mapped:
    """Map any exception to a status code, reason and message."""
    if isinstance(exc, ServiceError):
        return Mapped(exc.code, exc.reason, str(exc), exc.field)
    if isinstance(exc, InvalidArgument):
        code = (grpc.StatusCode.NOT_FOUND if exc.reason in _NOT_FOUND_REASONS
                else grpc.StatusCode.PERMISSION_DENIED if exc.reason in _PERMISSION_REASONS
                else grpc.StatusCode.INVALID_ARGUMENT)
        return Mapped(code, exc.reason, str(exc), exc.field)
    if isinstance(exc, LLMUnavailable):
        return Mapped(grpc.StatusCode.UNAVAILABLE, "BACKEND_UNAVAILABLE", str(exc))
    log.exception("internal error", exc_info=exc)
    return Mapped(grpc.StatusCode.INTERNAL, "INTERNAL",
                  f"internal error: {type(exc).__name__}: {exc}")


def to_status(m: Mapped) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=m.reason, domain=DOMAIN)
    if m.field:
        info.metadata["field"] = m.field
    details = [info]
    if m.code == grpc.StatusCode.INVALID_ARGUMENT and m.field:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=m.field, description=m.message)]))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    status = status_pb2.Status(code=getattr(code_pb2, m.code.name), message=m.message,
                               details=packed)
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status for ``exc`` (raises, as ``context.abort`` does)."""
    await context.abort_with_status(to_status(classify(exc)))

