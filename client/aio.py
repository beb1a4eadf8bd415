"""The async Rollout Service client.

``RolloutClient`` owns one grpc.aio channel. Unary helpers (``get_job``, ``list_jobs``,
``cancel``, ``status``) and ``submit_rollout`` serve tools and simple scripts; trainers open a
:class:`rollout.client.session.Session` with :meth:`RolloutClient.session`, which resumes by itself
after a dropped connection.

Every call carries ``authorization: Bearer <token>`` (when a token is set) and its own
``x-request-id`` so a failing call can be found in the server's log. Call credentials are not
used because gRPC only sends them over TLS channels, and the service is commonly reached over
a plain channel on a cluster network. Every ``grpc.RpcError`` leaves as a
:class:`rollout.client.errors.RolloutError`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc

from rollout.client.errors import RolloutError
from rollout.client.session import Session
from rollout.client.specs import SpecLike, job_spec
from rollout.v1 import job_pb2, rollout_service_pb2_grpc
from rollout.v1 import rollout_service_pb2 as pb

DEFAULT_ADDRESS = "127.0.0.1:50051"


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Must match ``rollout.server.app.channel_options`` (copied: the client may not import the
    server). The keepalive ping interval must not be shorter than the server's
    ``min_ping_interval_without_data_ms``, or the server answers GOAWAY ``too_many_pings``."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class RolloutClient:
    """Async client; use as ``async with RolloutClient(addr) as client: ...``."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, token: str | None = None,
                 max_message_bytes: int = 64 << 20, timeout_s: float | None = 30.0) -> None:
        self.address = address
        self.token = token or None
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        """Deadline of unary calls; streams have none (they live as long as the session)."""
        self._channel: grpc.aio.Channel | None = None
        self._stub: rollout_service_pb2_grpc.RolloutServiceStub | None = None

    async def __aenter__(self) -> RolloutClient:
        self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def connect(self) -> None:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                self.address, options=channel_options(self.max_message_bytes))
            self._stub = rollout_service_pb2_grpc.RolloutServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    @property
    def stub(self) -> rollout_service_pb2_grpc.RolloutServiceStub:
        if self._stub is None:
            self.connect()
        assert self._stub is not None
        return self._stub

    def metadata(self) -> list[tuple[str, str]]:
        md = [("x-request-id", uuid.uuid4().hex[:16])]
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        return md

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self.metadata(), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise RolloutError.from_rpc_error(err) from None

    # ------------------------------------------------------------------ unary RPCs

    async def get_job(self, job_id: str, *, include_trajectory: bool = False,
                      include_text: bool = False) -> pb.GetJobResponse:
        """``include_text``: also the trajectory's tokens decoded by the server's tokenizer
        (``GetJobResponse.text``), for a caller without the model."""
        return await self._unary(self.stub.GetJob, pb.GetJobRequest(
            job_id=job_id, include_trajectory=include_trajectory, include_text=include_text))

    async def list_jobs(self, *, state: job_pb2.Job.State | int | str = 0, group_id: str = "",
                        client_id: str = "", page_size: int = 100, limit: int | None = None
                        ) -> AsyncIterator[job_pb2.Job]:
        """Every matching job, newest first, fetching pages as the caller iterates."""
        if isinstance(state, str):
            name = state.upper()
            state = job_pb2.Job.State.Value(name if name.startswith("STATE_")
                                            else "STATE_" + name)
        state = cast(job_pb2.Job.State, state)
        token, seen = "", 0
        while True:
            page = await self._unary(self.stub.ListJobs, pb.ListJobsRequest(
                page_size=page_size, page_token=token, state=state, group_id=group_id,
                client_id=client_id))
            for job in page.jobs:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield job
            token = page.next_page_token
            if not token:
                return

    async def cancel(self, *, job_id: str = "", group_id: str = "") -> list[str]:
        """Cancel one job or a group's unfinished jobs; returns the cancelled job ids."""
        if bool(job_id) == bool(group_id):
            raise ValueError("pass exactly one of job_id or group_id")
        req = (pb.CancelJobRequest(job_id=job_id) if job_id
               else pb.CancelJobRequest(group_id=group_id))
        resp = await self._unary(self.stub.CancelJob, req)
        return list(resp.cancelled_job_ids)

    async def status(self) -> pb.GetServerStatusResponse:
        return await self._unary(self.stub.GetServerStatus, pb.GetServerStatusRequest())

    # ------------------------------------------------------------------ streams

    async def submit_rollout(
            self, spec: SpecLike, *, progress: bool = True, batch_progress: bool = True,
            on_wire: Callable[[pb.SubmitRolloutResponse], None] | None = None,
    ) -> AsyncIterator[pb.SubmitRolloutResponse]:
        """One job, its progress and its result, without a session (nothing to acknowledge).
        Re-submitting the same job id re-attaches to the existing job.

        Yields ``accepted``, one ``progress`` frame per stage-progress event (with
        ``progress``), then ``trajectory`` and ``finished``. ``batch_progress`` (default on)
        lets the server send the events that queued up while the caller was not reading in
        one ``progress_batch`` frame; they are unpacked here, in order, so callers see the
        same frames as from a server that does not batch. ``progress=False`` drops the
        progress frames (the server sends them regardless; batches make that cheap).
        ``on_wire`` sees every frame as it arrived, batches included.
        """
        call = self.stub.SubmitRollout(
            pb.SubmitRolloutRequest(job=job_spec(spec), batch_progress=batch_progress),
            metadata=self.metadata())
        try:
            async for frame in call:
                if on_wire is not None:
                    on_wire(frame)
                kind = frame.WhichOneof("kind")
                if kind in ("progress", "progress_batch") and not progress:
                    continue
                if kind == "progress_batch":
                    for event in frame.progress_batch.events:
                        yield pb.SubmitRolloutResponse(progress=event.progress)
                    continue
                yield frame
        except grpc.RpcError as err:
            raise RolloutError.from_rpc_error(err) from None
        finally:
            call.cancel()

    def session(self, client_id: str, *, progress: bool = False, batch_progress: bool = True,
                batch_frames: bool = True, max_unacked: int = 0, auto_ack: bool = False,
                heartbeat_s: float | None = None,
                max_reconnects: int = 10, backoff_s: tuple[float, float] = (0.05, 2.0),
                on_wire: Any = None) -> Session:
        """A ``StreamRollouts`` session; see :class:`rollout.client.session.Session`. Use it as an
        async context manager, or ``await session.start()`` and ``await session.aclose()``.
        With ``progress``, ``batch_progress`` lets the server send many progress events per
        frame; ``events()`` unpacks them, so callers see one progress frame per event.
        ``batch_frames`` lets the server write the frames that are ready together as one
        ``batch`` frame; ``events()`` unpacks those too."""
        return Session(self, client_id, progress=progress, batch_progress=batch_progress,
                       batch_frames=batch_frames,
                       max_unacked=max_unacked, auto_ack=auto_ack, heartbeat_s=heartbeat_s,
                       max_reconnects=max_reconnects, backoff_s=backoff_s, on_wire=on_wire)
