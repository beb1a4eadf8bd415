"""gRPC ``rollout.v1.BackendService``: a thin translation between proto and the backend pool.

Every failure ends through ``server.api.errors`` (``google.rpc.Status`` with an ``ErrorInfo``,
domain ``rollout.v1``), so it works with or without the server's error-mapping interceptor.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from rollout.runtime.types import InvalidArgument
from rollout.server.api import errors
from rollout.server.llm.backend_pool import BackendInfo, BackendPool
from rollout.server.llm.engine import Engine, EngineError
from rollout.server.llm.http_engine import HttpEngine
from rollout.v1 import backend_service_pb2 as pb
from rollout.v1 import backend_service_pb2_grpc as pb_grpc

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KINDS = {"http": pb.BACKEND_KIND_HTTP, "in_process": pb.BACKEND_KIND_IN_PROCESS,
          "managed_vllm": pb.BACKEND_KIND_MANAGED_VLLM, "ScriptedEngine": pb.BACKEND_KIND_SCRIPTED}
_PROTOCOLS = {pb.HTTP_PROTOCOL_UNSPECIFIED: "generate", pb.HTTP_PROTOCOL_GENERATE: "generate",
              pb.HTTP_PROTOCOL_COMPLETIONS: "completions"}


class AlreadyExists(errors.AlreadyExists):
    default_reason = "BACKEND_ALREADY_EXISTS"


def backend_to_proto(info: BackendInfo) -> pb.Backend:
    if info.draining:
        state = pb.Backend.STATE_DRAINING
    elif info.healthy:
        state = pb.Backend.STATE_HEALTHY
    else:
        state = pb.Backend.STATE_EJECTED
    added = timestamp_pb2.Timestamp()
    added.FromNanoseconds(int(info.added_at * 1e9))
    return pb.Backend(
        name=info.name, kind=_KINDS.get(info.kind, pb.BACKEND_KIND_UNSPECIFIED),
        address=info.address, model=info.model, weight=info.weight, state=state,
        in_flight=info.in_flight, policy_version=info.policy_version,
        served_turns=info.served, failures=info.failures, last_error=info.last_error,
        sessions=info.sessions, add_time=added)


class BackendServicer(pb_grpc.BackendServiceServicer):
    """Serves ``BackendService`` over a :class:`BackendPool`.

    ``in_process_factory(model_dir, device, name)`` builds an in-process engine (defaults to
    :class:`TransformersEngine`; the model load runs off the event loop).
    """

    def __init__(self, pool: BackendPool, *, admission_timeout_s: float = 30.0,
                 in_process_factory: Callable[[Path, str, str], Engine] | None = None,
                 vllm_executable: list[str] | None = None, vllm_log_dir: Path | None = None
                 ) -> None:
        self.pool = pool
        self.admission_timeout_s = admission_timeout_s
        self._in_process_factory = in_process_factory
        self._vllm_executable = vllm_executable
        self._vllm_log_dir = vllm_log_dir

    async def _guard(self, context: grpc.aio.ServicerContext, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except (errors.ServiceError, InvalidArgument) as exc:
            await errors.abort(context, exc)
        except EngineError as exc:
            await errors.abort(context, errors.Unavailable(str(exc), "BACKEND_UNAVAILABLE"))
        except NotImplementedError as exc:
            await errors.abort(context, errors.FailedPrecondition(
                str(exc), "BACKEND_CANNOT_UPDATE_WEIGHTS"))

    # ----------------------------------------------------------------- AddBackend
    async def AddBackend(self, request: pb.AddBackendRequest,
                         context: grpc.aio.ServicerContext) -> pb.AddBackendResponse:
        return await self._guard(context, self._add(request))  # type: ignore[no-any-return]

    async def _add(self, request: pb.AddBackendRequest) -> pb.AddBackendResponse:
        name = request.name
        if not _NAME.match(name):
            raise InvalidArgument("name must be 1-64 characters of letters, digits, '.', '-', "
                                  f"'_', starting with a letter or digit; got {name!r}",
                                  "INVALID_BACKEND_NAME", "name")
        if request.weight < 0:
            raise InvalidArgument(f"weight must be >= 0, got {request.weight}",
                                  "INVALID_BACKEND_WEIGHT", "weight")
        if any(b.name == name for b in self.pool.backends()):
            raise AlreadyExists(f"a backend named {name!r} is already in the pool",
                                field="name")
        source = request.WhichOneof("source")
        if source is None:
            raise InvalidArgument("one of http, in_process or managed_vllm is required",
                                  "MISSING_BACKEND_SOURCE", "source")
        engine = await getattr(self, f"_make_{source}")(request, name)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # arrives as the probe answers (gh-86296), and a cancelled AddBackend would still
            # add its engine to the pool.
            async with asyncio.timeout(self.admission_timeout_s):
                healthy = await engine.health()
        except TimeoutError:
            healthy = False
        except asyncio.CancelledError:
            # The caller went away: the engine (a launched vLLM process, a loaded model) is
            # nobody's now, so free it before passing the cancel on.
            await asyncio.shield(engine.close())
            raise
        if not healthy:
            await engine.close()
            raise errors.Unavailable(f"backend {name!r} did not answer its health probe",
                                     "BACKEND_UNHEALTHY")
        try:
            self.pool.add(engine, weight=request.weight or 1.0)
        except KeyError as exc:  # lost a race with a concurrent AddBackend of the same name
            await engine.close()
            raise AlreadyExists(str(exc), field="name") from exc
        return pb.AddBackendResponse(backend=backend_to_proto(self.pool.info(self.pool.get(name))))

    async def _make_http(self, request: pb.AddBackendRequest, name: str) -> Engine:
        spec = request.http
        if not re.match(r"^https?://[^/\s]+", spec.url):
            raise InvalidArgument(f"http.url must be an http(s) URL, got {spec.url!r}",
                                  "INVALID_BACKEND_URL", "http.url")
        if not spec.model:
            raise InvalidArgument("http.model is required", "MISSING_MODEL", "http.model")
        if spec.policy_version < 0:
            raise InvalidArgument("http.policy_version must be >= 0", "INVALID_POLICY_VERSION",
                                  "http.policy_version")
        return HttpEngine(spec.url, spec.model, name=name, tokenizer=self.pool.tokenizer,
                          protocol=_PROTOCOLS.get(spec.protocol, "generate"),
                          policy_version=spec.policy_version)

    async def _make_in_process(self, request: pb.AddBackendRequest, name: str) -> Engine:
        spec = request.in_process
        device = spec.device or "cpu"
        loop = asyncio.get_running_loop()
        if spec.model_path:
            model_dir = Path(spec.model_path)
            if not await loop.run_in_executor(None, (model_dir / "config.json").is_file):
                raise errors.FailedPrecondition(f"no model checkpoint at {model_dir}",
                                                "MODEL_NOT_FOUND", "in_process.model_path")
        else:
            from rollout.server.llm.smollm2 import smollm2_dir

            model_dir = await loop.run_in_executor(None, smollm2_dir)
        factory = self._in_process_factory or _transformers_engine
        return await loop.run_in_executor(None, factory, model_dir, device, name)

    async def _make_managed_vllm(self, request: pb.AddBackendRequest, name: str) -> Engine:
        from rollout.server.llm.vllm_launcher import VllmNotInstalled, launch_vllm, vllm_executable

        spec = request.managed_vllm
        if not spec.model:
            raise InvalidArgument("managed_vllm.model is required", "MISSING_MODEL",
                                  "managed_vllm.model")
        if not 0 <= spec.port < 65536:
            raise InvalidArgument("managed_vllm.port must be in [0, 65535]", "INVALID_PORT",
                                  "managed_vllm.port")
        executable = self._vllm_executable or vllm_executable()
        if executable is None:
            raise errors.FailedPrecondition("vllm is not installed on the server",
                                            "VLLM_NOT_INSTALLED", "managed_vllm")
        timeout = spec.startup_timeout.ToTimedelta().total_seconds() \
            if spec.HasField("startup_timeout") else 600.0
        try:
            return await launch_vllm(spec.model, name=name, port=spec.port,
                                     extra_args=list(spec.extra_args), executable=executable,
                                     startup_timeout_s=timeout, log_dir=self._vllm_log_dir,
                                     tokenizer=self.pool.tokenizer)
        except VllmNotInstalled as exc:
            raise errors.FailedPrecondition(str(exc), "VLLM_NOT_INSTALLED") from exc
        except (RuntimeError, TimeoutError) as exc:
            raise errors.Unavailable(str(exc), "BACKEND_UNHEALTHY") from exc

    # ----------------------------------------------------------------- other RPCs
    async def RemoveBackend(self, request: pb.RemoveBackendRequest,
                            context: grpc.aio.ServicerContext) -> pb.RemoveBackendResponse:
        async def run() -> pb.RemoveBackendResponse:
            if not request.name:
                raise InvalidArgument("name is required", "MISSING_BACKEND_NAME", "name")
            try:
                backend = self.pool.remove(request.name)
            except KeyError as exc:
                raise errors.NotFound(f"no backend named {request.name!r}",
                                      "BACKEND_NOT_FOUND", "name") from exc
            return pb.RemoveBackendResponse(backend=backend_to_proto(self.pool.info(backend)))
        return await self._guard(context, run())  # type: ignore[no-any-return]

    async def ListBackends(self, request: pb.ListBackendsRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListBackendsResponse:
        async def run() -> pb.ListBackendsResponse:
            if request.page_size < 0:
                raise InvalidArgument("page_size must be >= 0", "INVALID_PAGE_SIZE",
                                      "page_size")
            start = 0
            if request.page_token:
                if not request.page_token.isdigit():
                    raise InvalidArgument("page_token is not one this server issued",
                                          "INVALID_PAGE_TOKEN", "page_token")
                start = int(request.page_token)
            infos = self.pool.backends()
            end = len(infos) if request.page_size == 0 else start + request.page_size
            page = infos[start:end]
            return pb.ListBackendsResponse(
                backends=[backend_to_proto(i) for i in page],
                next_page_token=str(end) if end < len(infos) else "")
        return await self._guard(context, run())  # type: ignore[no-any-return]

    def _targets(self, names: list[str]) -> list[str]:
        known = {b.name for b in self.pool.backends()}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise errors.NotFound(f"no backend named {unknown[0]!r}", "BACKEND_NOT_FOUND",
                                  "backend_names")
        return names or sorted(known)

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest,
                            context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        async def run() -> pb.UpdateWeightsResponse:
            if not request.checkpoint_path:
                raise InvalidArgument("checkpoint_path is required", "MISSING_CHECKPOINT",
                                      "checkpoint_path")
            if request.policy_version < 0:
                raise InvalidArgument("policy_version must be >= 0", "INVALID_POLICY_VERSION",
                                      "policy_version")
            names = self._targets(list(request.backend_names))
            local = any(getattr(self.pool.get(n).engine, "kind", "") == "in_process"
                        for n in names)
            exists = await asyncio.to_thread(os.path.exists, request.checkpoint_path)
            if local and not exists:
                raise errors.NotFound(f"no checkpoint at {request.checkpoint_path}",
                                      "CHECKPOINT_NOT_FOUND", "checkpoint_path")
            start = time.monotonic()
            try:
                await self.pool.update_weights(Path(request.checkpoint_path),
                                               request.policy_version, names)
            except FileNotFoundError as exc:
                raise errors.NotFound(str(exc), "CHECKPOINT_NOT_FOUND",
                                      "checkpoint_path") from exc
            except ValueError as exc:
                raise errors.FailedPrecondition(str(exc), "CHECKPOINT_MISMATCH",
                                                "checkpoint_path") from exc
            took = duration_pb2.Duration()
            took.FromNanoseconds(int((time.monotonic() - start) * 1e9))
            return pb.UpdateWeightsResponse(backends=self._protos(names), duration=took)
        return await self._guard(context, run())  # type: ignore[no-any-return]

    async def SetPolicyVersion(self, request: pb.SetPolicyVersionRequest,
                               context: grpc.aio.ServicerContext
                               ) -> pb.SetPolicyVersionResponse:
        async def run() -> pb.SetPolicyVersionResponse:
            if request.policy_version < 0:
                raise InvalidArgument("policy_version must be >= 0", "INVALID_POLICY_VERSION",
                                      "policy_version")
            names = self._targets(list(request.backend_names))
            try:
                self.pool.set_policy_version(request.policy_version, names)
            except NotImplementedError as exc:
                raise errors.FailedPrecondition(str(exc), "BACKEND_LOADS_OWN_WEIGHTS",
                                                "backend_names") from exc
            return pb.SetPolicyVersionResponse(backends=self._protos(names))
        return await self._guard(context, run())  # type: ignore[no-any-return]

    def _protos(self, names: list[str]) -> list[pb.Backend]:
        return [backend_to_proto(self.pool.info(self.pool.get(n))) for n in names]


def _transformers_engine(model_dir: Path, device: str, name: str) -> Engine:
    from rollout.server.llm.transformers_engine import TransformersEngine

    return TransformersEngine(model_dir, device=device, name=name)
