"""Running one stage of one job, and turning what happened into a typed outcome.

Kept apart from the scheduler's bookkeeping so the rules for "what counts as which failure"
live in one small place:
- a stage timeout (the stage's own ``asyncio.timeout`` expired) -> TIMEOUT / ``<STAGE>_TIMEOUT``;
- ``LLMUnavailable`` -> BACKEND_UNAVAILABLE; ``HandlerError`` -> HANDLER_ERROR with its reason;
  ``InvalidArgument`` from a handler -> INVALID_TASK; any other exception -> HANDLER_ERROR with
  the exception type as reason;
- a RUN whose agent loop ended CANCELLED (its LLM turn was aborted under it) or ERROR is a
  failure (CANCELLED / ``RUN_CANCELLED``, HANDLER_ERROR / ``RUN_ERROR``): such partial work never
  flows into EVAL to be scored as a success; its turns stay on the trajectory;
- what the policy caused is a reward, not a failure: a ``PolicyFault`` (a workspace over the
  grader's quota, say) and an EVAL stage timeout (code under test that hangs the grader) end
  the job SUCCEEDED with reward 0 and a termination reason that says so, since trainers mask
  failed jobs (docs/failures.md);
- cancellation is not an outcome here: it propagates to the caller, which knows why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from rollout.runtime.agent_loop import SEED_KEY, TURNS_KEY
from rollout.runtime.gateway import SEGMENTS_KEY
from rollout.runtime.handler import (
    AgentHandler,
    HandlerError,
    JobContext,
    PolicyFault,
    RunOutcome,
)
from rollout.runtime.llm import LLMUnavailable
from rollout.runtime.sandbox.images import ImageError
from rollout.runtime.types import (
    InvalidArgument,
    JobError,
    JobState,
    Reward,
    Stage,
    StageTimings,
    TerminationReason,
    Trajectory,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StageResult:
    error: JobError | None = None
    reward: Reward | None = None
    """EVAL's reward; at any stage, the 0 a ``PolicyFault`` ends the job with."""


def _upper_snake(name: str) -> str:
    """``ValueError`` -> ``VALUE_ERROR``; a run of capitals is one word (``OSError`` ->
    ``OS_ERROR``, ``HTTPError`` -> ``HTTP_ERROR``)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).upper()


async def run_stage(handler: AgentHandler, ctx: JobContext, stage: Stage,
                    timeout_s: float) -> StageResult:
    """Run ``stage`` of the handler under its own timeout. Raises CancelledError if cancelled."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            if stage is Stage.INIT:
                await handler.init(ctx)
            elif stage is Stage.RUN:
                outcome = await handler.run(ctx)
                if not isinstance(outcome, RunOutcome):
                    raise HandlerError(f"run() returned {type(outcome).__name__}, not RunOutcome",
                                       "BAD_RUN_OUTCOME")
                ctx.outcome = outcome
                unfinished = _unfinished_run(outcome)
                if unfinished is not None:
                    return StageResult(unfinished)
            else:
                reward = await handler.eval(ctx)
                if not isinstance(reward, Reward):
                    raise HandlerError(f"eval() returned {type(reward).__name__}, not Reward",
                                       "BAD_REWARD")
                return StageResult(reward=reward)
        return StageResult()
    except PolicyFault as exc:
        return StageResult(reward=policy_zero(exc.termination, str(exc), stage))
    except TimeoutError as exc:
        if deadline.expired() and stage is Stage.EVAL:
            return StageResult(reward=policy_zero(
                TerminationReason.EVAL_TIMEOUT,
                f"grading exceeded the eval stage's {timeout_s:g}s limit", stage))
        if deadline.expired():
            return StageResult(JobError(
                "TIMEOUT", f"{stage.name}_TIMEOUT",
                f"{stage.value} stage exceeded its {timeout_s:g}s limit", stage))
        return StageResult(_handler_error(exc, stage))
    except LLMUnavailable as exc:
        return StageResult(JobError("BACKEND_UNAVAILABLE", exc.reason, str(exc), stage))
    except HandlerError as exc:
        return StageResult(JobError("HANDLER_ERROR", exc.reason, str(exc), stage))
    except InvalidArgument as exc:
        return StageResult(JobError("INVALID_TASK", exc.reason, str(exc), stage))
    except ImageError as exc:
        # The task's image (unknown, refused, not building) is the task's fault; a registry
        # that is down or a full cache disk is the service's. Never a reward either way.
        return StageResult(JobError("INVALID_TASK" if exc.task_fault else "SANDBOX_ERROR",
                                    exc.reason, f"{_task_name(ctx)}: {exc}", stage))
    except Exception as exc:
        return StageResult(_handler_error(exc, stage))


def _task_name(ctx: JobContext) -> str:
    """How a failure names the job's task: its own id where it has one, else the id of the
    task it wraps (a harness job's ``task``: the swe instance or Harbor task the harness
    works on)."""
    task = ctx.spec.task if isinstance(ctx.spec.task, Mapping) else {}
    inner = task.get("task")
    for candidate in (task, inner if isinstance(inner, Mapping) else {}):
        for key in ("instance_id", "task_id", "id", "name"):
            value = candidate.get(key)
            if isinstance(value, str) and value:
                return f"task {value!r} ({ctx.spec.environment})"
    return f"the {ctx.spec.environment} task"


def policy_zero(termination: TerminationReason, message: str, stage: Stage) -> Reward:
    return Reward(0.0, {}, {"error": termination.name, "message": message[:1000],
                            "stage": stage.value}, termination=termination)


def _unfinished_run(outcome: RunOutcome) -> JobError | None:
    if outcome.termination is TerminationReason.CANCELLED:
        return JobError("CANCELLED", "RUN_CANCELLED",
                        "the agent loop was cancelled (its LLM turn was aborted by the backend); "
                        "the partial work is not scored", Stage.RUN)
    if outcome.termination is TerminationReason.ERROR:
        return JobError("HANDLER_ERROR", "RUN_ERROR",
                        "the agent loop reported an error; the partial work is not scored",
                        Stage.RUN)
    return None


def _handler_error(exc: BaseException, stage: Stage) -> JobError:
    log.warning("%s stage raised %s: %s", stage.value, type(exc).__name__, exc)
    if type(exc) is OSError:  # the subclasses name themselves (FILE_NOT_FOUND_ERROR, ...)
        code = errno.errorcode.get(exc.errno or 0, "")
        return JobError("HANDLER_ERROR", "OS_ERROR", f"{code + ': ' if code else ''}{exc}",
                        stage)
    return JobError("HANDLER_ERROR", _upper_snake(type(exc).__name__),
                    str(exc) or type(exc).__name__, stage)


async def release(handler: AgentHandler | None, ctx: JobContext, llm_end: object | None,
                  job_id: str, deadline_s: float) -> None:
    """Free everything the job holds; each step bounded, none allowed to stop the next.

    Steps with nothing to do (the base class's no-op cleanup, an empty exit stack) are skipped
    so a cheap job does not pay for timers it cannot need.
    """
    if handler is not None and type(handler).cleanup is not AgentHandler.cleanup:
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(deadline_s):
                await handler.cleanup(ctx)
    if getattr(ctx.resources, "_exit_callbacks", True):
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(deadline_s):
                await ctx.resources.aclose()
    release_job = getattr(ctx.gateway, "release_job", None)
    if release_job is not None:  # a lease the handler left open: revoke it, abort its turns
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(deadline_s):
                await release_job(job_id)
    end = getattr(llm_end, "end_session", None)
    if end is not None:
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(deadline_s):
                await end(job_id)


def build_trajectory(ctx: JobContext | None, job_id: str, group_id: str, timings: StageTimings,
                     reward: Reward | None, termination: TerminationReason | None, *,
                     state: JobState | None = None, error: JobError | None = None,
                     labels: Mapping[str, str] | None = None) -> Trajectory:
    """Every terminal job gets a trajectory, so a trainer's accounting is one delivery per job.

    A job that failed or was cancelled carries the turns RUN produced, reward 0, and
    ``termination`` saying why it ended. When RUN itself was cut (timeout, cancel), the turns
    the agent loop finished so far are taken from its live list in ``ctx.state``. ``state``
    and ``error`` (the job's terminal ones) and ``labels`` (the spec's client metadata) are
    carried as they are, so a trainer reading trajectories alone can tell outcomes apart.
    """
    outcome = ctx.outcome if ctx is not None else None
    partial = list(ctx.state.get(TURNS_KEY, ())) if ctx is not None and not outcome else []
    turns = list(outcome.turns) if outcome else partial
    segments = list(outcome.segments) if outcome else (
        list(ctx.state.get(SEGMENTS_KEY, ())) if ctx is not None else [])
    metadata = dict(outcome.metadata) if outcome else {}
    if reward is not None:
        metadata.update({f"reward.{k}": v for k, v in reward.info.items()})
    kinds = {t.logprobs_kind for t in turns}
    seed = ctx.state.get(SEED_KEY) if ctx is not None and turns else None
    return Trajectory(
        job_id=job_id, group_id=group_id, turns=turns,
        reward=reward.value if reward else 0.0,
        reward_components=dict(reward.components) if reward else {},
        termination=termination or (reward.termination if reward else None) or (
            outcome.termination if outcome else TerminationReason.ERROR),
        timings=timings, metadata=metadata, state=state, error=error,
        labels=dict(labels or {}), seed=seed if isinstance(seed, int) else None,
        logprobs_kind=kinds.pop() if len(kinds) == 1 else "", segments=segments)
