"""Registers the API's servicers on a gRPC server: the one place outside the servicers that
touches the generated ``*_pb2_grpc`` modules, so the bootstrap (``server/app.py``) stays free of
generated code and the layering test can hold every stub import to ``server/api``."""

from __future__ import annotations

from typing import Any

import grpc

from rollout.server.api.servicer import RolloutServicer
from rollout.v1 import (
    backend_service_pb2,
    backend_service_pb2_grpc,
    rollout_service_pb2,
    rollout_service_pb2_grpc,
)

ROLLOUT_SERVICE_NAME = rollout_service_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
BACKEND_SERVICE_NAME = backend_service_pb2.DESCRIPTOR.services_by_name["BackendService"].full_name


def add_rollout_service(server: grpc.aio.Server, servicer: RolloutServicer) -> str:
    """Serve ``rollout.v1.RolloutService`` on ``server``; returns its full name (for health and
    reflection)."""
    rollout_service_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    return ROLLOUT_SERVICE_NAME


def add_backend_service(server: grpc.aio.Server, pool: Any) -> str:
    """Serve ``rollout.v1.BackendService`` over the backend ``pool``; returns its full name."""
    from rollout.server.api.backends_servicer import BackendServicer

    backend_service_pb2_grpc.add_BackendServiceServicer_to_server(BackendServicer(pool), server)
    return BACKEND_SERVICE_NAME
