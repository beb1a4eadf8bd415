"""Proto <-> domain conversion: the only place that knows both shapes.

``*_from_proto`` functions validate: a value a user could get wrong raises
:class:`rollout.runtime.types.InvalidArgument` naming the field, so the servicer can answer
INVALID_ARGUMENT with a reason instead of failing deep inside the pipeline.
"""

from __future__ import annotations

import re
from typing import Any, cast

from google.protobuf import struct_pb2
from google.protobuf.duration_pb2 import Duration

from rollout.runtime.types import (
    FINISH_REASONS,
    LOGPROBS_MODES,
    TEMPLATE_RESERVED_KWARGS,
    ChatOptions,
    GroupSpec,
    InvalidArgument,
    JobError,
    JobSpec,
    JobState,
    Limits,
    SamplingParams,
    Segment,
    SegmentReason,
    Stage,
    StageTimings,
    TerminationReason,
    Trajectory,
    Turn,
)
from rollout.server.api import typed_tasks
from rollout.v1 import job_pb2, trajectory_pb2

ID_RE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
"""Job, group and client ids. Always ``fullmatch``: ``re.match`` with ``$`` lets a trailing
newline through (``$`` matches before a final ``\n``)."""
JOB_ID_RE = ID_RE
MAX_TASK_BYTES = 1 << 20
MAX_METADATA_ENTRIES = 64
MAX_METADATA_BYTES = 16 << 10
"""Keys plus values of one job's metadata: it is stored with the job and sent back in every
GetJob and ListJobs answer, so it must stay small next to the message limit."""
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


_ID_REASONS = {"job_id": "INVALID_JOB_ID", "job_ids": "INVALID_JOB_ID",
               "group_id": "INVALID_GROUP_ID", "group_ids": "INVALID_GROUP_ID",
               "client_id": "INVALID_CLIENT_ID"}


def check_id(value: str, field: str, *, required: bool = True,
             reason: str | None = None) -> str:
    """A job / group / client id; the error never echoes more than 40 characters of it.
    The reason follows the kind of id (INVALID_JOB_ID for a job id in any RPC), so one
    check always answers with one reason."""
    reason = reason or _ID_REASONS.get(field.rsplit(".", 1)[-1], "INVALID_ID")
    if not value:
        if required:
            raise InvalidArgument(f"{field} is required", "MISSING_FIELD", field)
        return value
    if not ID_RE.fullmatch(value):
        raise InvalidArgument(
            f"{field} {value[:40]!r}{'...' if len(value) > 40 else ''} must be 1-128 "
            "characters of letters, digits and ._:/- (no whitespace or newline)",
            reason, field)
    return value


def _check_metadata(metadata: Any) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"metadata has {len(metadata)} entries; at most "
                              f"{MAX_METADATA_ENTRIES} are allowed", "METADATA_TOO_LARGE",
                              "metadata")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(f"metadata is {size} bytes (keys plus values); at most "
                              f"{MAX_METADATA_BYTES} are allowed: keep large payloads in the "
                              "task", "METADATA_TOO_LARGE", "metadata")
    return dict(metadata)

_STAGE_TO_PROTO = {Stage.INIT: job_pb2.STAGE_INIT, Stage.RUN: job_pb2.STAGE_RUN,
                   Stage.EVAL: job_pb2.STAGE_EVAL}
_STAGE_FROM_PROTO = {v: k for k, v in _STAGE_TO_PROTO.items()}
_STATE_TO_PROTO = {s: cast(job_pb2.Job.State, job_pb2.Job.State.Value("STATE_" + s.name))
                   for s in JobState}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}
_TERM_TO_PROTO = {t: trajectory_pb2.TerminationReason.Value("TERMINATION_REASON_" + t.name)
                  for t in TerminationReason}
_TERM_FROM_PROTO = {v: k for k, v in _TERM_TO_PROTO.items()}
_ERROR_CODES = {name.removeprefix("CODE_"): value
                for name, value in job_pb2.JobError.Code.items() if value}
_FINISH_TO_PROTO = {name: trajectory_pb2.FinishReason.Value("FINISH_REASON_" + name.upper())
                    for name in FINISH_REASONS}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
_LOGPROBS_TO_PROTO = {name: job_pb2.LogprobsKind.Value("LOGPROBS_KIND_" + name.upper())
                      for name in LOGPROBS_MODES}
_LOGPROBS_FROM_PROTO = {v: k for k, v in _LOGPROBS_TO_PROTO.items()}
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024


def stage_to_proto(stage: Stage | None) -> job_pb2.Stage:
    return _STAGE_TO_PROTO[stage] if stage else job_pb2.STAGE_UNSPECIFIED


def state_to_proto(state: JobState) -> job_pb2.Job.State:
    return _STATE_TO_PROTO[state]


def state_from_proto(value: int) -> JobState | None:
    """STATE_UNSPECIFIED means "any state" in filters and maps to None."""
    if value == job_pb2.Job.STATE_UNSPECIFIED:
        return None
    state = cast(job_pb2.Job.State, value)
    if state not in _STATE_FROM_PROTO:
        raise InvalidArgument(f"unknown job state {value}", "INVALID_ENUM_VALUE", "state")
    return _STATE_FROM_PROTO[state]


def seconds_to_duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def _duration_s(d: Duration, default: float) -> float:
    return d.ToNanoseconds() / 1e9 if (d.seconds or d.nanos) else default


# ----------------------------------------------------------------------------- job spec


_DEFAULT_SAMPLING = SamplingParams()
_DEFAULT_LIMITS = Limits()


def sampling_from_proto(p: job_pb2.SamplingParams) -> SamplingParams:
    if not p.ByteSize():  # unset (most submits): the defaults, valid by construction
        return _DEFAULT_SAMPLING
    base = _DEFAULT_SAMPLING
    sp = SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else base.temperature,
        top_p=p.top_p if p.HasField("top_p") else base.top_p,
        top_k=p.top_k if p.HasField("top_k") else base.top_k,
        max_tokens_per_turn=(p.max_tokens_per_turn if p.HasField("max_tokens_per_turn")
                             else base.max_tokens_per_turn),
        total_token_budget=(p.total_token_budget if p.HasField("total_token_budget")
                            else base.total_token_budget),
        seed=p.seed if p.HasField("seed") else None,
        max_response_tokens=(p.max_response_tokens if p.HasField("max_response_tokens")
                             else None),
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        logprobs_mode=_logprobs_mode_from_proto(p),
    )
    if (len(p.stop) > MAX_STOP_SEQUENCES or any(len(x) > MAX_STOP_CHARS for x in p.stop)
            or len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS):
        raise InvalidArgument(
            f"sampling: at most {MAX_STOP_SEQUENCES} stop strings of {MAX_STOP_CHARS} "
            f"characters and {MAX_STOP_TOKEN_IDS} stop_token_ids", "INVALID_SAMPLING_PARAMS",
            "sampling.stop")
    sp.validate()
    return sp


def _logprobs_mode_from_proto(p: job_pb2.SamplingParams) -> str:
    if not p.HasField("logprobs_mode"):
        return SamplingParams().logprobs_mode
    if p.logprobs_mode not in _LOGPROBS_FROM_PROTO:
        raise InvalidArgument(
            "sampling.logprobs_mode must be LOGPROBS_KIND_PROCESSED or LOGPROBS_KIND_RAW "
            "(leave it unset for the default, processed)", "INVALID_SAMPLING_PARAMS",
            "sampling.logprobs_mode")
    return _LOGPROBS_FROM_PROTO[p.logprobs_mode]


def logprobs_kind_to_proto(kind: str) -> job_pb2.LogprobsKind:
    return _LOGPROBS_TO_PROTO.get(kind, job_pb2.LOGPROBS_KIND_UNSPECIFIED)


def logprobs_kind_from_proto(value: int) -> str:
    return _LOGPROBS_FROM_PROTO.get(cast(job_pb2.LogprobsKind, value), "")


def sampling_to_proto(s: SamplingParams) -> job_pb2.SamplingParams:
    p = job_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        max_tokens_per_turn=s.max_tokens_per_turn, total_token_budget=s.total_token_budget,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        logprobs_mode=_LOGPROBS_TO_PROTO[s.logprobs_mode])
    if s.seed is not None:
        p.seed = s.seed
    if s.max_response_tokens is not None:
        p.max_response_tokens = s.max_response_tokens
    return p


def chat_from_proto(p: job_pb2.ChatOptions) -> ChatOptions:
    """Validate a job's chat options: a known tool-call format, bounded template kwargs that
    do not collide with the arguments the renderer sets itself."""
    from rollout.runtime.toolcalls import TOOL_CALL_FORMATS

    fmt = p.tool_call_format
    if fmt and fmt not in TOOL_CALL_FORMATS:
        raise InvalidArgument(
            f"chat.tool_call_format {fmt[:40]!r} is unknown; use one of "
            f"{', '.join(sorted(TOOL_CALL_FORMATS))}, or leave it empty to detect it from "
            "the chat template", "UNKNOWN_TOOL_CALL_FORMAT", "chat.tool_call_format")
    kwargs: dict[str, Any] = {}
    if p.HasField("chat_template_kwargs"):
        size = p.chat_template_kwargs.ByteSize()
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise InvalidArgument(
                f"chat.chat_template_kwargs is {size} bytes; the limit is "
                f"{MAX_TEMPLATE_KWARGS_BYTES}", "INVALID_CHAT_OPTIONS",
                "chat.chat_template_kwargs")
        kwargs = struct_to_python(p.chat_template_kwargs, "chat.chat_template_kwargs")
        clash = sorted(set(kwargs) & TEMPLATE_RESERVED_KWARGS)
        if clash:
            raise InvalidArgument(
                f"chat.chat_template_kwargs may not set {', '.join(clash)}: the renderer sets "
                "those itself", "INVALID_CHAT_OPTIONS", "chat.chat_template_kwargs")
    return ChatOptions(tool_call_format=fmt, template_kwargs=kwargs)


def chat_to_proto(c: ChatOptions) -> job_pb2.ChatOptions:
    p = job_pb2.ChatOptions(tool_call_format=c.tool_call_format)
    if c.template_kwargs:
        p.chat_template_kwargs.update(_jsonable(dict(c.template_kwargs)))
    return p


def limits_from_proto(p: job_pb2.Limits) -> Limits:
    if not p.ByteSize():
        return _DEFAULT_LIMITS
    base = _DEFAULT_LIMITS
    for name in ("init_timeout", "run_timeout", "eval_timeout", "tool_timeout"):
        d = getattr(p, name)
        if d.seconds < 0 or d.nanos < 0:
            raise InvalidArgument(f"limits.{name} must be positive", "INVALID_LIMITS",
                                  f"limits.{name}")
    limits = Limits(
        max_turns=p.max_turns if p.HasField("max_turns") else base.max_turns,
        init_timeout_s=_duration_s(p.init_timeout, base.init_timeout_s),
        run_timeout_s=_duration_s(p.run_timeout, base.run_timeout_s),
        eval_timeout_s=_duration_s(p.eval_timeout, base.eval_timeout_s),
        tool_timeout_s=_duration_s(p.tool_timeout, base.tool_timeout_s),
    )
    limits.validate()
    return limits


def limits_to_proto(limits: Limits) -> job_pb2.Limits:
    return job_pb2.Limits(
        max_turns=limits.max_turns,
        init_timeout=seconds_to_duration(limits.init_timeout_s),
        run_timeout=seconds_to_duration(limits.run_timeout_s),
        eval_timeout=seconds_to_duration(limits.eval_timeout_s),
        tool_timeout=seconds_to_duration(limits.tool_timeout_s))


def spec_from_proto(p: job_pb2.JobSpec) -> JobSpec:
    """Validate a submitted spec. Environment existence is checked by the scheduler."""
    if not p.job_id:
        raise InvalidArgument("job_id is required (a client-chosen idempotency key)",
                              "MISSING_FIELD", "job_id")
    check_id(p.job_id, "job_id")
    typed = p.WhichOneof("typed_task")
    environment = p.environment
    if typed is not None:
        implied = typed_tasks.ENVIRONMENTS[typed]
        if p.HasField("task"):
            raise InvalidArgument(f"set task or {typed}, not both", "INVALID_TASK", "task")
        if environment and environment != implied:
            raise InvalidArgument(f"a {typed} task runs in the {implied!r} environment, not "
                                  f"{environment[:40]!r}: leave environment empty or set it to "
                                  f"{implied!r}", "INVALID_TASK", "environment")
        environment = implied
    if not environment:
        raise InvalidArgument("environment is required, e.g. \"math\"", "MISSING_FIELD",
                              "environment")
    if typed is None and not p.HasField("task"):
        raise InvalidArgument("task is required (the environment's task payload, or a typed "
                              "task: math, code, swe)", "MISSING_FIELD", "task")
    task_bytes = getattr(p, typed).ByteSize() if typed else p.task.ByteSize()
    if task_bytes > MAX_TASK_BYTES:
        raise InvalidArgument(f"task is {task_bytes} bytes; the limit is {MAX_TASK_BYTES}",
                              "TASK_TOO_LARGE", typed or "task")
    task = (typed_tasks.typed_task(typed, getattr(p, typed)) if typed
            else struct_to_python(p.task, "task"))
    group = None
    if p.HasField("group"):
        g = p.group
        if not g.group_id:
            raise InvalidArgument("group.group_id is required when group is set",
                                  "MISSING_FIELD", "group.group_id")
        check_id(g.group_id, "group.group_id")
        if g.size < 0 or g.finish_after < 0:
            raise InvalidArgument("group.size and group.finish_after must not be negative",
                                  "INVALID_GROUP", "group")
        if g.size and g.finish_after > g.size:
            raise InvalidArgument(
                f"group.finish_after ({g.finish_after}) exceeds group.size ({g.size})",
                "INVALID_GROUP", "group.finish_after")
        group = GroupSpec(group_id=g.group_id, size=g.size or 1, finish_after=g.finish_after)
    if p.min_policy_version < 0:
        raise InvalidArgument("min_policy_version must not be negative", "INVALID_POLICY_VERSION",
                              "min_policy_version")
    return JobSpec(
        job_id=p.job_id,
        environment=environment,
        task=task,
        sampling=sampling_from_proto(p.sampling),
        limits=limits_from_proto(p.limits),
        group=group,
        priority=p.priority,
        min_policy_version=p.min_policy_version,
        metadata=_check_metadata(p.metadata),
        chat=chat_from_proto(p.chat),
    )


def spec_to_proto(spec: JobSpec) -> job_pb2.JobSpec:
    task = struct_pb2.Struct()
    task.update(_jsonable(spec.task))
    p = job_pb2.JobSpec(
        job_id=spec.job_id, environment=spec.environment, task=task,
        sampling=sampling_to_proto(spec.sampling), limits=limits_to_proto(spec.limits),
        priority=spec.priority, min_policy_version=spec.min_policy_version,
        metadata=dict(spec.metadata))
    if spec.chat != ChatOptions():
        p.chat.CopyFrom(chat_to_proto(spec.chat))
    if spec.group:
        p.group.CopyFrom(job_pb2.GroupSpec(group_id=spec.group.group_id, size=spec.group.size,
                                           finish_after=spec.group.finish_after))
    return p


def struct_to_python(s: struct_pb2.Struct, field: str) -> dict[str, Any]:
    """A Struct as plain Python values, integral numbers as int: Struct stores every number
    as a double, and task payloads should read the way they were written (``{"n": 3}`` stays
    3, not 3.0).

    Walks the message directly: ``json_format.MessageToDict`` does the same in far more
    Python per value, and every submitted job's task goes through here. A NaN or infinite
    number (which JSON cannot carry) is the caller's INVALID_TASK naming ``field``, not an
    error that would end the caller's stream."""
    return {k: _value(v, field) for k, v in s.fields.items()}


def _value(v: struct_pb2.Value, field: str) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        x = v.number_value
        if x != x or x in (float("inf"), float("-inf")):
            raise InvalidArgument(f"{field} holds a NaN or infinite number, which JSON cannot "
                                  "carry; send a finite number or a string", "INVALID_TASK",
                                  field)
        return int(x) if x.is_integer() and abs(x) < 2**53 else x
    if kind == "string_value":
        return v.string_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return {k: _value(x, field) for k, x in v.struct_value.fields.items()}
    if kind == "list_value":
        return [_value(x, field) for x in v.list_value.values]
    return None  # null_value, or a Value with nothing set (MessageToDict gives None too)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def spec_to_bytes(spec: JobSpec) -> bytes:
    return spec_to_proto(spec).SerializeToString()


def spec_from_bytes(data: bytes) -> JobSpec:
    p = job_pb2.JobSpec()
    p.ParseFromString(data)
    return spec_from_proto(p)


# ----------------------------------------------------------------------------- errors


def job_error_to_proto(err: JobError | None) -> job_pb2.JobError | None:
    if err is None:
        return None
    return job_pb2.JobError(code=_ERROR_CODES.get(err.code, job_pb2.JobError.CODE_INTERNAL),
                            reason=err.reason, message=err.message,
                            stage=stage_to_proto(err.stage))


def job_error_from_proto(p: job_pb2.JobError) -> JobError:
    code = job_pb2.JobError.Code.Name(p.code).removeprefix("CODE_")
    return JobError(code=code, reason=p.reason, message=p.message,
                    stage=_STAGE_FROM_PROTO.get(p.stage))


# ----------------------------------------------------------------------------- trajectories


def timings_to_proto(t: StageTimings) -> trajectory_pb2.StageTimings:
    return trajectory_pb2.StageTimings(
        init_queue=seconds_to_duration(t.init_queue_s), init=seconds_to_duration(t.init_s),
        run_queue=seconds_to_duration(t.run_queue_s), run=seconds_to_duration(t.run_s),
        eval_queue=seconds_to_duration(t.eval_queue_s), eval=seconds_to_duration(t.eval_s))


def timings_from_proto(p: trajectory_pb2.StageTimings) -> StageTimings:
    return StageTimings(
        init_queue_s=_duration_s(p.init_queue, 0.0), init_s=_duration_s(p.init, 0.0),
        run_queue_s=_duration_s(p.run_queue, 0.0), run_s=_duration_s(p.run, 0.0),
        eval_queue_s=_duration_s(p.eval_queue, 0.0), eval_s=_duration_s(p.eval, 0.0))


def turn_to_proto(t: Turn) -> trajectory_pb2.Turn:
    return trajectory_pb2.Turn(
        prompt_ids=t.prompt_ids, output_ids=t.output_ids, output_logprobs=t.output_logprobs,
        observation_ids=t.observation_ids, loss_mask=t.loss_mask,
        policy_version=t.policy_version,
        finish_reason=_FINISH_TO_PROTO.get(t.finish_reason,
                                           trajectory_pb2.FINISH_REASON_UNSPECIFIED),
        backend=t.backend, latency=seconds_to_duration(t.latency_s), tool_calls=t.tool_calls,
        preempted_retries=t.preempted_retries, routed_experts=t.routed_experts,
        routed_expert_top_k=t.routed_expert_top_k,
        routed_expert_layers=t.routed_expert_layers)


def turn_from_proto(p: trajectory_pb2.Turn) -> Turn:
    return Turn(
        prompt_ids=list(p.prompt_ids), output_ids=list(p.output_ids),
        output_logprobs=list(p.output_logprobs), observation_ids=list(p.observation_ids),
        policy_version=p.policy_version,
        finish_reason=_FINISH_FROM_PROTO.get(p.finish_reason, ""), backend=p.backend,
        latency_s=_duration_s(p.latency, 0.0), tool_calls=list(p.tool_calls),
        preempted_retries=p.preempted_retries, trained=_output_trained(p),
        routed_experts=list(p.routed_experts), routed_expert_top_k=p.routed_expert_top_k,
        routed_expert_layers=p.routed_expert_layers)


def _output_trained(p: trajectory_pb2.Turn) -> bool:
    """False when the turn's loss mask holds 0 on every output token (a side call's turn)."""
    if not p.output_ids or not p.loss_mask:
        return True
    start = len(p.prompt_ids)
    return any(p.loss_mask[start:start + len(p.output_ids)])


def trajectory_to_proto(t: Trajectory) -> trajectory_pb2.Trajectory:
    p = trajectory_pb2.Trajectory(
        job_id=t.job_id, group_id=t.group_id, turns=[turn_to_proto(x) for x in t.turns],
        reward=t.reward, reward_components=t.reward_components,
        termination_reason=_TERM_TO_PROTO[t.termination], timings=timings_to_proto(t.timings),
        metadata=t.metadata, labels=t.labels,
        state=state_to_proto(t.state) if t.state else job_pb2.Job.STATE_UNSPECIFIED,
        logprobs_kind=logprobs_kind_to_proto(t.logprobs_kind),
        segments=[segment_to_proto(s) for s in t.segments])
    err = job_error_to_proto(t.error)
    if err is not None:
        p.error.CopyFrom(err)
    if t.seed is not None:
        p.seed = t.seed
    return p


def trajectory_from_proto(p: trajectory_pb2.Trajectory) -> Trajectory:
    return Trajectory(
        job_id=p.job_id, group_id=p.group_id, turns=[turn_from_proto(x) for x in p.turns],
        reward=p.reward, reward_components=dict(p.reward_components),
        termination=_TERM_FROM_PROTO.get(p.termination_reason, TerminationReason.ERROR),
        timings=timings_from_proto(p.timings), metadata=dict(p.metadata),
        state=_STATE_FROM_PROTO.get(p.state), labels=dict(p.labels),
        error=job_error_from_proto(p.error) if p.HasField("error") else None,
        seed=p.seed if p.HasField("seed") else None,
        logprobs_kind=logprobs_kind_from_proto(p.logprobs_kind),
        segments=[segment_from_proto(s) for s in p.segments])


_SEGMENT_TO_PROTO = {
    SegmentReason.FIRST: trajectory_pb2.Segment.REASON_FIRST,
    SegmentReason.HISTORY_REWRITTEN: trajectory_pb2.Segment.REASON_HISTORY_REWRITTEN,
    SegmentReason.NEW_CONVERSATION: trajectory_pb2.Segment.REASON_NEW_CONVERSATION,
    SegmentReason.PARALLEL: trajectory_pb2.Segment.REASON_PARALLEL}
_SEGMENT_FROM_PROTO = {v: k for k, v in _SEGMENT_TO_PROTO.items()}


def segment_to_proto(s: Segment) -> trajectory_pb2.Segment:
    p = trajectory_pb2.Segment(first_turn=s.first_turn, reason=_SEGMENT_TO_PROTO[s.reason],
                               branch_point=s.branch_point, side_call=s.side_call)
    if s.parent is not None:
        p.parent = s.parent
    return p


def segment_from_proto(p: trajectory_pb2.Segment) -> Segment:
    return Segment(p.first_turn, _SEGMENT_FROM_PROTO.get(p.reason,
                                                         SegmentReason.HISTORY_REWRITTEN),
                   parent=p.parent if p.HasField("parent") else None,
                   branch_point=p.branch_point, side_call=p.side_call)


def trajectory_to_bytes(t: Trajectory) -> bytes:
    return trajectory_to_proto(t).SerializeToString()


def trajectory_from_bytes(data: bytes) -> Trajectory:
    p = trajectory_pb2.Trajectory()
    p.ParseFromString(data)
    return trajectory_from_proto(p)
