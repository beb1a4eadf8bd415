"""Trainer-facing views of a trajectory: one flat token sequence, and JSON lines.

A trainer wants one sequence per trajectory with per-token masks and logprobs, not turns. The
flat view is the concatenation, turn by turn, of ``prompt_ids + output_ids + observation_ids``
(the proto's definition), so position ``i`` of every list refers to the same token. Logprobs
exist only for model tokens; other positions hold 0.0 and carry loss mask 0, so a PPO ratio
computed over masked positions never reads a made-up value.

A trajectory of a harness job (an external agent calling the model gateway) may hold several
token sequences (``Trajectory.segments``): when the harness rewrote its history, the next
request's prompt did not extend the previous sequence. Each segment is then its own training
sequence with the trajectory's reward (:func:`flatten_segments`, :func:`segment_views`);
concatenating them would score the later tokens under a context the model never saw, so
:func:`flatten` refuses a trajectory with more than one.

Only SUCCEEDED trajectories are training data by default: a FAILED or CANCELLED one carries
the turns produced before the job ended and reward 0 (a zero that EVAL never computed), so
:func:`flatten` skips it (returns None) unless asked to keep it with ``keep_failed=True`` (for
a trainer that masks such samples itself). A trajectory without a state (written by a server
older than the v1 revision that added ``Trajectory.state``) counts as not succeeded.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from google.protobuf import json_format

from rollout.v1 import job_pb2, trajectory_pb2


@dataclass(frozen=True)
class Flat:
    """A trajectory as aligned per-token lists plus its scalars."""

    job_id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    """1 for tokens the model generated, 0 for prompts, scaffolding and observations."""
    logprobs: list[float]
    """Sampling logprob per token; 0.0 wherever ``loss_mask`` is 0."""
    prompt_length: int
    """Length of turn 0's prompt: the part shared by every sample of one task."""
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    policy_versions: list[int] = field(default_factory=list)
    """Per token, the policy version that generated it (0 where mask is 0)."""
    num_turns: int = 0
    termination: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    """Server and environment information (e.g. ``final_text``)."""
    state: str = ""
    """The job's terminal state without prefix: ``SUCCEEDED``, ``FAILED`` or ``CANCELLED``."""
    error_reason: str = ""
    """``JobError.reason`` when the job did not succeed, e.g. ``RUN_TIMEOUT``."""
    labels: dict[str, str] = field(default_factory=dict)
    """The client's labels (the spec's metadata), unchanged."""
    seed: int | None = None
    """The seed that reproduces the trajectory (turn k: seed + k)."""
    logprobs_kind: str = ""
    """``PROCESSED`` (the behaviour policy) or ``RAW``; empty when unknown."""
    segment: int = 0
    """Which token sequence of the trajectory this is (see :func:`flatten_segments`)."""
    num_segments: int = 1
    routed_experts: list[int] = field(default_factory=list)
    """Routing replay (R3) for a mixture-of-experts policy: per position of ``token_ids``, the
    experts each MoE layer chose there, flattened ``[position][layer][k]``. Position ``p`` holds
    the routing the engine used at ``p`` when it produced token ``p + 1`` (where the trainer
    computes that token's logprob); positions the engine reported nothing for hold zeros.
    Empty when no turn carries routing."""
    routed_expert_layers: int = 0
    routed_expert_top_k: int = 0

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length:]

    @property
    def response_mask(self) -> list[int]:
        return self.loss_mask[self.prompt_length:]


def succeeded(traj: trajectory_pb2.Trajectory) -> bool:
    """Did the job succeed (so its reward came from EVAL)?"""
    return traj.state == job_pb2.Job.STATE_SUCCEEDED


@overload
def flatten(traj: trajectory_pb2.Trajectory, *, keep_failed: Literal[True]) -> Flat: ...


@overload
def flatten(traj: trajectory_pb2.Trajectory, *, keep_failed: bool = False) -> Flat | None: ...


def flatten(traj: trajectory_pb2.Trajectory, *, keep_failed: bool = False) -> Flat | None:
    """Concatenate the turns; checks the invariants a trainer silently depends on.

    Returns None for a trajectory whose job did not succeed, unless ``keep_failed``. Raises
    ValueError for a trajectory of several segments: use :func:`flatten_segments`.
    """
    if not keep_failed and not succeeded(traj):
        return None
    if len(_segment_bounds(traj)) > 1:
        raise ValueError(f"trajectory {traj.job_id} holds {len(traj.segments)} token sequences "
                         f"({_why_segments(traj)}); flatten_segments() gives one Flat per "
                         "sequence, each with the trajectory's reward")
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    routed_shape = next(((t.routed_expert_layers, t.routed_expert_top_k) for t in traj.turns
                         if len(t.routed_experts)), (0, 0))
    width = routed_shape[0] * routed_shape[1]
    routed: list[int] = []
    for n, turn in enumerate(traj.turns):
        if width and len(turn.routed_experts) not in (0, width * len(turn.output_ids)):
            raise ValueError(f"turn {n}: {len(turn.routed_experts)} routed expert ids for "
                             f"{len(turn.output_ids)} output tokens of {width} each")
        if width and (turn.routed_expert_layers, turn.routed_expert_top_k) not in (
                routed_shape, (0, 0)):
            raise ValueError(f"turn {n}: routed experts of another shape than turn 0's")
        if width:
            start = len(ids) + len(turn.prompt_ids) - 1  # produced output token 0
            need = (start + len(turn.output_ids)) * width
            routed += [0] * (need - len(routed))
            if len(turn.routed_experts):
                routed[start * width:need] = list(turn.routed_experts)
        if len(turn.output_logprobs) != len(turn.output_ids):
            raise ValueError(f"turn {n}: {len(turn.output_ids)} output ids but "
                             f"{len(turn.output_logprobs)} logprobs")
        p, o, obs = len(turn.prompt_ids), len(turn.output_ids), len(turn.observation_ids)
        ids += [*turn.prompt_ids, *turn.output_ids, *turn.observation_ids]
        turn_mask = list(turn.loss_mask) or [0] * p + [1] * o + [0] * obs
        if len(turn_mask) != p + o + obs:
            raise ValueError(f"turn {n}: loss_mask has {len(turn_mask)} entries for "
                             f"{p + o + obs} tokens")
        mask += turn_mask
        logprobs += [0.0] * p + list(turn.output_logprobs) + [0.0] * obs
        versions += [0] * p + [turn.policy_version] * o + [0] * obs
    if width:
        routed = (routed + [0] * (len(ids) * width - len(routed)))[:len(ids) * width]
    # A mask of 1 on a non-output position would have no logprob; zero it out explicitly.
    logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]
    return Flat(
        job_id=traj.job_id, group_id=traj.group_id, token_ids=ids, loss_mask=mask,
        logprobs=logprobs,
        prompt_length=len(traj.turns[0].prompt_ids) if traj.turns else 0,
        reward=traj.reward, reward_components=dict(traj.reward_components),
        policy_versions=versions, num_turns=len(traj.turns),
        termination=trajectory_pb2.TerminationReason.Name(traj.termination_reason)
        .removeprefix("TERMINATION_REASON_"),
        metadata=dict(traj.metadata),
        state=job_pb2.Job.State.Name(traj.state).removeprefix("STATE_")
        if traj.state else "",
        error_reason=traj.error.reason if traj.HasField("error") else "",
        labels=dict(traj.labels), seed=traj.seed if traj.HasField("seed") else None,
        logprobs_kind=job_pb2.LogprobsKind.Name(traj.logprobs_kind)
        .removeprefix("LOGPROBS_KIND_") if traj.logprobs_kind else "",
        routed_experts=routed, routed_expert_layers=routed_shape[0],
        routed_expert_top_k=routed_shape[1])


_SEGMENT_CAUSES: dict[int, str] = {
    trajectory_pb2.Segment.REASON_HISTORY_REWRITTEN:
        "a request that did not carry the answers before it (the harness summarised, edited or "
        "dropped messages, e.g. a reply it could not parse)",
    trajectory_pb2.Segment.REASON_NEW_CONVERSATION:
        "a request of a conversation of its own (a sub-agent, a side call)",
    trajectory_pb2.Segment.REASON_PARALLEL:
        "a request sent from one history at the same time as another",
}


def _why_segments(traj: trajectory_pb2.Trajectory) -> str:
    """Say, per cause, how many segments began and why, so a refused flatten() explains itself
    (a harness that drops unparseable replies makes one segment per such reply)."""
    counts = collections.Counter(seg.reason for seg in traj.segments[1:])
    parts = [f"{n} began with {_SEGMENT_CAUSES.get(reason, 'a request of unknown cause')}"
             for reason, n in counts.most_common()]
    return "; ".join(parts) or "its turns are split"


def flatten_segments(traj: trajectory_pb2.Trajectory, *,
                     keep_failed: bool = False) -> list[Flat]:
    """One :class:`Flat` per token sequence (segment), in order, each carrying the
    trajectory's reward; ``[flatten(traj)]`` for a trajectory of one sequence, and ``[]`` for
    one whose job did not succeed unless ``keep_failed``."""
    if not keep_failed and not succeeded(traj):
        return []
    views = segment_views(traj)
    out = []
    for n, view in enumerate(views):
        flat = flatten(view, keep_failed=True)
        out.append(dataclasses.replace(flat, segment=n, num_segments=len(views)))
    return out


def segment_views(traj: trajectory_pb2.Trajectory) -> list[trajectory_pb2.Trajectory]:
    """The trajectory once per token sequence: copies holding one segment's turns each (and no
    segments), so code written for one merged sequence handles every segment. A trajectory of
    one sequence comes back as itself."""
    bounds = _segment_bounds(traj)
    if len(bounds) <= 1:
        return [traj]
    views = []
    for a, b in bounds:
        view = trajectory_pb2.Trajectory()
        view.CopyFrom(traj)
        del view.turns[:]
        del view.segments[:]
        view.turns.extend(traj.turns[a:b])
        views.append(view)
    return views


def _segment_bounds(traj: trajectory_pb2.Trajectory) -> list[tuple[int, int]]:
    """Turn ranges of the segments; checks that they start at turn 0 and move forward."""
    starts = [s.first_turn for s in traj.segments]
    if not starts:
        return [(0, len(traj.turns))]
    if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) or (
            starts[-1] >= max(len(traj.turns), 1)):
        raise ValueError(f"trajectory {traj.job_id}: segments must start at turn 0 and at "
                         f"increasing turns below {len(traj.turns)}, got {starts}")
    return list(itertools.pairwise([*starts, len(traj.turns)]))


def flatten_all(trajs: Iterable[trajectory_pb2.Trajectory], *,
                keep_failed: bool = False) -> list[Flat]:
    """:func:`flatten_segments` over many trajectories (one Flat per token sequence),
    leaving out the skipped ones."""
    out = []
    for traj in trajs:
        out += flatten_segments(traj, keep_failed=keep_failed)
    return out


def to_json(traj: trajectory_pb2.Trajectory) -> dict[str, Any]:
    """The proto's JSON form with snake_case names and every field present, so JSONL files
    read the same whatever was set (int64 fields come out as strings, per the JSON mapping)."""
    return json_format.MessageToDict(traj, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def from_json(data: Mapping[str, Any]) -> trajectory_pb2.Trajectory:
    """Inverse of :func:`to_json`; ignores unknown fields so newer files still load."""
    return json_format.ParseDict(dict(data), trajectory_pb2.Trajectory(),
                                 ignore_unknown_fields=True)


def total_tokens(traj: trajectory_pb2.Trajectory) -> int:
    return sum(len(t.prompt_ids) + len(t.output_ids) + len(t.observation_ids)
               for t in traj.turns)
