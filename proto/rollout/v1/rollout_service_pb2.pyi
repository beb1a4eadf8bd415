import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollout.v1 import job_pb2 as _job_pb2
from rollout.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishedJobPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISHED_JOB_POLICY_UNSPECIFIED: _ClassVar[FinishedJobPolicy]
    FINISHED_JOB_POLICY_REPORT: _ClassVar[FinishedJobPolicy]
    FINISHED_JOB_POLICY_REPLAY: _ClassVar[FinishedJobPolicy]
    FINISHED_JOB_POLICY_REJECT: _ClassVar[FinishedJobPolicy]
FINISHED_JOB_POLICY_UNSPECIFIED: FinishedJobPolicy
FINISHED_JOB_POLICY_REPORT: FinishedJobPolicy
FINISHED_JOB_POLICY_REPLAY: FinishedJobPolicy
FINISHED_JOB_POLICY_REJECT: FinishedJobPolicy

class StreamRolloutsRequest(_message.Message):
    __slots__ = ("open", "submit", "ack", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    submit: SubmitJobs
    ack: AckTrajectories
    cancel: CancelJobs
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., submit: _Optional[_Union[SubmitJobs, _Mapping]] = ..., ack: _Optional[_Union[AckTrajectories, _Mapping]] = ..., cancel: _Optional[_Union[CancelJobs, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("client_id", "acked_through", "max_unacked", "heartbeat_interval", "progress", "store_id", "batch_progress", "batch_frames")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    MAX_UNACKED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FRAMES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    acked_through: int
    max_unacked: int
    heartbeat_interval: _duration_pb2.Duration
    progress: bool
    store_id: str
    batch_progress: bool
    batch_frames: bool
    def __init__(self, client_id: _Optional[str] = ..., acked_through: _Optional[int] = ..., max_unacked: _Optional[int] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., progress: _Optional[bool] = ..., store_id: _Optional[str] = ..., batch_progress: _Optional[bool] = ..., batch_frames: _Optional[bool] = ...) -> None: ...

class SubmitJobs(_message.Message):
    __slots__ = ("jobs", "if_finished")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    IF_FINISHED_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_job_pb2.JobSpec]
    if_finished: FinishedJobPolicy
    def __init__(self, jobs: _Optional[_Iterable[_Union[_job_pb2.JobSpec, _Mapping]]] = ..., if_finished: _Optional[_Union[FinishedJobPolicy, str]] = ...) -> None: ...

class AckTrajectories(_message.Message):
    __slots__ = ("delivery_ids",)
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelJobs(_message.Message):
    __slots__ = ("job_ids", "group_ids")
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_ids: _Optional[_Iterable[str]] = ..., group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamRolloutsResponse(_message.Message):
    __slots__ = ("sequence", "job_id", "opened", "accepted", "rejected", "progress", "progress_batch", "trajectory", "finished", "heartbeat", "batch")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_BATCH_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    job_id: str
    opened: SessionOpened
    accepted: JobAccepted
    rejected: JobRejected
    progress: StageProgress
    progress_batch: ProgressBatch
    trajectory: TrajectoryReady
    finished: JobFinished
    heartbeat: Heartbeat
    batch: FrameBatch
    def __init__(self, sequence: _Optional[int] = ..., job_id: _Optional[str] = ..., opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., accepted: _Optional[_Union[JobAccepted, _Mapping]] = ..., rejected: _Optional[_Union[JobRejected, _Mapping]] = ..., progress: _Optional[_Union[StageProgress, _Mapping]] = ..., progress_batch: _Optional[_Union[ProgressBatch, _Mapping]] = ..., trajectory: _Optional[_Union[TrajectoryReady, _Mapping]] = ..., finished: _Optional[_Union[JobFinished, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., batch: _Optional[_Union[FrameBatch, _Mapping]] = ...) -> None: ...

class FrameBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[StreamRolloutsResponse]
    def __init__(self, frames: _Optional[_Iterable[_Union[StreamRolloutsResponse, _Mapping]]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("client_id", "replaying", "server_version", "store_id", "store_changed", "acked_through")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAYING_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_CHANGED_FIELD_NUMBER: _ClassVar[int]
    ACKED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    replaying: int
    server_version: str
    store_id: str
    store_changed: bool
    acked_through: int
    def __init__(self, client_id: _Optional[str] = ..., replaying: _Optional[int] = ..., server_version: _Optional[str] = ..., store_id: _Optional[str] = ..., store_changed: _Optional[bool] = ..., acked_through: _Optional[int] = ...) -> None: ...

class JobAccepted(_message.Message):
    __slots__ = ("duplicate", "state")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    state: _job_pb2.Job.State
    def __init__(self, duplicate: _Optional[bool] = ..., state: _Optional[_Union[_job_pb2.Job.State, str]] = ...) -> None: ...

class JobRejected(_message.Message):
    __slots__ = ("code", "reason", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class StageProgress(_message.Message):
    __slots__ = ("stage", "event", "elapsed", "turns", "output_tokens", "tool_calls")
    class Event(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EVENT_UNSPECIFIED: _ClassVar[StageProgress.Event]
        EVENT_STARTED: _ClassVar[StageProgress.Event]
        EVENT_FINISHED: _ClassVar[StageProgress.Event]
        EVENT_TURN: _ClassVar[StageProgress.Event]
    EVENT_UNSPECIFIED: StageProgress.Event
    EVENT_STARTED: StageProgress.Event
    EVENT_FINISHED: StageProgress.Event
    EVENT_TURN: StageProgress.Event
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    stage: _job_pb2.Stage
    event: StageProgress.Event
    elapsed: _duration_pb2.Duration
    turns: int
    output_tokens: int
    tool_calls: int
    def __init__(self, stage: _Optional[_Union[_job_pb2.Stage, str]] = ..., event: _Optional[_Union[StageProgress.Event, str]] = ..., elapsed: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., turns: _Optional[int] = ..., output_tokens: _Optional[int] = ..., tool_calls: _Optional[int] = ...) -> None: ...

class ProgressBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[JobProgress]
    def __init__(self, events: _Optional[_Iterable[_Union[JobProgress, _Mapping]]] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("job_id", "progress")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    progress: StageProgress
    def __init__(self, job_id: _Optional[str] = ..., progress: _Optional[_Union[StageProgress, _Mapping]] = ...) -> None: ...

class TrajectoryReady(_message.Message):
    __slots__ = ("delivery_id", "trajectory", "resubmitted")
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    RESUBMITTED_FIELD_NUMBER: _ClassVar[int]
    delivery_id: int
    trajectory: _trajectory_pb2.Trajectory
    resubmitted: bool
    def __init__(self, delivery_id: _Optional[int] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., resubmitted: _Optional[bool] = ...) -> None: ...

class JobFinished(_message.Message):
    __slots__ = ("state", "error", "reward")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    state: _job_pb2.Job.State
    error: _job_pb2.JobError
    reward: float
    def __init__(self, state: _Optional[_Union[_job_pb2.Job.State, str]] = ..., error: _Optional[_Union[_job_pb2.JobError, _Mapping]] = ..., reward: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("server_time", "jobs_in_flight", "unacked", "acked_through", "held_back")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    JOBS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UNACKED_FIELD_NUMBER: _ClassVar[int]
    ACKED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    HELD_BACK_FIELD_NUMBER: _ClassVar[int]
    server_time: _timestamp_pb2.Timestamp
    jobs_in_flight: int
    unacked: int
    acked_through: int
    held_back: int
    def __init__(self, server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., jobs_in_flight: _Optional[int] = ..., unacked: _Optional[int] = ..., acked_through: _Optional[int] = ..., held_back: _Optional[int] = ...) -> None: ...

class SubmitRolloutRequest(_message.Message):
    __slots__ = ("job", "batch_progress")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.JobSpec
    batch_progress: bool
    def __init__(self, job: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., batch_progress: _Optional[bool] = ...) -> None: ...

class SubmitRolloutResponse(_message.Message):
    __slots__ = ("accepted", "progress", "progress_batch", "trajectory", "finished")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_BATCH_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    accepted: JobAccepted
    progress: StageProgress
    progress_batch: ProgressBatch
    trajectory: _trajectory_pb2.Trajectory
    finished: JobFinished
    def __init__(self, accepted: _Optional[_Union[JobAccepted, _Mapping]] = ..., progress: _Optional[_Union[StageProgress, _Mapping]] = ..., progress_batch: _Optional[_Union[ProgressBatch, _Mapping]] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., finished: _Optional[_Union[JobFinished, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id", "include_trajectory", "include_text")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    include_trajectory: bool
    include_text: bool
    def __init__(self, job_id: _Optional[str] = ..., include_trajectory: _Optional[bool] = ..., include_text: _Optional[bool] = ...) -> None: ...

class TurnText(_message.Message):
    __slots__ = ("prompt", "output", "observation")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[str]
    output: _containers.RepeatedScalarFieldContainer[str]
    observation: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt: _Optional[_Iterable[str]] = ..., output: _Optional[_Iterable[str]] = ..., observation: _Optional[_Iterable[str]] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job", "trajectory", "timings", "text")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    trajectory: _trajectory_pb2.Trajectory
    timings: _trajectory_pb2.StageTimings
    text: _containers.RepeatedCompositeFieldContainer[TurnText]
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., timings: _Optional[_Union[_trajectory_pb2.StageTimings, _Mapping]] = ..., text: _Optional[_Iterable[_Union[TurnText, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state", "group_id", "client_id")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: _job_pb2.Job.State
    group_id: str
    client_id: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[_job_pb2.Job.State, str]] = ..., group_id: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_job_pb2.Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_job_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("cancelled_job_ids",)
    CANCELLED_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    cancelled_job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cancelled_job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetServerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage", "queue_depth", "in_flight", "workers", "completed", "failed", "latency_p50", "latency_p95", "throughput_per_second")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P95_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    stage: _job_pb2.Stage
    queue_depth: int
    in_flight: int
    workers: int
    completed: int
    failed: int
    latency_p50: _duration_pb2.Duration
    latency_p95: _duration_pb2.Duration
    throughput_per_second: float
    def __init__(self, stage: _Optional[_Union[_job_pb2.Stage, str]] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., workers: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., latency_p50: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., latency_p95: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., throughput_per_second: _Optional[float] = ...) -> None: ...

class NodeStageStatus(_message.Message):
    __slots__ = ("stage", "capacity", "busy")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    stage: _job_pb2.Stage
    capacity: int
    busy: int
    def __init__(self, stage: _Optional[_Union[_job_pb2.Stage, str]] = ..., capacity: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("name", "address", "pid", "alive", "slots", "held", "stages", "jobs_assigned", "jobs_done")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    JOBS_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    JOBS_DONE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    pid: int
    alive: bool
    slots: int
    held: int
    stages: _containers.RepeatedCompositeFieldContainer[NodeStageStatus]
    jobs_assigned: int
    jobs_done: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., alive: _Optional[bool] = ..., slots: _Optional[int] = ..., held: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[NodeStageStatus, _Mapping]]] = ..., jobs_assigned: _Optional[int] = ..., jobs_done: _Optional[int] = ...) -> None: ...

class GetServerStatusResponse(_message.Message):
    __slots__ = ("version", "uptime", "stages", "jobs_by_state", "environments", "sessions", "jobs_by_termination", "nodes")
    class JobsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class JobsByTerminationEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    JOBS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    JOBS_BY_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime: _duration_pb2.Duration
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    jobs_by_state: _containers.ScalarMap[str, int]
    environments: _containers.RepeatedScalarFieldContainer[str]
    sessions: int
    jobs_by_termination: _containers.ScalarMap[str, int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, version: _Optional[str] = ..., uptime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., jobs_by_state: _Optional[_Mapping[str, int]] = ..., environments: _Optional[_Iterable[str]] = ..., sessions: _Optional[int] = ..., jobs_by_termination: _Optional[_Mapping[str, int]] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...
