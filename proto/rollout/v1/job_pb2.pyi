import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollout.v1 import tasks_pb2 as _tasks_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogprobsKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_KIND_UNSPECIFIED: _ClassVar[LogprobsKind]
    LOGPROBS_KIND_PROCESSED: _ClassVar[LogprobsKind]
    LOGPROBS_KIND_RAW: _ClassVar[LogprobsKind]

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_INIT: _ClassVar[Stage]
    STAGE_RUN: _ClassVar[Stage]
    STAGE_EVAL: _ClassVar[Stage]
LOGPROBS_KIND_UNSPECIFIED: LogprobsKind
LOGPROBS_KIND_PROCESSED: LogprobsKind
LOGPROBS_KIND_RAW: LogprobsKind
STAGE_UNSPECIFIED: Stage
STAGE_INIT: Stage
STAGE_RUN: Stage
STAGE_EVAL: Stage

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens_per_turn", "total_token_budget", "seed", "stop", "stop_token_ids", "logprobs_mode", "max_response_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens_per_turn: int
    total_token_budget: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs_mode: LogprobsKind
    max_response_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens_per_turn: _Optional[int] = ..., total_token_budget: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs_mode: _Optional[_Union[LogprobsKind, str]] = ..., max_response_tokens: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_turns", "init_timeout", "run_timeout", "eval_timeout", "tool_timeout")
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    INIT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    RUN_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    EVAL_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    max_turns: int
    init_timeout: _duration_pb2.Duration
    run_timeout: _duration_pb2.Duration
    eval_timeout: _duration_pb2.Duration
    tool_timeout: _duration_pb2.Duration
    def __init__(self, max_turns: _Optional[int] = ..., init_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., run_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., eval_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., tool_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GroupSpec(_message.Message):
    __slots__ = ("group_id", "size", "finish_after")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FINISH_AFTER_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    size: int
    finish_after: int
    def __init__(self, group_id: _Optional[str] = ..., size: _Optional[int] = ..., finish_after: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job_id", "environment", "task", "sampling", "limits", "group", "priority", "min_policy_version", "metadata", "chat", "math", "code", "swe")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MATH_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    SWE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    environment: str
    task: _struct_pb2.Struct
    sampling: SamplingParams
    limits: Limits
    group: GroupSpec
    priority: int
    min_policy_version: int
    metadata: _containers.ScalarMap[str, str]
    chat: ChatOptions
    math: _tasks_pb2.MathTask
    code: _tasks_pb2.CodeTask
    swe: _tasks_pb2.SweTask
    def __init__(self, job_id: _Optional[str] = ..., environment: _Optional[str] = ..., task: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., group: _Optional[_Union[GroupSpec, _Mapping]] = ..., priority: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., chat: _Optional[_Union[ChatOptions, _Mapping]] = ..., math: _Optional[_Union[_tasks_pb2.MathTask, _Mapping]] = ..., code: _Optional[_Union[_tasks_pb2.CodeTask, _Mapping]] = ..., swe: _Optional[_Union[_tasks_pb2.SweTask, _Mapping]] = ...) -> None: ...

class ChatOptions(_message.Message):
    __slots__ = ("tool_call_format", "chat_template_kwargs")
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    tool_call_format: str
    chat_template_kwargs: _struct_pb2.Struct
    def __init__(self, tool_call_format: _Optional[str] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("code", "reason", "message", "stage")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[JobError.Code]
        CODE_TIMEOUT: _ClassVar[JobError.Code]
        CODE_HANDLER_ERROR: _ClassVar[JobError.Code]
        CODE_SANDBOX_ERROR: _ClassVar[JobError.Code]
        CODE_BACKEND_UNAVAILABLE: _ClassVar[JobError.Code]
        CODE_INVALID_TASK: _ClassVar[JobError.Code]
        CODE_CANCELLED: _ClassVar[JobError.Code]
        CODE_INTERNAL: _ClassVar[JobError.Code]
    CODE_UNSPECIFIED: JobError.Code
    CODE_TIMEOUT: JobError.Code
    CODE_HANDLER_ERROR: JobError.Code
    CODE_SANDBOX_ERROR: JobError.Code
    CODE_BACKEND_UNAVAILABLE: JobError.Code
    CODE_INVALID_TASK: JobError.Code
    CODE_CANCELLED: JobError.Code
    CODE_INTERNAL: JobError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    code: JobError.Code
    reason: str
    message: str
    stage: Stage
    def __init__(self, code: _Optional[_Union[JobError.Code, str]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., stage: _Optional[_Union[Stage, str]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "stage", "attempts", "error", "reward", "client_id", "create_time", "update_time")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Job.State]
        STATE_QUEUED: _ClassVar[Job.State]
        STATE_RUNNING: _ClassVar[Job.State]
        STATE_SUCCEEDED: _ClassVar[Job.State]
        STATE_FAILED: _ClassVar[Job.State]
        STATE_CANCELLED: _ClassVar[Job.State]
    STATE_UNSPECIFIED: Job.State
    STATE_QUEUED: Job.State
    STATE_RUNNING: Job.State
    STATE_SUCCEEDED: Job.State
    STATE_FAILED: Job.State
    STATE_CANCELLED: Job.State
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: Job.State
    stage: Stage
    attempts: int
    error: JobError
    reward: float
    client_id: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[Job.State, str]] = ..., stage: _Optional[_Union[Stage, str]] = ..., attempts: _Optional[int] = ..., error: _Optional[_Union[JobError, _Mapping]] = ..., reward: _Optional[float] = ..., client_id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
