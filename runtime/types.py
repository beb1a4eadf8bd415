"""Domain values shared by the server and the runtime.

These are plain frozen dataclasses; proto conversion happens only at the gRPC edge
(``server/api/proto_convert.py``). ``runtime`` defines them because it may not import ``server``.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class InvalidArgument(ValueError):
    """A request value is wrong; the message says what to fix. Maps to INVALID_ARGUMENT."""

    def __init__(self, message: str, reason: str = "INVALID_ARGUMENT", field: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        """UPPER_SNAKE reason put into the ``google.rpc.ErrorInfo`` detail."""
        self.field = field
        """Dotted path of the offending field, when one field is to blame."""


class Stage(enum.Enum):
    """The three pipeline stages, in order."""

    INIT = "init"
    RUN = "run"
    EVAL = "eval"

    # Members are singletons compared by identity, so the identity hash is as good as Enum's
    # own (a Python-level hash of the name), and the scheduler's per-stage dicts look stages
    # up dozens of times per job.
    __hash__ = object.__hash__


class JobState(enum.Enum):
    """Lifecycle of a job. QUEUED and RUNNING are live; the rest are terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    __hash__ = object.__hash__  # as Stage's

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class TerminationReason(enum.Enum):
    """Why the agent loop of a trajectory stopped."""

    SUBMITTED = "submitted"
    """The model called the finish/submit tool."""
    NO_TOOL_CALL = "no_tool_call"
    """The model ended its turn without calling a tool (a final answer in plain text)."""
    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"
    CONTEXT_LENGTH = "context_length"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    ERROR = "error"
    WORKSPACE_TOO_LARGE = "workspace_too_large"
    """The policy left a workspace over what the grader copies (bytes, files), or one that
    filled the grading sandbox's disk: reward 0, the job SUCCEEDED (docs/failures.md)."""
    WORKSPACE_UNGRADABLE = "workspace_ungradable"
    """The policy left a workspace the grader cannot copy (entries it made unreadable, names
    the grader's filesystem refuses): reward 0, the job SUCCEEDED."""
    EVAL_TIMEOUT = "eval_timeout"
    """Grading the policy's work ran past the EVAL stage's limit (code under test that hangs):
    reward 0, the job SUCCEEDED."""
    HARNESS_ERROR = "harness_error"
    """An agent harness exited non-zero (or by a signal) before the deadline, after its first
    model request: the job SUCCEEDED and EVAL graded the workspace it left."""


LOGPROBS_MODES = ("processed", "raw")
MAX_SEED = 2**62
"""Seeds are in [0, MAX_SEED) so ``seed + turn`` never overflows int64."""
MAX_TOKEN_BUDGET = 1 << 22
"""Most tokens one trajectory may hold (``total_token_budget``): far beyond any context a
served model has, low enough that a typo (an extra few zeros) is refused, not run."""


@dataclass(frozen=True)
class SamplingParams:
    """How each LLM turn of a job is sampled."""

    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """0 disables top-k."""
    max_tokens_per_turn: int = 512
    """Upper bound on generated tokens in one turn."""
    total_token_budget: int = 8192
    """Upper bound on all tokens of the trajectory (prompt + generated + observations)."""
    max_response_tokens: int | None = None
    """Upper bound on the tokens the model generates in the whole trajectory (the sum of its
    turns' outputs; a trainer's response length); None: no bound beyond the others."""
    seed: int | None = None
    """When set, turn k is sampled with seed ``seed + k`` so a whole rollout is reproducible."""
    stop: tuple[str, ...] = ()
    """Stop strings, applied to the decoded text of the generated tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop token ids besides the model's end-of-turn tokens."""
    logprobs_mode: str = "processed"
    """Which logprobs a turn records: ``processed`` (default) is the log-probability under the
    distribution actually sampled from (temperature, top-k and top-p applied), which is what a
    trainer's importance ratios need; ``raw`` is the log-softmax of the unmodified logits."""

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` naming the first bad value."""
        if not (0.0 <= self.temperature <= 10.0):
            raise InvalidArgument(
                f"sampling.temperature must be in [0, 10], got {self.temperature}",
                "INVALID_SAMPLING_PARAMS", "sampling.temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(
                f"sampling.top_p must be in (0, 1], got {self.top_p}",
                "INVALID_SAMPLING_PARAMS", "sampling.top_p")
        if self.top_k < 0:
            raise InvalidArgument(
                f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}",
                "INVALID_SAMPLING_PARAMS", "sampling.top_k")
        if self.max_tokens_per_turn <= 0:
            raise InvalidArgument(
                f"sampling.max_tokens_per_turn must be > 0, got {self.max_tokens_per_turn}",
                "INVALID_SAMPLING_PARAMS", "sampling.max_tokens_per_turn")
        if self.seed is not None and not (0 <= self.seed < MAX_SEED):
            # seed + k must stay a valid int64 for every turn, and engines seed non-negative
            raise InvalidArgument(
                f"sampling.seed must be in [0, 2^62), got {self.seed}",
                "INVALID_SAMPLING_PARAMS", "sampling.seed")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidArgument(
                f"sampling.logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                f"got {self.logprobs_mode!r}", "INVALID_SAMPLING_PARAMS", "sampling.logprobs_mode")
        if not (0 < self.total_token_budget <= MAX_TOKEN_BUDGET):
            raise InvalidArgument(
                f"sampling.total_token_budget must be in [1, {MAX_TOKEN_BUDGET}], got "
                f"{self.total_token_budget}", "INVALID_SAMPLING_PARAMS",
                "sampling.total_token_budget")
        if self.max_tokens_per_turn > self.total_token_budget:
            raise InvalidArgument(
                f"sampling.max_tokens_per_turn ({self.max_tokens_per_turn}) must not exceed "
                f"sampling.total_token_budget ({self.total_token_budget}, the whole "
                "trajectory's tokens): lower it, or raise total_token_budget",
                "INVALID_SAMPLING_PARAMS", "sampling.max_tokens_per_turn")
        if self.max_response_tokens is not None and not (
                0 < self.max_response_tokens <= MAX_TOKEN_BUDGET):
            raise InvalidArgument(
                f"sampling.max_response_tokens must be in [1, {MAX_TOKEN_BUDGET}] (leave it "
                f"unset for no bound), got {self.max_response_tokens}",
                "INVALID_SAMPLING_PARAMS", "sampling.max_response_tokens")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("sampling.stop_token_ids must be non-negative",
                                  "INVALID_SAMPLING_PARAMS", "sampling.stop_token_ids")


@dataclass(frozen=True)
class Limits:
    """Per-job limits. Stage timeouts count only time spent inside that stage."""

    max_turns: int = 8
    init_timeout_s: float = 120.0
    run_timeout_s: float = 600.0
    eval_timeout_s: float = 300.0
    tool_timeout_s: float = 60.0
    """Longest one tool call may run; a timeout the model asks for is capped at it."""

    def validate(self) -> None:
        if self.max_turns <= 0:
            raise InvalidArgument(f"limits.max_turns must be > 0, got {self.max_turns}",
                                  "INVALID_LIMITS", "limits.max_turns")
        for name in ("init_timeout_s", "run_timeout_s", "eval_timeout_s", "tool_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"limits.{name} must be > 0", "INVALID_LIMITS",
                                      f"limits.{name}")

    def timeout(self, stage: Stage) -> float:
        return {Stage.INIT: self.init_timeout_s, Stage.RUN: self.run_timeout_s,
                Stage.EVAL: self.eval_timeout_s}[stage]


@dataclass(frozen=True)
class GroupSpec:
    """Membership of a job in a group of samples of one prompt."""

    group_id: str
    size: int = 1
    """How many jobs the group is expected to have."""
    finish_after: int = 0
    """When > 0, the server cancels the group's remaining jobs once this many SUCCEEDED."""


FINISH_REASONS = ("stop", "length", "deadline", "preempted", "abort")
"""Values of :attr:`Turn.finish_reason` (and ``GenerateResult.finish_reason``)."""

TEMPLATE_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""``apply_chat_template`` arguments the renderer sets itself; template kwargs may not."""


@dataclass(frozen=True)
class ChatOptions:
    """Per-job overrides of an environment's chat settings (empty = the environment's)."""

    tool_call_format: str = ""
    """Name in :data:`rollout.runtime.toolcalls.TOOL_CALL_FORMATS`; empty = environment's
    setting, else detected from the chat template."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``apply_chat_template`` keyword arguments (e.g. ``enable_thinking``), merged over
    the environment's."""


@dataclass(frozen=True)
class JobSpec:
    """What a trainer asks for: one rollout of one task in one environment."""

    job_id: str
    """Client-chosen id; submitting the same id again yields the same job (idempotent)."""
    environment: str
    task: Mapping[str, Any]
    """Environment-specific JSON payload (see each environment's docstring)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    limits: Limits = field(default_factory=Limits)
    group: GroupSpec | None = None
    priority: int = 0
    """Higher runs first within each stage queue."""
    min_policy_version: int = 0
    """Every LLM turn must come from a backend at this policy version or newer."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """Client labels, returned unchanged in :attr:`Trajectory.labels`."""
    chat: ChatOptions = field(default_factory=ChatOptions)

    @property
    def group_id(self) -> str:
        return self.group.group_id if self.group else ""


@dataclass
class Turn:
    """One LLM turn: the prompt tokens appended before it, what it generated, what came back.

    The full token sequence of a trajectory is the concatenation, over turns, of
    ``prompt_ids + output_ids + observation_ids``.
    """

    prompt_ids: list[int]
    """Tokens appended before this generation (turn 0: the whole initial prompt)."""
    output_ids: list[int]
    """Tokens the model generated, exactly as sampled (never re-tokenized)."""
    output_logprobs: list[float]
    """Log-probability of each sampled token under the policy that produced it."""
    observation_ids: list[int] = field(default_factory=list)
    """Tool-observation tokens appended after the output (loss mask 0)."""
    policy_version: int = 0
    finish_reason: str = ""
    """One of :data:`FINISH_REASONS`."""
    backend: str = ""
    latency_s: float = 0.0
    tool_calls: list[str] = field(default_factory=list)
    """Names of the tools the model called in this turn."""
    preempted_retries: int = 0
    """Attempts of this turn discarded because a weight swap cut them (mixed policies)."""
    logprobs_kind: str = ""
    """``processed`` or ``raw`` as the engine reported it; not carried by the proto per turn
    (the trajectory carries the common kind)."""
    trained: bool = True
    """False for a side call's turn (a request a harness preset marks as not the agent's
    work, e.g. title generation): its output keeps its ids and logprobs but loss mask 0."""
    routed_experts: list[int] = field(default_factory=list)
    """Mixture-of-experts routing per output token, flattened ``[token][layer][k]`` (see
    ``Turn.routed_experts`` in the proto); empty when the backend reports none."""
    routed_expert_top_k: int = 0
    routed_expert_layers: int = 0

    @property
    def loss_mask(self) -> list[int]:
        return ([0] * len(self.prompt_ids) + [int(self.trained)] * len(self.output_ids)
                + [0] * len(self.observation_ids))


class SegmentReason(enum.Enum):
    """Why a trajectory segment began."""

    FIRST = "first"
    """The job's first request."""
    HISTORY_REWRITTEN = "history_rewritten"
    """The request shares its leading messages with a chain but does not extend it (the
    harness summarised, dropped or edited a message), so its tokens start a new sequence."""
    NEW_CONVERSATION = "new_conversation"
    """The request shares no leading message with any chain of the job (a sub-agent with its
    own system prompt, a side call)."""
    PARALLEL = "parallel"
    """The request extends a chain that another request of the job was generating on at that
    moment (a harness sending several calls at once from one history)."""


@dataclass(frozen=True)
class Segment:
    """One chain: a run of turns whose prompts each extend the previous turn's prompt and
    output.

    A segment's token sequence is the concatenation of its turns' ``prompt_ids + output_ids +
    observation_ids``; its first turn's ``prompt_ids`` is the segment's whole first prompt.
    Segments are contiguous, in chain-creation order: a harness whose requests alternate
    between chains (a main thread and its sub-agent) still gets each chain's turns together.
    Every sampled token belongs to exactly one turn of one segment, the only place it carries
    loss mask 1; context a chain repeats from another one is prompt there (mask 0).
    """

    first_turn: int
    """Index into the trajectory's turns of the segment's first turn."""
    reason: SegmentReason
    parent: int | None = None
    """Index into the trajectory's segments of the chain this one branched from (the one it
    shares the most leading messages with); None when it shares none."""
    branch_point: int = 0
    """How many of the parent's turns (from its first) this chain's first prompt repeats as
    context: it branched after the parent's turn ``branch_point - 1`` (0: it shares only part
    of the parent's first prompt, e.g. its system message)."""
    side_call: bool = False
    """A request a harness preset marked as not the agent's work (``SideCallRule``): its
    turns are kept for the record with loss mask 0 on their output."""


@dataclass
class StageTimings:
    """Seconds spent waiting for and inside each stage."""

    init_queue_s: float = 0.0
    init_s: float = 0.0
    run_queue_s: float = 0.0
    run_s: float = 0.0
    eval_queue_s: float = 0.0
    eval_s: float = 0.0


@dataclass
class Reward:
    """What EVAL returns."""

    value: float
    components: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    termination: TerminationReason | None = None
    """Set when what the policy did ended the job (a workspace over quota, a hung grader):
    the trajectory's termination reason then says so instead of the agent loop's."""


@dataclass
class Trajectory:
    """A finished rollout, as the trainer receives it."""

    job_id: str
    group_id: str = ""
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    termination: TerminationReason = TerminationReason.NO_TOOL_CALL
    timings: StageTimings = field(default_factory=StageTimings)
    metadata: dict[str, str] = field(default_factory=dict)
    """Server and environment information; never the client's labels."""
    state: JobState | None = None
    """The job's terminal state (None only while a trajectory is being built)."""
    error: JobError | None = None
    """Why the job failed or was cancelled; None when it succeeded."""
    labels: dict[str, str] = field(default_factory=dict)
    """The spec's client metadata, unchanged."""
    seed: int | None = None
    """The seed turn 0 was sampled with (turn k: seed + k); None when no turn was sampled."""
    logprobs_kind: str = ""
    """``processed`` / ``raw`` when every turn agrees; empty when there are no turns."""
    segments: list[Segment] = field(default_factory=list)
    """Where each separate token sequence begins, in turn order. Empty (or one segment at
    turn 0) means one merged sequence, as the built-in agent loop always produces; a harness
    that rewrites its history produces several (see :meth:`segment_turns`)."""

    def segment_turns(self) -> list[list[Turn]]:
        """The turns of each segment; one list holding every turn when there are no
        segments. Each list is one training sequence whose ids and mask are exact."""
        return split_segments(self.turns, self.segments)

    @property
    def token_ids(self) -> list[int]:
        out: list[int] = []
        for t in self.turns:
            out += t.prompt_ids + t.output_ids + t.observation_ids
        return out

    @property
    def loss_mask(self) -> list[int]:
        out: list[int] = []
        for t in self.turns:
            out += t.loss_mask
        return out


@dataclass(frozen=True)
class JobError:
    """A job's own failure, carried typed inside the stream (never free text alone)."""

    code: str
    """One of: TIMEOUT, HANDLER_ERROR, SANDBOX_ERROR, BACKEND_UNAVAILABLE, INVALID_TASK,
    CANCELLED, INTERNAL."""
    reason: str
    """UPPER_SNAKE machine-readable reason, e.g. ``INIT_TIMEOUT``."""
    message: str
    stage: Stage | None = None


def split_segments(turns: list[Turn], segments: list[Segment]) -> list[list[Turn]]:
    """``turns`` cut where each of ``segments`` begins (one list when there are none)."""
    starts = sorted({s.first_turn for s in segments if 0 < s.first_turn < len(turns)})
    bounds = [0, *starts, len(turns)]
    return [turns[a:b] for a, b in itertools.pairwise(bounds) if b > a] or [[]]
