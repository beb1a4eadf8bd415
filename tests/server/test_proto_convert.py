"""Proto <-> domain conversion of the v1 revision's fields: chat options and logprobs mode are
validated with a reason and a field, trajectories keep state, error, labels, seed and kind."""

from __future__ import annotations

import pytest

from rollout.runtime.types import (
    FINISH_REASONS,
    ChatOptions,
    InvalidArgument,
    JobError,
    JobSpec,
    JobState,
    SamplingParams,
    Stage,
    TerminationReason,
    Trajectory,
    Turn,
)
from rollout.server.api import proto_convert
from rollout.v1 import job_pb2, trajectory_pb2


def proto_spec(**chat: object) -> job_pb2.JobSpec:
    p = job_pb2.JobSpec(job_id="j", environment="math")
    p.task.update({"question": "1+1"})
    if chat:
        p.chat.CopyFrom(job_pb2.ChatOptions(**chat))  # type: ignore[arg-type]
    return p


def test_chat_options_and_logprobs_mode_round_trip() -> None:
    spec = JobSpec(job_id="j", environment="math", task={"q": 1},
                   sampling=SamplingParams(logprobs_mode="raw", seed=3),
                   chat=ChatOptions(tool_call_format="llama3",
                                    template_kwargs={"enable_thinking": False, "n": 2}))
    p = proto_convert.spec_to_proto(spec)
    assert p.sampling.logprobs_mode == job_pb2.LOGPROBS_KIND_RAW
    assert proto_convert.spec_from_proto(p) == spec
    # Unset means the default, processed; nothing set means no chat options.
    default = proto_convert.spec_from_proto(proto_spec())
    assert default.sampling.logprobs_mode == "processed" and default.chat == ChatOptions()


@pytest.mark.parametrize(("chat", "reason", "field"), [
    ({"tool_call_format": "gpt-oss"}, "UNKNOWN_TOOL_CALL_FORMAT", "chat.tool_call_format"),
    ({"tool_call_format": "hermes "}, "UNKNOWN_TOOL_CALL_FORMAT", "chat.tool_call_format"),
])
def test_unknown_tool_call_format_is_rejected(chat: dict, reason: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        proto_convert.spec_from_proto(proto_spec(**chat))
    assert (e.value.reason, e.value.field) == (reason, field)
    assert "hermes" in str(e.value) and "llama3" in str(e.value)  # says what would work


def test_template_kwargs_may_not_set_what_the_renderer_sets_and_are_bounded() -> None:
    p = proto_spec()
    p.chat.chat_template_kwargs.update({"add_generation_prompt": False, "tools": []})
    with pytest.raises(InvalidArgument, match="add_generation_prompt, tools") as e:
        proto_convert.spec_from_proto(p)
    assert e.value.field == "chat.chat_template_kwargs"
    p = proto_spec()
    p.chat.chat_template_kwargs.update({"big": "x" * (proto_convert.MAX_TEMPLATE_KWARGS_BYTES + 1)})
    with pytest.raises(InvalidArgument, match="limit") as e:
        proto_convert.spec_from_proto(p)
    assert e.value.reason == "INVALID_CHAT_OPTIONS"


def test_an_explicit_unspecified_logprobs_mode_is_rejected() -> None:
    p = proto_spec()
    p.sampling.logprobs_mode = job_pb2.LOGPROBS_KIND_UNSPECIFIED
    with pytest.raises(InvalidArgument) as e:
        proto_convert.spec_from_proto(p)
    assert e.value.field == "sampling.logprobs_mode"


def test_trajectory_round_trip_keeps_outcome_fields() -> None:
    turns = [Turn(prompt_ids=[1], output_ids=[2], output_logprobs=[-0.5], finish_reason=r,
                  preempted_retries=i) for i, r in enumerate(FINISH_REASONS)]
    traj = Trajectory(job_id="j", turns=turns, termination=TerminationReason.DEADLINE,
                      metadata={"final_text": "x"}, state=JobState.FAILED,
                      error=JobError("TIMEOUT", "RUN_TIMEOUT", "too slow", Stage.RUN),
                      labels={"step": "3"}, seed=0, logprobs_kind="raw")
    p = proto_convert.trajectory_to_proto(traj)
    # Independent of the mapping tables: each domain string names its enum value.
    assert [trajectory_pb2.FinishReason.Name(t.finish_reason) for t in p.turns] == [
        "FINISH_REASON_" + r.upper() for r in FINISH_REASONS]
    assert p.HasField("seed") and p.seed == 0  # seed 0 is a seed, not "unset"
    assert p.state == job_pb2.Job.STATE_FAILED and p.error.reason == "RUN_TIMEOUT"
    assert p.logprobs_kind == job_pb2.LOGPROBS_KIND_RAW and dict(p.labels) == {"step": "3"}
    back = proto_convert.trajectory_from_proto(p)
    for t in back.turns:
        t.logprobs_kind = ""  # per-turn kind is not carried; the trajectory's is
    for t in traj.turns:
        t.logprobs_kind = ""
    assert back == traj
    # Unset seed and no turns stay unset.
    empty = proto_convert.trajectory_to_proto(Trajectory(job_id="k", state=JobState.CANCELLED))
    assert not empty.HasField("seed") and not empty.HasField("error")
    assert empty.logprobs_kind == job_pb2.LOGPROBS_KIND_UNSPECIFIED


@pytest.mark.parametrize("seed", [-1, 2**62])
def test_a_seed_whose_turn_seeds_could_overflow_is_rejected(seed: int) -> None:
    p = proto_spec()
    p.sampling.seed = seed
    with pytest.raises(InvalidArgument, match=r"\[0, 2\^62\)") as e:
        proto_convert.spec_from_proto(p)
    assert e.value.field == "sampling.seed"
    p.sampling.seed = 2**62 - 1
    assert proto_convert.spec_from_proto(p).sampling.seed == 2**62 - 1


def test_chains_and_side_calls_survive_the_proto() -> None:
    from rollout.runtime.types import Segment, SegmentReason

    turns = [Turn([1, 2], [3], [-0.5]), Turn([4], [5, 6], [-0.1, -0.2]),
             Turn([7, 8], [9], [-0.3], trained=False)]
    segments = [Segment(0, SegmentReason.FIRST),
                Segment(1, SegmentReason.PARALLEL, parent=0, branch_point=1),
                Segment(2, SegmentReason.NEW_CONVERSATION, side_call=True)]
    traj = Trajectory(job_id="j", turns=turns, segments=segments)
    proto = proto_convert.trajectory_to_proto(traj)
    assert not proto.segments[0].HasField("parent") and proto.segments[1].parent == 0
    assert list(proto.turns[2].loss_mask) == [0, 0, 0]
    back = proto_convert.trajectory_from_proto(proto)
    assert back.segments == segments
    assert [t.trained for t in back.turns] == [True, True, False]
