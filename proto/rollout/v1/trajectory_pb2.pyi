import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from rollout.v1 import job_pb2 as _job_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_DEADLINE: _ClassVar[FinishReason]
    FINISH_REASON_PREEMPTED: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class TerminationReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TERMINATION_REASON_UNSPECIFIED: _ClassVar[TerminationReason]
    TERMINATION_REASON_SUBMITTED: _ClassVar[TerminationReason]
    TERMINATION_REASON_NO_TOOL_CALL: _ClassVar[TerminationReason]
    TERMINATION_REASON_MAX_TURNS: _ClassVar[TerminationReason]
    TERMINATION_REASON_TOKEN_BUDGET: _ClassVar[TerminationReason]
    TERMINATION_REASON_CONTEXT_LENGTH: _ClassVar[TerminationReason]
    TERMINATION_REASON_DEADLINE: _ClassVar[TerminationReason]
    TERMINATION_REASON_CANCELLED: _ClassVar[TerminationReason]
    TERMINATION_REASON_ERROR: _ClassVar[TerminationReason]
    TERMINATION_REASON_WORKSPACE_TOO_LARGE: _ClassVar[TerminationReason]
    TERMINATION_REASON_WORKSPACE_UNGRADABLE: _ClassVar[TerminationReason]
    TERMINATION_REASON_EVAL_TIMEOUT: _ClassVar[TerminationReason]
    TERMINATION_REASON_HARNESS_ERROR: _ClassVar[TerminationReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_DEADLINE: FinishReason
FINISH_REASON_PREEMPTED: FinishReason
FINISH_REASON_ABORT: FinishReason
TERMINATION_REASON_UNSPECIFIED: TerminationReason
TERMINATION_REASON_SUBMITTED: TerminationReason
TERMINATION_REASON_NO_TOOL_CALL: TerminationReason
TERMINATION_REASON_MAX_TURNS: TerminationReason
TERMINATION_REASON_TOKEN_BUDGET: TerminationReason
TERMINATION_REASON_CONTEXT_LENGTH: TerminationReason
TERMINATION_REASON_DEADLINE: TerminationReason
TERMINATION_REASON_CANCELLED: TerminationReason
TERMINATION_REASON_ERROR: TerminationReason
TERMINATION_REASON_WORKSPACE_TOO_LARGE: TerminationReason
TERMINATION_REASON_WORKSPACE_UNGRADABLE: TerminationReason
TERMINATION_REASON_EVAL_TIMEOUT: TerminationReason
TERMINATION_REASON_HARNESS_ERROR: TerminationReason

class Turn(_message.Message):
    __slots__ = ("prompt_ids", "output_ids", "output_logprobs", "observation_ids", "loss_mask", "policy_version", "backend", "latency", "tool_calls", "finish_reason", "preempted_retries", "routed_experts", "routed_expert_top_k", "routed_expert_layers")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_RETRIES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    observation_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    policy_version: int
    backend: str
    latency: _duration_pb2.Duration
    tool_calls: _containers.RepeatedScalarFieldContainer[str]
    finish_reason: FinishReason
    preempted_retries: int
    routed_experts: _containers.RepeatedScalarFieldContainer[int]
    routed_expert_top_k: int
    routed_expert_layers: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., observation_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., policy_version: _Optional[int] = ..., backend: _Optional[str] = ..., latency: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., tool_calls: _Optional[_Iterable[str]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., preempted_retries: _Optional[int] = ..., routed_experts: _Optional[_Iterable[int]] = ..., routed_expert_top_k: _Optional[int] = ..., routed_expert_layers: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("init_queue", "init", "run_queue", "run", "eval_queue", "eval")
    INIT_QUEUE_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    RUN_QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    EVAL_QUEUE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    init_queue: _duration_pb2.Duration
    init: _duration_pb2.Duration
    run_queue: _duration_pb2.Duration
    run: _duration_pb2.Duration
    eval_queue: _duration_pb2.Duration
    eval: _duration_pb2.Duration
    def __init__(self, init_queue: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., init: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., run_queue: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., run: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., eval_queue: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., eval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("job_id", "group_id", "turns", "reward", "reward_components", "termination_reason", "timings", "metadata", "state", "error", "labels", "seed", "logprobs_kind", "segments")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_KIND_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    termination_reason: TerminationReason
    timings: StageTimings
    metadata: _containers.ScalarMap[str, str]
    state: _job_pb2.Job.State
    error: _job_pb2.JobError
    labels: _containers.ScalarMap[str, str]
    seed: int
    logprobs_kind: _job_pb2.LogprobsKind
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., termination_reason: _Optional[_Union[TerminationReason, str]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[_job_pb2.Job.State, str]] = ..., error: _Optional[_Union[_job_pb2.JobError, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., seed: _Optional[int] = ..., logprobs_kind: _Optional[_Union[_job_pb2.LogprobsKind, str]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("first_turn", "reason", "parent", "branch_point", "side_call")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Segment.Reason]
        REASON_FIRST: _ClassVar[Segment.Reason]
        REASON_HISTORY_REWRITTEN: _ClassVar[Segment.Reason]
        REASON_NEW_CONVERSATION: _ClassVar[Segment.Reason]
        REASON_PARALLEL: _ClassVar[Segment.Reason]
    REASON_UNSPECIFIED: Segment.Reason
    REASON_FIRST: Segment.Reason
    REASON_HISTORY_REWRITTEN: Segment.Reason
    REASON_NEW_CONVERSATION: Segment.Reason
    REASON_PARALLEL: Segment.Reason
    FIRST_TURN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_POINT_FIELD_NUMBER: _ClassVar[int]
    SIDE_CALL_FIELD_NUMBER: _ClassVar[int]
    first_turn: int
    reason: Segment.Reason
    parent: int
    branch_point: int
    side_call: bool
    def __init__(self, first_turn: _Optional[int] = ..., reason: _Optional[_Union[Segment.Reason, str]] = ..., parent: _Optional[int] = ..., branch_point: _Optional[int] = ..., side_call: _Optional[bool] = ...) -> None: ...
