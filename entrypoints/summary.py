"""The end-of-run summary of ``rollout submit`` and ``rollout quickstart``: outcomes never hidden.

A job's terminal state alone hides how it went: an agent loop that ran out of RUN time stops
just before the stage deadline, EVAL scores whatever it left, and the job ends SUCCEEDED. So the
summary counts jobs by how their trajectory ended (``Trajectory.termination_reason``) as well:
a deadline-hit job is counted in its own column, never among the clean successes, and every
environment where jobs earned nothing gets one line that says why.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from rollout.client.trajectory import total_tokens
from rollout.entrypoints.tables import compact_table
from rollout.v1 import job_pb2
from rollout.v1 import trajectory_pb2 as tpb

_S = job_pb2.Job
_T = tpb.TerminationReason

SHORT_REASON: dict[int, str] = {
    _T.TERMINATION_REASON_SUBMITTED: "submitted",
    _T.TERMINATION_REASON_NO_TOOL_CALL: "no tool call",
    _T.TERMINATION_REASON_MAX_TURNS: "max turns",
    _T.TERMINATION_REASON_TOKEN_BUDGET: "token budget",
    _T.TERMINATION_REASON_CONTEXT_LENGTH: "context length",
    _T.TERMINATION_REASON_DEADLINE: "deadline",
    _T.TERMINATION_REASON_CANCELLED: "cancelled",
    _T.TERMINATION_REASON_ERROR: "error",
}
"""How a trajectory ended, in the words the tables use."""

_WHY_ZERO: dict[int, str] = {
    _T.TERMINATION_REASON_SUBMITTED: "submitted an answer the grader scored 0",
    _T.TERMINATION_REASON_NO_TOOL_CALL: "stopped without calling a tool (no submit; a final "
                                        "text answer, if any, was wrong)",
    _T.TERMINATION_REASON_MAX_TURNS: "used every turn without submitting",
    _T.TERMINATION_REASON_TOKEN_BUDGET: "ran out of its token budget",
    _T.TERMINATION_REASON_CONTEXT_LENGTH: "ran out of context length",
    _T.TERMINATION_REASON_DEADLINE: "hit the RUN deadline",
    _T.TERMINATION_REASON_CANCELLED: "were cancelled",
    _T.TERMINATION_REASON_ERROR: "failed",
}


@dataclass
class JobOutcome:
    """What the frames said about one job (trajectory and JobFinished, in either order)."""

    env: str
    state: int = _S.STATE_UNSPECIFIED
    """``Job.State`` from JobFinished; UNSPECIFIED until it arrives."""
    reward: float = 0.0
    error_reason: str = ""
    termination: int = _T.TERMINATION_REASON_UNSPECIFIED
    """``TerminationReason`` from the trajectory; UNSPECIFIED until it arrives."""
    turns: int = 0
    tool_calls: int = 0
    tokens: int = 0
    generated: int = 0
    """Tokens the model generated (every turn's output), 0 for a job cut before its first."""
    stage_s: dict[str, float] = field(default_factory=dict)

    @property
    def deadline(self) -> bool:
        """Ran out of RUN time, whether EVAL then scored the partial work or the job failed."""
        return self.termination == _T.TERMINATION_REASON_DEADLINE

    @property
    def outcome(self) -> str:
        """``ok`` (succeeded within its limits), ``deadline``, ``fail``, ``cancel`` or ``-``."""
        if self.state == _S.STATE_CANCELLED:
            return "cancel"
        if self.state == _S.STATE_UNSPECIFIED:
            return "-"
        if self.deadline:
            return "deadline"
        return "ok" if self.state == _S.STATE_SUCCEEDED else "fail"


class RunStats:
    """Per-job outcomes gathered from the frames, and the tables and notes built from them."""

    def __init__(self, specs: Iterable[job_pb2.JobSpec]) -> None:
        self.jobs: dict[str, JobOutcome] = {s.job_id: JobOutcome(s.environment) for s in specs}
        self.rejected: list[str] = []
        self.already_done = 0
        self.written = 0

    def _job(self, job_id: str) -> JobOutcome:
        if job_id not in self.jobs:  # a replayed delivery of a job submitted by an earlier run
            self.jobs[job_id] = JobOutcome("(earlier run)")
        return self.jobs[job_id]

    def trajectory(self, t: Any) -> None:
        j = self._job(t.job_id)
        j.termination = t.termination_reason
        j.turns = len(t.turns)
        j.tool_calls = sum(len(turn.tool_calls) for turn in t.turns)
        j.tokens = total_tokens(t)
        j.generated = sum(len(turn.output_ids) for turn in t.turns)
        j.stage_s = {name: getattr(t.timings, name).ToNanoseconds() / 1e9
                     for name in ("init", "run", "eval")}
        self.written += 1

    def finished(self, job_id: str, f: Any) -> None:
        j = self._job(job_id)
        j.state = f.state
        j.reward = f.reward if f.state == _S.STATE_SUCCEEDED else 0.0
        j.error_reason = f.error.reason if f.HasField("error") else ""

    def by_env(self) -> dict[str, list[JobOutcome]]:
        envs: dict[str, list[JobOutcome]] = defaultdict(list)
        for j in self.jobs.values():
            envs[j.env].append(j)
        return dict(sorted(envs.items()))

    def table(self) -> Table:
        """Outcomes per environment; ok + deadline + fail + cancel = jobs that finished."""
        t = compact_table(
            "rollout summary",
            ("env", "jobs", "ok", "deadline", "fail", "cancel", "solved", "reward", "turns",
             "tools", "tokens"), left=("env",),
            caption="ok: succeeded within its limits; deadline: ran out of RUN time (counted "
                    "apart, whatever its state); solved: reward 1; reward, turns: means; "
                    "tools: jobs with a tool call")
        for name, jobs in self.by_env().items():
            done = [j for j in jobs if j.state != _S.STATE_UNSPECIFIED]
            outcomes = Counter(j.outcome for j in jobs)
            t.add_row(name, str(len(jobs)), *(str(outcomes[o]) for o in
                                               ("ok", "deadline", "fail", "cancel")),
                      str(sum(j.state == _S.STATE_SUCCEEDED and j.reward >= 1.0 for j in jobs)),
                      _mean([j.reward for j in done]),
                      _mean([j.turns for j in jobs if j.termination], "{:.1f}"),
                      str(sum(j.tool_calls > 0 for j in jobs)),
                      str(sum(j.tokens for j in jobs)))
        return t

    def endings_table(self) -> Table:
        """How each environment's agent loops ended, and mean seconds inside each stage."""
        t = compact_table("how runs ended", ("env", "calls", "INIT", "RUN", "EVAL", "ended by"),
                          left=("env", "ended by"),
                          caption="calls: tool calls in all; INIT / RUN / EVAL: mean seconds")
        for name, jobs in self.by_env().items():
            ended = [j for j in jobs if j.termination]
            t.add_row(name, str(sum(j.tool_calls for j in jobs)),
                      *(_mean([j.stage_s[s] for j in ended if s in j.stage_s])
                        for s in ("init", "run", "eval")),
                      endings(j.termination for j in ended))
        return t

    def zero_reward_notes(self) -> list[str]:
        """One line per environment whose finished jobs include some that earned nothing."""
        notes = []
        for name, jobs in self.by_env().items():
            zero = [j for j in jobs if j.state != _S.STATE_UNSPECIFIED and j.reward <= 0.0]
            if not zero:
                continue
            finished = sum(j.state != _S.STATE_UNSPECIFIED for j in jobs)
            why = Counter(j.termination for j in zero)
            parts = []
            for reason, n in why.most_common():
                text = _WHY_ZERO.get(reason, "ended for no recorded reason")
                if reason == _T.TERMINATION_REASON_ERROR:
                    errs = Counter(j.error_reason or "unknown" for j in zero
                                   if j.termination == reason)
                    text += " (" + ", ".join(f"{e} x{c}" for e, c in errs.most_common()) + ")"
                parts.append(f"{n} {text}")
            head = ("no job earned a reward" if len(zero) == finished
                    else f"{len(zero)} of {finished} jobs earned 0")
            notes.append(f"{name}: {head}: " + "; ".join(parts))
        return notes


    def starved_notes(self) -> list[str]:
        """One line per environment where the RUN deadline passed before the model generated
        a single token: the machine (or backend) was too slow for the limit, not the policy
        wrong, and the fix is on the operator's side."""
        notes = []
        for name, jobs in self.by_env().items():
            starved = sum(j.deadline and j.generated == 0 for j in jobs)
            if starved:
                notes.append(
                    f"{name}: {starved} of {len(jobs)} jobs reached the RUN deadline before the "
                    "model generated a token (a slow or busy machine): raise "
                    "limits.run_timeout_s, run fewer jobs at once, or use a faster backend")
        return notes


def endings(terminations: Iterable[int]) -> str:
    """``3 submitted, 1 deadline``: termination reasons with counts, most common first."""
    counts = Counter(terminations)
    return ", ".join(f"{n} {SHORT_REASON.get(r, str(r))}" for r, n in counts.most_common()) or "-"


def _mean(xs: list[float] | list[int], fmt: str = "{:.2f}") -> str:
    return fmt.format(statistics.fmean(xs)) if xs else "-"
