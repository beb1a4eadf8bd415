"""Typed errors for client callers.

The server ends every failed RPC with a ``google.rpc.Status`` whose ``ErrorInfo`` carries an
UPPER_SNAKE reason (and the offending field in its metadata). Callers should branch on
``RolloutError.reason`` rather than parse messages, so every ``grpc.RpcError`` that leaves the
client is turned into a :class:`RolloutError` here. A job rejected inside the stream (a
``rejected`` frame) converts to the same type, so both paths read alike.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "rollout.v1"
_DETAILS_KEY = "grpc-status-details-bin"
_CODES_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}

# Codes after which re-opening the same stream can succeed: the transport broke or the server
# went away (restart, graceful shutdown). Everything else is a verdict about the request.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# gRPC core reports some broken connections (a write racing a reset) as INTERNAL or UNKNOWN
# "Internal error from Core". The server's own failures always carry an ErrorInfo, so these
# codes without one came from the transport and are as retryable as UNAVAILABLE.
_TRANSPORT_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class RolloutError(Exception):
    """An RPC failure or a rejected job, with the server's machine-readable reason."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, field: str = "",
                 *, violations: list[tuple[str, str]] | None = None,
                 from_server: bool = True) -> None:
        super().__init__(f"{code.name} {reason}: {message}")
        self.code = code
        self.reason = reason
        """UPPER_SNAKE reason from the ErrorInfo detail (the code's name when there is none)."""
        self.message = message
        self.field = field
        """Dotted path of the offending request field, when one field is to blame."""
        self.violations = violations or []
        """``(field, description)`` pairs from a ``BadRequest`` detail."""
        self.from_server = from_server
        """False when no rollout.v1 ErrorInfo came with it: the transport or gRPC itself
        (connection reset, message too large) produced the status."""

    @property
    def retryable(self) -> bool:
        """Re-opening the same stream may succeed (the link or the server went away)."""
        return self.code in RETRYABLE_CODES or (
            not self.from_server and self.code in _TRANSPORT_CODES)

    def one_line(self) -> str:
        """The form the command line prints: ``CODE REASON: message``."""
        return f"{self.code.name} {self.reason}: {self.message}"

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> RolloutError:
        call: Any = err
        code = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
        message = (call.details() if callable(getattr(call, "details", None)) else "") or ""
        reason, field, violations, from_server = code.name, "", [], False
        status = _rich_status(call)
        if status is not None:
            message = status.message or message
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason = info.reason or reason
                    field = info.metadata.get("field", field)
                    from_server = info.domain == DOMAIN
                elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    detail.Unpack(bad)
                    violations += [(v.field, v.description) for v in bad.field_violations]
        return cls(code, reason, message, field, violations=violations,
                   from_server=from_server)

    @classmethod
    def from_rejected(cls, rejected: Any) -> RolloutError:
        """From a stream ``JobRejected`` frame (its code is a google.rpc.Code number)."""
        code = _CODES_BY_VALUE.get(rejected.code, grpc.StatusCode.UNKNOWN)
        return cls(code, rejected.reason or code.name, rejected.message, rejected.field)


def _rich_status(call: Any) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` from the trailers. ``rpc_status.from_call`` raises when the
    status line and the detail disagree (a proxy rewrote the message); the detail bytes are
    still what matter then, so fall back to reading them directly."""
    try:
        return rpc_status.from_call(call)
    except Exception:
        pass
    try:
        trailers = call.trailing_metadata()
    except Exception:
        return None
    for key, value in trailers or ():
        if key == _DETAILS_KEY:
            try:
                return status_pb2.Status.FromString(value)
            except Exception:
                return None
    return None
