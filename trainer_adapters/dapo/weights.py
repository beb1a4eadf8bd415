"""Getting new weights to the rollout backends through ``BackendService``.

``update_weights`` (default): the trainer writes a safetensors checkpoint and asks the server to
hot-swap it (``UpdateWeights``): an in-process engine copies it into its model in place; an
HTTP backend is paused, told to load the directory (``rollout llm-serve``'s ``/update_weights``)
and resumed. The path must be readable by the server (same machine or a shared filesystem).
``set_version``: the weights reached the backends some other way (NCCL broadcast into vLLM,
for instance, by code the user adds); only the version label is moved (``SetPolicyVersion``).
Either way every later turn is labelled with the new version.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from rollout.client.errors import RolloutError
from rollout.v1 import backend_service_pb2 as pb
from rollout.v1 import backend_service_pb2_grpc as pb_grpc


class SharedWeights(Protocol):
    """Weights shared in-process with the serving engines (``rollout train`` with its own
    server): the engines serve the policy's own tensors, so there is no second copy of the
    model and no checkpoint to write and read back per step. Generation and the update never
    run at the same time: :meth:`pause` before the update, :meth:`publish` after it."""

    async def attach(self, model: Any) -> bool:
        """From now on the engines serve ``model``'s tensors (their own copy is freed); False
        where they cannot (another dtype or device), and weights are pushed as usual."""

    async def pause(self) -> None:
        """Stop admitting turns and wait for the running ones (the weights are about to
        change), dropping the KV caches meanwhile."""

    async def publish(self, version: int) -> None:
        """The tensors now hold ``version``: label later turns with it and resume."""


class WeightPusher:
    def __init__(self, address: str, *, token: str = "", mode: str = "update_weights",
                 backends: Sequence[str] = (), timeout_s: float = 600.0) -> None:
        if mode not in ("update_weights", "set_version"):
            raise ValueError(f"weight sync mode must be update_weights or set_version, "
                             f"got {mode!r}")
        self.address, self.mode, self.backends = address, mode, list(backends)
        self.timeout_s = timeout_s
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.BackendServiceStub(self._channel)

    async def served_version(self) -> int:
        """The highest policy version the targeted backends serve now (where a run resumes)."""
        try:
            reply = await self._stub.ListBackends(pb.ListBackendsRequest(),
                                                  metadata=self._metadata, timeout=30)
        except grpc.RpcError as err:
            raise RolloutError.from_rpc_error(err) from None
        versions = [b.policy_version for b in reply.backends
                    if not self.backends or b.name in self.backends]
        if not versions:
            raise RolloutError(grpc.StatusCode.FAILED_PRECONDITION, "NO_BACKENDS",
                               "the server has no LLM backend to train against; add one with "
                               "`rollout backends add`")
        return max(versions)

    async def push(self, checkpoint: Path, version: int) -> list[pb.Backend]:
        """``checkpoint``: an absolute directory path as the server sees it."""
        try:
            if self.mode == "update_weights":
                reply = await self._stub.UpdateWeights(pb.UpdateWeightsRequest(
                    checkpoint_path=str(checkpoint), policy_version=version,
                    backend_names=self.backends), metadata=self._metadata,
                    timeout=self.timeout_s)
            else:
                reply = await self._stub.SetPolicyVersion(pb.SetPolicyVersionRequest(
                    policy_version=version, backend_names=self.backends),
                    metadata=self._metadata, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise RolloutError.from_rpc_error(err) from None
        return list(reply.backends)

    async def close(self) -> None:
        await self._channel.close()
